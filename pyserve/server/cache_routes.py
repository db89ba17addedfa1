"""The semantic cache's own routes (with `--semantic-cache`; they need the server's API key, so
a server without `--api-key` refuses them): `GET /v1/cache` (the caller's tenant's figures: its
entries, bytes, hits, misses and stores; the server's are in /v1/stats and /metrics) and
`POST /v1/cache/invalidate` ({"model": NAME} or {}), which drops the caller's tenant's entries
(of that model, or all) and answers how many."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pyserve.http.responses import json_body, json_response
from pyserve.server.chat_cache import ChatCache
from pyserve.server.tenants import tenant_of
from pyserve.http.errors import BadRequest, Forbidden
from pyserve.server.state import ServerState


def _cache(state: ServerState) -> ChatCache:
    assert state.cache is not None  # the routes exist only with --semantic-cache
    if state.settings.api_key is None:
        raise Forbidden("the cache routes need the server's API key (start it with --api-key)")
    return state.cache


async def cache_info(request: Request) -> Response:
    return json_response(_cache(request.app.state.pyserve).tenant_figures(tenant_of(request)))


async def invalidate(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    cache = _cache(state)
    body = await json_body(request)
    unknown = sorted(set(body) - {"model"})
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field (give model, or nothing)", param=unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    if model is not None:
        state.models.resolve(model)  # a 404 naming what is served, for a model this server does not serve
    return json_response({"invalidated": cache.invalidate(tenant_of(request), model)})
