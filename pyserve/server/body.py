"""Request bodies (JSON parsing and schema validation, with errors that name the field) and JSON
response bodies."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from pyserve.server.errors import BadRequest
from pyserve.server.schemas import NO_EFFECT_FIELDS, REFUSED_FIELDS


async def json_body(request: Request) -> Any:
    body = await request.body()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json", headers=headers)


def validate(schema: type[BaseModel], data: dict[str, Any]):
    """`data` as `schema`; a field the schema does not serve is refused (see server.schemas),
    unless it cannot change the output or holds the value that means "off"."""
    for key, value in data.items():
        if key in schema.model_fields or key in NO_EFFECT_FIELDS:
            continue
        off = REFUSED_FIELDS.get(key)
        if off is None:
            raise BadRequest(f"{key}: unknown field (this server does not support it)", param=key)
        if not any(value == v and type(value) is type(v) or (value is None and v is None) for v in off):
            raise BadRequest(f"{key}: not supported by this server", param=key)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _field_path(err["loc"])
        raise BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from e


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> str | None:
    """The field an error is about: pydantic's location up to the first union member tag
    ('stop.str' -> 'stop', 'prompt.list[int].1' -> 'prompt', 'messages.0.role' stays)."""
    parts = []
    for x in loc:
        if isinstance(x, str) and (not x.isidentifier() or x in _TYPE_TAGS):
            break
        parts.append(str(x))
    return ".".join(parts) or None
