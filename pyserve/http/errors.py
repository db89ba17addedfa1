"""Errors a client can cause, typed once and rendered as OpenAI-shaped JSON; and the exception
handlers that render every error an app raises so (the server's and the router's)."""

from __future__ import annotations

import orjson
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

log = structlog.get_logger("pyserve.server")


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
    headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": "1"}}.get(err.status)
    return Response(error_body(err.status, err.type, err.message, err.param, err.code), err.status,
                    media_type="application/json", headers=headers)


async def _api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return Response(error_body(exc.status_code, type_, str(exc.detail)), exc.status_code,
                    media_type="application/json", headers=exc.headers)  # 405 keeps its Allow header


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal_error", path=request.url.path, error=repr(exc))
    return Response(error_body(500, "internal_error", "internal server error"), 500, media_type="application/json")


EXCEPTION_HANDLERS = {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}
