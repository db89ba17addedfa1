"""Pure ASGI middleware: API-key auth, the request body size limit, the gate that answers 503
while the model loads, the CORS settings the server and the router share, and the last word on
an unexpected error.

Auth decisions use the ASGI path (never a URL rebuilt from the Host header), deny by default, and
compare keys in constant time. The `Bearer` scheme is matched case-insensitively (RFC 9110: auth
schemes are), the key exactly, whatever whitespace stands around it (`bearer_key`: the tenant is
read the same way).
"""

from __future__ import annotations

import hmac

import structlog
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from pyserve.http.errors import error_body

log = structlog.get_logger("pyserve.server")


def cors(origins: list[str]) -> Middleware:
    """Browser pages from `origins` may call the API; to be outermost (a preflight carries no key)."""
    return Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])


async def _send_error(send, status: int, type_: str, message: str, extra_headers=()) -> None:
    body = error_body(status, type_, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def bearer_key(value: bytes) -> bytes | None:
    """The key of an Authorization value `Bearer KEY` (the scheme in any case, spaces or tabs
    around the key); None for another scheme or no key."""
    parts = value.split(None, 1)
    if len(parts) != 2 or parts[0].lower() != b"bearer":
        return None
    return parts[1].strip()


class APIKeyMiddleware:
    def __init__(self, app, api_key: str, public_paths: frozenset[str], internal_key: str | None = None):
        """`internal_key`: a second key, for the server's own in-process requests (batch lines)."""
        self.app = app
        self.expected = api_key.encode()
        self.internal = internal_key.encode() if internal_key else None
        self.public_paths = public_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = bearer_key(value) or b""
                break
        known = hmac.compare_digest(given, self.expected) or (
            self.internal is not None and hmac.compare_digest(given, self.internal))
        if not given or not known:
            return await _send_error(send, 401, "authentication_error", "invalid or missing API key",
                                     [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413, from Content-Length or while streaming."""

    def __init__(self, app, max_bytes: int, path_limits: dict[str, int] | None = None):
        """`path_limits`: paths with a limit of their own (file uploads)."""
        self.app = app
        self.default_max = max_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        return await self._limited(scope, receive, send, self.path_limits.get(scope["path"], self.default_max))

    async def _limited(self, scope, receive, send, max_bytes: int):
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > max_bytes
                except ValueError:
                    return await _send_error(send, 400, "invalid_request_error", "invalid Content-Length")
                if too_big:
                    return await _send_error(send, 413, "invalid_request_error",
                                             f"request body exceeds {max_bytes} bytes")
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _send_error(send, 413, "invalid_request_error", f"request body exceeds {max_bytes} bytes")


class LoadingGate:
    """503 (`service_unavailable`, Retry-After: 1) on every path but `open_paths` until the app's
    Startup (`app.state.startup`, see server.startup) is ready: the handlers need the engine."""

    def __init__(self, app, open_paths: frozenset[str]):
        self.app = app
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        status = scope["app"].state.startup.status
        if status == "ready":
            return await self.app(scope, receive, send)
        message = (f"the model is {status}; retry once /health answers 200" if status in ("loading", "downloading")
                   else "the model failed to load; the server is exiting")
        return await _send_error(send, 503, "service_unavailable", message, [(b"retry-after", b"1")])


class InternalErrors:
    """An error no handler answered becomes a 500 in OpenAI's shape, and the connection serves
    on: Starlette's own last handler re-raises after answering, and the HTTP server then drops
    the keep-alive connection, failing the client's next request on it. Outermost but for CORS;
    a response already started can only be cut (re-raised)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:
                raise
            log.error("internal_error", path=scope["path"], error=repr(e))
            await _send_error(send, 500, "internal_error", "internal server error")
