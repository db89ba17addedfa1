"""A dead engine (the model worker raised) turns every request, and /health, into a 503.

The app runs in process, driven through httpx's ASGI transport; that transport runs no lifespan,
so each test starts and stops the engine itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.server.app import build_app
from pyserve.server.settings import ServerSettings

MODEL = "tiny"


@contextlib.asynccontextmanager
async def running_app(model_dir):
    engine = AsyncEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=512))
    app = build_app(engine, ServerSettings(served_model_name=MODEL))
    await engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            yield engine, client
    finally:
        await engine.stop()


def device_lost(out, rows, *rest):
    raise RuntimeError("device lost")


def completion(stream: bool = False, max_tokens: int = 8) -> dict:
    return {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def sse_events(text: str) -> list[str]:
    return [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "device lost" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


async def assert_health_dead(client: httpx.AsyncClient) -> None:
    r = await client.get("/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "dead" and "device lost" in body["error"]


@pytest.mark.asyncio
async def test_worker_failure_gives_503_and_health_503(llama_dir):
    async with running_app(llama_dir) as (engine, client):
        ok = await client.post("/v1/completions", json=completion())
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        assert (await client.get("/health")).json() == {"status": "ok"}

        engine.worker.execute = device_lost
        assert_unavailable(await client.post("/v1/completions", json=completion()))
        await assert_health_dead(client)
        # after death: refused before anything is queued, streaming or not, chat or not
        assert_unavailable(await client.post("/v1/completions", json=completion(stream=True)))
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert_unavailable(await client.post("/v1/chat/completions", json=chat))
        await assert_health_dead(client)
        # a request that is wrong anyway is still told so
        bad = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": 9})
        assert bad.status_code == 400


@pytest.mark.asyncio
async def test_in_flight_requests_fail_when_the_worker_dies(llama_dir):
    async with running_app(llama_dir) as (engine, client):
        real_execute = engine.worker.execute
        broken = False

        def execute(out, rows, *rest):
            if broken:
                raise RuntimeError("device lost")
            return real_execute(out, rows, *rest)

        engine.worker.execute = execute
        plain = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=400)))
        streamed = asyncio.create_task(client.post("/v1/completions", json=completion(stream=True, max_tokens=400)))
        for _ in range(10_000):  # both running in the engine, neither can have finished (400 tokens)
            if engine.stats()["num_requests_running"] == 2:
                break
            await asyncio.sleep(0.001)
        assert engine.stats()["num_requests_running"] == 2
        broken = True

        assert_unavailable(await plain)
        r = await streamed
        assert r.status_code == 200  # the stream had started: the error comes as its last event, then [DONE]
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "service_unavailable" and "device lost" in err["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])

        await assert_health_dead(client)
        assert_unavailable(await client.post("/v1/completions", json=completion()))
        metrics = (await client.get("/metrics")).text
        assert f'pyserve:request_outcomes_total{{model="{MODEL}",outcome="engine_dead"}} 2' in metrics


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["queued", "generating"])
async def test_cancelled_non_streaming_request_frees_its_sequences(llama_dir, when):
    """The server cancels a handler that outlives its shutdown grace period: its sequences are
    aborted at once, not left to run to max_tokens, whether the handler was still queueing them
    (awaiting the engine's answer to the add) or already waiting for their tokens."""
    async with running_app(llama_dir) as (engine, client):
        task = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=400)))
        for _ in range(100_000):
            if when == "queued" and engine.output_processor._streams:  # registered, add not answered yet
                break
            if when == "generating" and engine.stats()["generation_tokens"] >= 3:
                break
            await asyncio.sleep(0 if when == "queued" else 0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(2_000):
            if engine.stats()["num_requests_running"] + engine.stats()["num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.001)
        stats = engine.stats()
        assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
        assert stats["kv_cache_usage_perc"] == 0
        assert stats["generation_tokens"] < 400
        assert not engine.output_processor._streams


def _fail_after(calls: int, fn, where: str):
    count = {"n": 0}

    def broken(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise RuntimeError(f"fault injected in the {where}")
        return fn(*args, **kwargs)

    return broken


def _break_forward(engine):
    # the model's forward (its attention in the backend or the Rust layer kernel) and, for CPU
    # steps of few rows, the whole model in one Rust call
    engine.worker.model.forward = _fail_after(6, engine.worker.model.forward, "forward")
    whole = engine.worker.whole_model
    if whole is not None:
        whole.forward = _fail_after(6, whole.forward, "forward")


def _break_sampler(engine):
    engine.worker._sample = _fail_after(0, engine.worker._sample, "sampler")
    engine.worker.verifier.sample_and_verify = _fail_after(0, engine.worker.verifier.sample_and_verify, "sampler")


def _break_output_processor(engine):
    engine.output_processor._apply = _fail_after(2, engine.output_processor._apply, "output processor")


def _break_proposer(engine):
    engine.worker.propose = _fail_after(0, engine.worker.propose, "draft model")


@pytest.mark.asyncio
@pytest.mark.parametrize("where, breaker, spec", [
    ("forward", _break_forward, None),
    ("sampler", _break_sampler, None),
    ("output processor", _break_output_processor, None),
    ("draft model", _break_proposer, {"method": "draft_model", "num_speculative_tokens": 2}),
])
async def test_a_fault_anywhere_fails_in_flight_requests_and_health(llama_dir, where, breaker, spec):
    """Whichever component raises, every waiting client gets a 503 (or a closing SSE error
    event) within seconds, /health turns 503, and nothing hangs."""
    config = EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=512,
                          speculative_config=spec and spec | {"model": str(llama_dir)})
    engine = AsyncEngine(config)
    app = build_app(engine, ServerSettings(served_model_name=MODEL))
    await engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            breaker(engine)
            sampled = {"temperature": 0.8, "seed": 1}  # through the sampler, not the greedy argmax path
            plain = client.post("/v1/completions", json=completion(max_tokens=64) | sampled)
            streamed = client.post("/v1/completions", json=completion(stream=True, max_tokens=64) | sampled)
            r_plain, r_stream = await asyncio.wait_for(asyncio.gather(plain, streamed), timeout=30)
            assert r_plain.status_code == 503 and "fault injected" in r_plain.json()["error"]["message"], where
            if r_stream.status_code == 200:
                *_, last, done = sse_events(r_stream.text)
                assert json.loads(last)["error"]["type"] == "service_unavailable" and done == "[DONE]", where
            else:
                assert r_stream.status_code == 503
            health = await client.get("/health")
            assert health.status_code == 503 and "fault injected" in health.json()["error"]
    finally:
        await engine.stop()
