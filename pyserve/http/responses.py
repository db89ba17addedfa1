"""JSON request bodies (an object, or a 400 saying why not) and JSON responses."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pyserve.http.errors import BadRequest


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
