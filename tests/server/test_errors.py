"""Errors a client can cause: one status and OpenAI type each, one JSON shape."""

from __future__ import annotations

import orjson
import pytest

from pyserve.http.errors import BadRequest, NotFound, TooManyRequests, Unauthorized, Unavailable, error_response


@pytest.mark.parametrize("cls, status, type_", [
    (BadRequest, 400, "invalid_request_error"), (Unauthorized, 401, "authentication_error"),
    (NotFound, 404, "not_found_error"), (TooManyRequests, 429, "rate_limit_error"),
    (Unavailable, 503, "service_unavailable"),
])
def test_each_error_has_its_status_type_and_openai_body(cls, status, type_):
    r = error_response(cls("max_tokens: too big", param="max_tokens"))
    assert r.status_code == status
    assert orjson.loads(r.body) == {"error": {"message": "max_tokens: too big", "type": type_, "param": "max_tokens",
                                              "code": None}}
    assert (r.headers.get("www-authenticate") == "Bearer") == (status == 401)
    assert (r.headers.get("retry-after") == "1") == (status == 429)  # a full queue: try again shortly


def test_an_unexpected_error_is_a_500_and_the_connection_serves_on():
    """Before: Starlette re-raised after its 500 and uvicorn dropped the keep-alive connection,
    so the client's next request on it failed."""
    import socket
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from pyserve.http.errors import EXCEPTION_HANDLERS
    from pyserve.http.middleware import InternalErrors

    async def boom(request):
        raise RuntimeError("a bug")

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/boom", boom), Route("/ok", ok)], middleware=[Middleware(InternalErrors)],
                    exception_handlers=EXCEPTION_HANDLERS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            answers = []
            for path in ("/boom", "/ok"):
                conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                data = b""
                while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                        data.split(b"content-length: ")[1].split(b"\r\n")[0]):
                    chunk = conn.recv(65536)
                    assert chunk, f"the connection was closed after {answers}"
                    data += chunk
                answers.append(data)
        assert answers[0].startswith(b"HTTP/1.1 500") and b'"type":"internal_error"' in answers[0]
        assert answers[1].startswith(b"HTTP/1.1 200") and answers[1].endswith(b"ok")
    finally:
        server.should_exit = True
        thread.join(5)
