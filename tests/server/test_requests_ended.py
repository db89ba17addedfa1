"""Requests the server ends itself (ServerState.end_requests: a shutdown whose --shutdown-timeout
runs out, pyserve.server.draining_server): a stream's last event is an error saying why, a
non-streamed request is a 503 saying it, and their outcome is counted as "shutdown"."""

from __future__ import annotations

import asyncio
import json

import pytest

from pyserve.testing.in_process import serving
from pyserve.testing.metrics import parse_metrics

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 240, "ignore_eos": True, "temperature": 0}


async def _end_once_generating(client, engine) -> None:
    """Ends the requests being answered once the engine has generated for them."""
    state = client._transport.app.state.pyserve
    before = engine.stats()["generation_tokens"]
    while not (state.answering and engine.stats()["generation_tokens"] > before):
        await asyncio.sleep(0.001)
    state.end_requests("the server is shutting down")


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [True, False])
async def test_an_ended_request_says_why_and_counts_as_shutdown(llama_dir, stream):
    async with serving(llama_dir, num_kv_blocks=128, block_size=4) as (engine, client):
        ending = asyncio.create_task(_end_once_generating(client, engine))
        r = await client.post("/v1/completions", json={**BODY, "stream": stream})
        await ending
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"  # after the error event, as vLLM's streams end
            assert json.loads(events[-2])["error"]["message"] == "the server is shutting down"
            assert 1 <= len(events) - 2 < 240  # some text went out before the end, not all of it
        else:
            assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
        metrics = parse_metrics((await client.get("/metrics")).text)
        assert metrics['pyserve:request_outcomes_total{model="tiny",outcome="shutdown"}'] == 1
        for _ in range(200):  # its sequences aborted (the engine takes the abort at its next step)
            if engine.stats()["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.01)
        assert (engine.stats()["num_requests_running"], engine.stats()["num_requests_waiting"]) == (0, 0)
        assert engine.stats()["generation_tokens"] < 240
        ok = await client.post("/v1/completions", json={**BODY, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
