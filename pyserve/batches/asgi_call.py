"""One request to the server's own ASGI app, in process: how a batch line is answered exactly as
the same request over HTTP would be (every check, every middleware), without a socket.

Used by the server's batch runner and by `pyserve batch`. Written here rather than through
httpx's ASGITransport: a line needs one JSON POST and its whole answer, and the transport's
client machinery (request and response models, streams, auth and
redirect handling) cost about a sixth of the server loop's time while a job ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson

# Set in the ASGI scope by the server's own in-process requests (a batch line: its job's owner);
# an HTTP client cannot set a scope key, only headers. The server's tenant_of reads it.
TENANT_SCOPE_KEY = "pyserve.tenant"


async def post_json(app: Callable, path: str, body: dict, headers: dict[str, str],
                    tenant: str | None = None) -> tuple[int, dict]:
    """(status, JSON body) of POST `path` with `body`; a body that is not JSON raises
    ValueError. An exception in the app is its 500 answer (the server's error middleware sends it,
    then re-raises), not the caller's, as with httpx's `raise_app_exceptions=False`. `tenant`: who
    the request is made for (TENANT_SCOPE_KEY; a scope key no HTTP client can set)."""
    raw = orjson.dumps(body)
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in headers.items())],
        "client": ("127.0.0.1", 0), "server": ("pyserve.batches", 80),
        **({TENANT_SCOPE_KEY: tenant} if tenant is not None else {}),
    }
    sent = False
    answered = asyncio.Event()
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await answered.wait()  # the caller stays until the whole answer is sent
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:  # noqa: BLE001 - answered with a 500 (status stays 500 if nothing was sent)
        pass
    finally:
        answered.set()
    return status, orjson.loads(b"".join(chunks))
