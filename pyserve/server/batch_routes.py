"""/v1/files and /v1/batches in the OpenAI shapes, so that the `openai` client's `files` and
`batches` calls work unchanged. Files and jobs belong to the tenant that created them (the
bearer key and the `X-Tenant` header, as the semantic cache scopes them): another tenant's id is
a 404. Without `--data-dir` every route answers 404 saying so."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from pyserve.http.responses import json_body, json_response
from pyserve.server.tenants import tenant_of
from pyserve.http.errors import BadRequest, NotFound, PayloadTooLarge
from pyserve.server.state import ServerState

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}
_WINDOW = re.compile(r"^(\d{1,7})([smh])$")
MAX_WINDOW_SECONDS = 7 * 24 * 3600  # OpenAI's only window is 24h; this server takes up to a week
MAX_METADATA = (16, 64, 512)  # keys, characters of a key, of a value: OpenAI's bounds


def _service(request: Request):
    state: ServerState = request.app.state.pyserve
    if state.batches is None:
        raise NotFound("the Batch API is off: start the server with --data-dir DIR", code="batch_api_off")
    return state.batches


def _public_batch(service, batch: dict) -> dict:
    """The stored batch with its request counts and usage (OpenAI's shape) as the answered lines stand."""
    completed, failed = service.store.counts(batch["id"])
    input_tokens, cached, output_tokens, reasoning = service.store.usage(batch["id"])
    return {**batch, "request_counts": {"total": batch["request_counts"]["total"], "completed": completed,
                                        "failed": failed},
            "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                      "total_tokens": input_tokens + output_tokens}}


async def upload_file(request: Request) -> Response:
    service = _service(request)
    form = await request.form(max_files=1, max_fields=4, max_part_size=service.max_file_bytes + 1)
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise BadRequest(f"purpose: {purpose!r} is not supported here (only 'batch')", param="purpose")
    if upload is None or isinstance(upload, str):
        raise BadRequest("file: a file part is required", param="file")
    content = await upload.read()
    if len(content) > service.max_file_bytes:
        raise PayloadTooLarge(f"file: {len(content)} bytes; files take at most {service.max_file_bytes}",
                              param="file")
    file_id = await asyncio.to_thread(service.store.write_content, content)  # a large one: seconds off the loop
    record = service.store.add_written_file(tenant_of(request), purpose, upload.filename or "upload.jsonl", file_id,
                                            len(content))
    return json_response(record.public())


def _file(request: Request):
    service = _service(request)
    record = service.store.file(request.path_params["file_id"], tenant_of(request))
    if record is None:
        raise NotFound(f"no file {request.path_params['file_id']!r}", param="file_id")
    return service, record


def _page(request: Request, items: list[dict], default_limit: int, max_limit: int,
          public=lambda item: item) -> Response:
    """OpenAI's list page of `items` (newest first, each with its "id"): those after the `after`
    id, at most `limit` of them, as `public` shows them, with first_id, last_id and has_more."""
    after = request.query_params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    try:
        limit = int(request.query_params.get("limit", default_limit))
    except ValueError:
        raise BadRequest("limit: must be an integer", param="limit") from None
    if not 1 <= limit <= max_limit:
        raise BadRequest(f"limit: must be 1 to {max_limit}, got {limit}", param="limit")
    page = [public(item) for item in items[:limit]]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


async def list_files(request: Request) -> Response:
    service = _service(request)
    files = [r.public() for r in service.store.files(tenant_of(request), request.query_params.get("purpose"))]
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order: must be asc or desc, got {order!r}", param="order")
    return _page(request, files[::-1] if order == "asc" else files, 10_000, 10_000)


async def retrieve_file(request: Request) -> Response:
    return json_response(_file(request)[1].public())


async def file_content(request: Request) -> Response:
    service, record = _file(request)
    return Response(service.store.content(record.id), media_type="application/jsonl")


async def delete_file(request: Request) -> Response:
    service, record = _file(request)
    reader = next((b["id"] for _, b in service.store.active_batches() if b["input_file_id"] == record.id), None)
    if reader is not None:  # its lines are read again if the server restarts before the job ends
        raise BadRequest(f"file_id: {record.id} is the input of {reader}, which has not finished "
                         "(cancel it, or wait for it to end)", param="file_id")
    service.store.delete_file(record.id)
    return json_response({"id": record.id, "object": "file", "deleted": True})


async def create_batch(request: Request) -> Response:
    service = _service(request)
    body = await json_body(request)
    unknown = sorted(set(body) - BATCH_FIELDS)
    if unknown:
        raise BadRequest(f"{unknown[0]}: not a batch field (give {', '.join(sorted(BATCH_FIELDS))})", param=unknown[0])
    owner = tenant_of(request)
    if body.get("endpoint") not in ENDPOINTS:
        raise BadRequest(f"endpoint: {body.get('endpoint')!r} is not supported (one of {', '.join(ENDPOINTS)})",
                         param="endpoint")
    window = _WINDOW.match(str(body.get("completion_window")))
    seconds = int(window[1]) * {"s": 1, "m": 60, "h": 3600}[window[2]] if window else 0
    if not 1 <= seconds <= MAX_WINDOW_SECONDS:
        raise BadRequest("completion_window: give a duration such as '24h' (also '90m' or '30s'), at most "
                         f"{MAX_WINDOW_SECONDS // 3600}h", param="completion_window")
    record = service.store.file(str(body.get("input_file_id")), owner)
    if record is None:
        raise NotFound(f"input_file_id: no file {body.get('input_file_id')!r}", param="input_file_id")
    if record.purpose != "batch":
        raise BadRequest(f"input_file_id: the file's purpose is {record.purpose!r}, not 'batch'",
                         param="input_file_id")
    metadata = body.get("metadata")
    keys, key_chars, value_chars = MAX_METADATA
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= keys and all(
            isinstance(v, str) and len(k) <= key_chars and len(v) <= value_chars for k, v in metadata.items())):
        raise BadRequest(f"metadata: an object of at most {keys} strings (keys up to {key_chars} characters, "
                         f"values up to {value_chars})", param="metadata")
    now = int(time.time())
    batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": body["endpoint"], "errors": None,
             "input_file_id": record.id, "completion_window": body["completion_window"], "status": "validating",
             "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
             "expires_at": now + seconds, "finalizing_at": None, "completed_at": None, "failed_at": None,
             "expired_at": None, "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
             "model": None}  # the model the lines name, once they are checked
    service.store.add_batch(owner, batch)
    service.runner.wake.set()
    return json_response(_public_batch(service, batch))


def _batch(request: Request):
    service = _service(request)
    batch = service.store.batch(request.path_params["batch_id"], tenant_of(request))
    if batch is None:
        raise NotFound(f"no batch {request.path_params['batch_id']!r}", param="batch_id")
    return service, batch


async def retrieve_batch(request: Request) -> Response:
    service, batch = _batch(request)
    return json_response(_public_batch(service, batch))


async def list_batches(request: Request) -> Response:
    service = _service(request)
    return _page(request, service.store.batches(tenant_of(request)), 20, 100, lambda b: _public_batch(service, b))


async def cancel_batch(request: Request) -> Response:
    service, batch = _batch(request)
    if batch["status"] not in ("validating", "in_progress"):
        raise BadRequest(f"batch {batch['id']} is {batch['status']}: only a validating or in-progress batch can be "
                         "cancelled", param="batch_id")
    batch.update(status="cancelling", cancelling_at=int(time.time()))
    service.store.save_batch(batch)
    service.runner.wake.set()
    return json_response(_public_batch(service, batch))
