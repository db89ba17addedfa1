"""The Starlette application: routes, middleware, error mapping and the engine's lifespan (see
server.startup: the engine may still be loading when the socket answers)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from pyserve.http.errors import EXCEPTION_HANDLERS, NotFound, error_body
from pyserve.http.middleware import APIKeyMiddleware, BodyLimitMiddleware, InternalErrors, LoadingGate, cors
from pyserve.http.responses import json_response
from pyserve.http.version import version_info
from pyserve.server.batch_routes import (cancel_batch, create_batch, delete_file, file_content, list_batches, list_files,
                                         retrieve_batch, retrieve_file, upload_file)
from pyserve.server.cache_routes import cache_info, invalidate
from pyserve.server.embeddings_api import embeddings
from pyserve.server.lora_routes import load_lora_adapter, unload_lora_adapter
from pyserve.server.models import ModelSpec
from pyserve.server.openai_api import chat_completions, completions
from pyserve.server.openapi import openapi_document
from pyserve.server.responses_api import create_response, delete_response, list_input_items, retrieve_response
from pyserve.server.settings import ServerSettings
from pyserve.server.startup import Startup
from pyserve.server.state import ServerState
from pyserve.server.stats_api import server_stats
from pyserve.server.tokenize_api import detokenize, tokenize, tokenizer_info
from pyserve.server.web_routes import PAGES, PUBLIC_PATHS, asset, page

if TYPE_CHECKING:
    from pyserve.engine.async_engine import AsyncEngine

log = structlog.get_logger("pyserve.server")

UPLOAD_ENVELOPE_BYTES = 64 << 10  # a multipart upload's parts and headers beside the file itself


def _model_cards(state: ServerState) -> list[dict]:
    cards = state.models.cards()
    if state.encoder is not None:
        cards.append({"id": state.encoder.name, "object": "model", "created": state.models.created,
                      "owned_by": "pyserve", "root": state.encoder.source, "parent": None,
                      "max_model_len": state.encoder.max_input_tokens, "pyserve_kind": "embedding"})
    return cards


async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": _model_cards(request.app.state.pyserve)})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id}: the card of one model, adapter, route or encoder."""
    model_id = request.path_params["model_id"]
    card = next((c for c in _model_cards(request.app.state.pyserve) if c["id"] == model_id), None)
    if card is None:
        raise NotFound(f"model {model_id!r} does not exist", param="model", code="model_not_found")
    return json_response(card)


async def health(request: Request) -> Response:
    """200 when every served model's engine is alive and stepping; else 503 naming the first
    that is not (`model`)."""
    startup: Startup = request.app.state.startup
    if startup.status in ("loading", "downloading"):
        return json_response({"status": startup.status}, 503)
    if startup.status == "failed":
        return json_response({"status": "failed", "error": repr(startup.error)}, 503)
    state: ServerState = request.app.state.pyserve
    for model in state.models:
        health = model.engine.health()
        named = {"model": model.name} if len(state.models) > 1 else {}
        if health.status == "dead":
            return json_response({"status": "dead", "error": repr(health.error), **named}, 503)
        if health.status == "stalled":
            return json_response({"status": "stalled", **named,
                                  "seconds_without_step": round(health.seconds_without_step, 3)}, 503)
    return json_response({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    return PlainTextResponse(state.metrics.registry.render(), media_type="text/plain; version=0.0.4")


async def openapi(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    return json_response(openapi_document(state.settings, state.models.names(),
                                          [state.encoder.name] if state.encoder is not None else []))


def build_app(models: AsyncEngine | Callable[[], AsyncEngine] | Mapping[str, ModelSpec], settings: ServerSettings,
              on_load_failure: Callable[[BaseException], None] | None = None) -> Starlette:
    """`models`: name -> ModelSpec, or one engine served as `settings.served_model_name` with
    `settings.lora_modules`. An engine given built is served at once (the lifespan starts it, or
    the caller does when no lifespan runs); a function building one is called in a thread once
    the lifespan has begun, so the socket answers meanwhile (see server.startup);
    `on_load_failure` is told if one raises.
    """
    if not isinstance(models, Mapping):
        models = {settings.served_model_name: ModelSpec(models, dict(settings.lora_modules))}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if startup.in_background:
            startup.begin()
        else:
            await startup.run()
        try:
            yield
        finally:
            await startup.stop()
            log.info("server_stopped")

    public = {"/health", "/openapi.json", *PUBLIC_PATHS} | ({"/metrics", "/v1/stats"} if settings.public_metrics
                                                           else set())
    upload_limit = settings.batch_max_file_bytes + UPLOAD_ENVELOPE_BYTES
    middleware = [Middleware(InternalErrors), Middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                                                         path_limits={"/v1/files": upload_limit})]
    if settings.allowed_origins:  # outermost: a preflight carries no API key
        middleware.insert(0, cors(settings.allowed_origins))
    internal_key = secrets.token_hex(16)  # what the batch runner's in-process requests present
    if settings.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=settings.api_key, public_paths=frozenset(public),
                                     internal_key=internal_key))
    middleware.append(Middleware(LoadingGate, open_paths=frozenset({"/health", *PUBLIC_PATHS})))
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            *([Route("/v1/cache", cache_info, methods=["GET"]),
               Route("/v1/cache/invalidate", invalidate, methods=["POST"])] if settings.semantic_cache else []),
            Route("/v1/files", upload_file, methods=["POST"]),
            Route("/v1/files", list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
            Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
            Route("/v1/batches", create_batch, methods=["POST"]),
            Route("/v1/batches", list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/stats", server_stats, methods=["GET"]),
            *(Route(path, page, methods=["GET"]) for path in PAGES),
            Route("/web/{name}", asset, methods=["GET"]),
            Route("/version", version_info, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            *([Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
               Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])] if settings.lora_root else []),
        ],
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    startup = Startup(app, dict(models), settings, on_load_failure)
    app.state.startup = startup
    app.state.internal_headers = {"Authorization": f"Bearer {internal_key}"} if settings.api_key else {}
    return app
