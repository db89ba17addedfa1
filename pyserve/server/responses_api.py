"""The Responses API: POST /v1/responses, and with --data-dir GET and DELETE /v1/responses/{id}
and GET /v1/responses/{id}/input_items.

A request is served as the chat completion it amounts to (server.responses_items: its items and
fields as a chat body, checked as a chat body is), through the chat endpoint's own path
(`serve_chat`), so every model, adapter, route and cascade chat serves answers it; the chat
answer (one body, or its SSE chunks read by server.responses_stream) becomes the response.
A stored response keeps the conversation it answered, so that `previous_response_id` continues
it without the client resending it (and its prompt starts with the earlier one's tokens, which
the prefix cache holds).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pyserve.http import sse
from pyserve.http.errors import BadRequest, NotFound
from pyserve.http.responses import json_body, json_response
from pyserve.server.body import validate
from pyserve.server.openai_api import serve_chat
from pyserve.server.response_store import ResponseStore
from pyserve.server.responses_items import (chat_body, item_dicts, new_id, output_items, response_object,
                                            response_status, usage)
from pyserve.server.responses_schemas import NO_EFFECT_FIELDS, REFUSED_FIELDS, ResponsesRequest
from pyserve.server.responses_stream import ResponseEvents, event_bytes
from pyserve.server.schemas import ChatCompletionRequest
from pyserve.server.state import ServerState
from pyserve.server.tenants import tenant_of

# A chat body's field -> the Responses field it came from (for the errors the chat checks raise).
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "response_format": "text.format", "tools": "tools", "tool_choice": "tool_choice",
                     "max_prompt_tokens": "input"}
NOT_STORED = "responses are not stored on this server (start it with --data-dir DIR to keep them)"


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    req = validate(ResponsesRequest, await json_body(request), NO_EFFECT_FIELDS, REFUSED_FIELDS)
    store, owner = state.responses, tenant_of(request)
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if store is None:
            raise BadRequest(f"previous_response_id: {NOT_STORED}", param="previous_response_id")
        found = store.conversation(req.previous_response_id, owner)
        if found is None:
            raise BadRequest(f"previous_response_id: no stored response {req.previous_response_id!r}",
                             param="previous_response_id")
        earlier = found
    items = earlier + item_dicts(req)
    budget = _auto_budget(state, req) if req.truncation == "auto" else None
    try:
        chat = validate(ChatCompletionRequest, chat_body(req, items, budget))
    except BadRequest as e:
        raise _as_responses_error(e) from e
    response_id, created = new_id("resp"), int(time.time())
    stored = req.store and store is not None

    def finished(response: dict[str, Any]) -> None:
        if stored:
            store.add(owner, response, items)

    def shell(model: str) -> Callable[..., dict[str, Any]]:
        return lambda status, output=None, usage_=None, error=None: response_object(
            response_id, created, req, model, stored, status, output, usage_, error)

    try:
        answer = await serve_chat(request, state, chat)
    except BadRequest as e:
        raise _as_responses_error(e) from e
    headers = {k: v for k, v in answer.headers.items() if k.startswith("x-pyserve-")}
    if not req.stream:
        if answer.status_code != 200:  # the client left: nothing to say
            return answer
        body = orjson.loads(answer.body)
        output = output_items(body)
        response = shell(body["model"])(response_status(output), output, usage(body["usage"]))
        finished(response)
        return json_response(response, headers=headers)
    on_timeout = getattr(answer, "on_timeout", lambda: None)
    return sse.TimedStreamingResponse(_events(answer.body_iterator, req.model, shell, finished),
                                      state.settings.stream_timeout, on_timeout, headers)


async def _events(chunks: AsyncIterator[bytes], model: str, shell: Callable[[str], Callable[..., dict[str, Any]]],
                  finished: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
    """The Responses events of a chat SSE stream; closing this closes the chat stream (which
    aborts its engine requests)."""
    events: ResponseEvents | None = None
    pending = b""
    try:
        async for piece in chunks:
            pending += piece
            while b"\n\n" in pending:
                raw, pending = pending.split(b"\n\n", 1)
                if not raw.startswith(b"data: "):
                    continue
                if raw == sse.DONE.strip():
                    if events is not None:
                        closing, response = events.end()
                        for e in closing:
                            yield event_bytes(e)
                        finished(response)
                    async for _ in chunks:  # the chat stream ends itself: a request served, not one closed early
                        pass
                    return
                chunk = orjson.loads(raw[6:])
                if events is None:
                    events = ResponseEvents(shell(chunk.get("model", model)))
                    for e in events.start():
                        yield event_bytes(e)
                if "error" in chunk:
                    for e in events.failed(chunk):
                        yield event_bytes(e)
                    return
                for e in events.chunk(chunk):
                    yield event_bytes(e)
    finally:
        await chunks.aclose()


def _auto_budget(state: ServerState, req: ResponsesRequest) -> int:
    """The prompt budget truncation auto asks: the length of the model (of either model of a
    route) less the output asked (max_output_tokens, else one token), no more than a model's own
    budget."""
    route = state.models.routes.get(req.model)
    models = [route.serving(state.models.get(n)) for n in (route.small, route.large)] if route is not None \
        else [state.models.resolve(req.model)[0]]
    room = req.max_output_tokens or 1
    budget = min(min(m.engine.max_model_len - room, m.policy.max_prompt_tokens or m.engine.max_model_len)
                 for m in models)
    if budget < 1:
        raise BadRequest(f"max_output_tokens: {room} leaves no room for the input in the model's length",
                         param="max_output_tokens")
    return budget


def _as_responses_error(e: BadRequest) -> BadRequest:
    """A chat check's error named by the Responses field it is about."""
    if e.param is None:
        return e
    head = e.param.split(".", 1)[0]
    param = CHAT_TO_RESPONSES.get(head, e.param)
    message = e.message.removeprefix(f"{e.param}: ") if head != e.param else e.message.removeprefix(f"{head}: ")
    return BadRequest(f"{param}: {message}", param=param, code=e.code)


def _stored(request: Request) -> tuple[ResponseStore, str, str]:
    store = request.app.state.pyserve.responses
    if store is None:
        raise NotFound(NOT_STORED)
    return store, request.path_params["response_id"], tenant_of(request)


async def retrieve_response(request: Request) -> Response:
    store, response_id, owner = _stored(request)
    if request.query_params.get("stream") not in (None, "false"):
        raise BadRequest("stream: a stored response is returned whole", param="stream")
    found = store.get(response_id, owner)
    if found is None:
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return json_response(found[0])


async def delete_response(request: Request) -> Response:
    store, response_id, owner = _stored(request)
    if not store.delete(response_id, owner):
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def list_input_items(request: Request) -> Response:
    """A stored response's input items (earlier turns' included), newest first unless
    `order=asc`, `limit` (1-100, default 20) at a time after the item `after`."""
    store, response_id, owner = _stored(request)
    found = store.get(response_id, owner)
    if found is None:
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order: asc or desc", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("limit: an integer from 1 to 100", param="limit")
    items = found[1] if order == "asc" else found[1][::-1]
    after = q.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BadRequest(f"after: no item {after!r} in this response's input", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
