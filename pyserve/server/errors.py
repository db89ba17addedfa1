"""Errors a client can cause, typed once and rendered as OpenAI-shaped JSON."""

from __future__ import annotations

import orjson
from starlette.responses import Response


class APIError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class BadRequest(APIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(APIError):
    status, type = 401, "authentication_error"


class Forbidden(APIError):
    status, type = 403, "permission_error"


class NotFound(APIError):
    status, type = 404, "not_found_error"


class PayloadTooLarge(APIError):
    status, type = 413, "invalid_request_error"


class TooManyRequests(APIError):
    status, type = 429, "rate_limit_error"


class Unavailable(APIError):
    status, type = 503, "service_unavailable"


def error_body(status: int, type_: str, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(err: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return Response(error_body(err.status, err.type, err.message, err.param, err.code), err.status,
                    media_type="application/json", headers=headers)
