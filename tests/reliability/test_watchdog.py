"""The watchdog: requests held with no step completing for T seconds mark the engine stalled
(logged, /health 503) until a step completes again; an idle engine is never stalled."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import structlog

from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.engine.watchdog import Watchdog
from pyserve.server.app import build_app
from pyserve.server.settings import ServerSettings


class FakeCore:
    def __init__(self):
        self.unfinished, self.last_progress = False, 0.0

    def seconds_without_progress(self, now: float) -> float:
        return now - self.last_progress if self.unfinished else 0.0

    def stats(self) -> dict:
        return {"num_requests_running": 1, "num_requests_waiting": 2}


def test_stall_is_flagged_past_the_timeout_logged_once_and_cleared_by_progress():
    core = FakeCore()
    dog = Watchdog(core, timeout=10.0)
    with structlog.testing.capture_logs() as logs:
        assert not dog.check(100.0)  # idle: no requests, however long ago the last step
        core.unfinished = True
        core.last_progress = 95.0
        assert not dog.check(100.0) and not dog.stalled  # 5 s < 10 s
        assert dog.check(106.0) and dog.stalled_for == 11.0
        assert dog.check(107.0) and dog.stalled_for == 12.0
        core.last_progress = 107.5  # a step completed
        assert not dog.check(108.0) and not dog.stalled
    events = [e["event"] for e in logs]
    assert events == ["engine_stalled", "engine_progressing_again"]
    assert logs[0]["running"] == 1 and logs[0]["waiting"] == 2 and logs[0]["seconds_without_step"] == 11.0


@pytest.mark.asyncio
async def test_a_hung_forward_fails_health_until_the_step_completes(llama_dir):
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=256, watchdog_timeout=0.3))
    app = build_app(engine, ServerSettings(served_model_name="tiny"))
    execute = engine.worker.execute
    hang = {"seconds": 0.0}

    def slow_execute(*args):
        time.sleep(hang["seconds"])  # on the engine's thread, as a stuck kernel would be
        return execute(*args)

    engine.worker.execute = slow_execute
    await engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            await asyncio.sleep(0.5)  # idle longer than the timeout: still healthy
            assert (await c.get("/health")).json() == {"status": "ok"}
            hang["seconds"] = 1.5
            request = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.9)
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "stalled"
            assert r.json()["seconds_without_step"] > 0.3
            hang["seconds"] = 0.0
            done = await request
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
            await asyncio.sleep(0.3)  # the next check sees the completed step
            assert (await c.get("/health")).json() == {"status": "ok"}
    finally:
        await engine.stop()
