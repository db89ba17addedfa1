"""The server answers while its engine loads: /health 503 "loading" and every other route a 503
service_unavailable until the engine is built and started, then 200; a load that fails says so
and tells the caller (the CLI then exits non-zero: tests/test_cli.py).

The app runs in process with its lifespan (the Starlette router's lifespan context), driven
through httpx's ASGI transport; the load is held on an Event in its thread.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.server.app import build_app
from pyserve.server.settings import ServerSettings

MODEL = "tiny"
COMPLETION = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


async def wait_healthy(client: httpx.AsyncClient, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = await client.get("/health")
        if r.status_code != 503 or r.json()["status"] != "loading":
            return r
        await asyncio.sleep(0.02)
    raise AssertionError("still loading")


def assert_unavailable(r: httpx.Response, words: str) -> None:
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and words in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.asyncio
async def test_health_says_loading_until_the_engine_is_built_then_ok(llama_dir):
    release, called_on = threading.Event(), []

    def load() -> AsyncEngine:
        called_on.append(threading.current_thread().name)
        assert release.wait(60)
        return AsyncEngine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=64))

    app = build_app(load, ServerSettings(served_model_name=MODEL))
    async with app.router.lifespan_context(app), client_for(app) as client:
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        assert_unavailable(await client.post("/v1/completions", json=COMPLETION), "loading")
        assert_unavailable(await client.get("/v1/models"), "loading")
        release.set()
        r = await wait_healthy(client)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        done = await client.post("/v1/completions", json=COMPLETION)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL
    assert called_on == ["pyserve-load"]  # off the event loop's thread


@pytest.mark.asyncio
async def test_a_failed_load_reports_failed_and_tells_the_caller():
    failures = []

    def load() -> AsyncEngine:
        raise ValueError("no weights here")

    app = build_app(load, ServerSettings(served_model_name=MODEL), on_load_failure=failures.append)
    async with app.router.lifespan_context(app), client_for(app) as client:
        r = await wait_healthy(client)
        assert (r.status_code, r.json()) == (503, {"status": "failed", "error": "ValueError('no weights here')"})
        assert_unavailable(await client.post("/v1/completions", json=COMPLETION), "failed to load")
    assert [repr(e) for e in failures] == ["ValueError('no weights here')"]


async def wait_for(event: threading.Event, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not event.is_set():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_a_server_stopped_while_loading_never_starts_the_engine(llama_dir):
    entered, release, finished = threading.Event(), threading.Event(), threading.Event()

    def load() -> AsyncEngine:
        entered.set()
        release.wait(60)
        engine = AsyncEngine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=64))
        finished.set()
        return engine

    app = build_app(load, ServerSettings(served_model_name=MODEL))
    async with app.router.lifespan_context(app), client_for(app) as client:
        await wait_for(entered)
        assert (await client.get("/health")).json() == {"status": "loading"}
    release.set()  # the build finishes after the server stopped: its engine is dropped
    await wait_for(finished)
    await asyncio.sleep(0.2)
    assert app.state.startup.status == "loading"
    assert getattr(app.state, "pyserve", None) is None  # never published, never started


@pytest.mark.asyncio
async def test_a_built_engine_serves_at_once_without_a_lifespan(llama_dir):
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=64))
    app = build_app(engine, ServerSettings(served_model_name=MODEL))
    await engine.start()
    try:
        async with client_for(app) as client:
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    finally:
        await engine.stop()
