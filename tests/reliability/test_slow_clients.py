"""Streaming clients that stop reading: a chunk not accepted within --stream-timeout drops the
client, and more than --max-stream-buffer unread chunks abort its request at once; either way
its KV blocks come back and the engine keeps serving others.

The app runs in process and is called as an ASGI app with a `send` that never completes once the
body starts, which is what a full socket looks like to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.server.app import build_app
from pyserve.server.settings import ServerSettings


@contextlib.asynccontextmanager
async def running(model_dir, **settings):
    engine = AsyncEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256))
    app = build_app(engine, ServerSettings(served_model_name="tiny", **settings))
    await engine.start()
    try:
        yield engine, app
    finally:
        await engine.stop()


def stalled_client(body: dict):
    """ASGI scope/receive/send of a client that sends `body`, then never reads nor hangs up.
    `sent` collects what the server managed to send."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # never disconnects

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the socket is full: the send never completes

    return scope, receive, send, sent


LONG = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
        "stream": True}


async def wait_for(predicate, timeout: float) -> float:
    start = time.perf_counter()
    while not predicate():
        assert time.perf_counter() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.perf_counter() - start


def idle(engine) -> bool:
    s = engine.stats()
    return s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0 and s["kv_cache_usage_perc"] == 0.0


@pytest.mark.asyncio
async def test_a_client_that_stops_reading_is_dropped_after_the_stream_timeout(llama_dir):
    async with running(llama_dir, stream_timeout=0.5, max_stream_buffer=100_000) as (engine, app):
        scope, receive, send, sent = stalled_client(LONG)
        start = time.perf_counter()
        await asyncio.wait_for(app(scope, receive, send), timeout=20)
        assert 0.5 <= time.perf_counter() - start < 10
        assert sent[0]["status"] == 200 and len([m for m in sent if m["type"] == "http.response.body"]) == 1
        await wait_for(lambda: idle(engine), timeout=5)
        engine.scheduler.check_invariants()
        metrics = app.state.pyserve.metrics.registry.render()
        assert 'pyserve:request_outcomes_total{model="tiny",outcome="slow_client"} 1' in metrics
        # the engine serves the next client as usual
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json=LONG | {"stream": False, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.asyncio
async def test_unread_chunks_past_the_buffer_abort_the_request_at_once(llama_dir):
    async with running(llama_dir, stream_timeout=60, max_stream_buffer=8) as (engine, app):
        scope, receive, send, _ = stalled_client(LONG)
        task = asyncio.create_task(app(scope, receive, send))
        await wait_for(lambda: engine.stats()["generation_tokens"] > 0, timeout=10)
        # aborted by the output buffer bound long before its 200 tokens or the 60 s timeout. The
        # engine decodes on its own thread while the server's loop sees the ninth unread chunk
        # and the abort crosses back: how many tokens that takes follows the step's length
        # (this model's steps, one Rust call each: 44-66 seen)
        await wait_for(lambda: idle(engine), timeout=10)
        assert engine.stats()["generation_tokens"] < 100
        assert not engine.output_processor._streams and not engine.output_processor._samples
        engine.scheduler.check_invariants()
        task.cancel()  # the connection finally goes away
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_many_real_streams_that_never_read_do_not_stall_the_engine(llama_dir, tmp_path):
    """Live server, 16 sockets with tiny receive buffers streaming long outputs that they never
    read: a normal client is served meanwhile, and everything the stalled streams held comes back
    (on loopback the kernel's socket buffers may absorb whole outputs, so whether a stream is
    dropped or completes into the buffer is the kernel's call; the tests above pin the drop)."""
    import socket

    from pyserve.testing import scrape_metrics, start_server, stop_server

    proc, base = start_server(llama_dir, "--served-model-name", "tiny", "--block-size", "4", "--num-kv-blocks", "512",
                              "--stream-timeout", "1", "--max-stream-buffer", "16", workdir=tmp_path)
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps(LONG | {"max_tokens": 240, "logprobs": 5}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    sockets = []
    try:
        for _ in range(16):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(request)
            sockets.append(s)
        start = time.perf_counter()
        ok = httpx.post(base + "/v1/completions", json=LONG | {"stream": False, "max_tokens": 8}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        assert time.perf_counter() - start < 30
        deadline = time.perf_counter() + 60
        while True:
            values = scrape_metrics(base, model="tiny")
            outcomes = {k: v for k, v in values.items() if k.startswith("pyserve:request_outcomes_total")}
            if values["pyserve:num_requests_running"] == 0 and sum(outcomes.values()) == 17:
                break
            assert time.perf_counter() < deadline, values
            time.sleep(0.2)
        assert values["pyserve:kv_cache_usage_perc"] == 0 and values["pyserve:num_requests_waiting"] == 0
        assert set(outcomes) <= {'pyserve:request_outcomes_total{outcome="ok"}',
                                 'pyserve:request_outcomes_total{outcome="slow_client"}'}, outcomes
    finally:
        for s in sockets:
            s.close()
        assert stop_server(proc) == 0


@pytest.mark.parametrize("field, value", [("stream_timeout", 0), ("chat_template_timeout", -1.0),
                                          ("max_stream_buffer", 0)])
def test_settings_refuse_values_that_would_disable_the_bounds(field, value):
    with pytest.raises(ValueError, match=field):
        ServerSettings(served_model_name="m", **{field: value})
