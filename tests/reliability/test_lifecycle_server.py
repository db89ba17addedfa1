"""The randomized lifecycle against a live server: 1000 HTTP requests (chat and completions,
streaming or not, n > 1, three LoRA adapters by model name, n-gram speculation), a quarter of
them abandoned by their client mid-stream or mid-wait. Afterwards the server holds nothing: no
running or waiting sequence, every KV block free or cached, one logged outcome per request it
handled."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pyserve.testing import scrape_metrics, start_server, stop_server

REQUESTS = 1000
KEY = "k"


def metrics(base: str) -> dict[str, float]:
    return {k.removeprefix("pyserve:"): v for k, v in scrape_metrics(base, KEY, "tiny").items()}


def outcomes(base: str) -> dict[str, float]:
    prefix = 'request_outcomes_total{outcome="'
    return {k[len(prefix):].split('"')[0]: v for k, v in metrics(base).items() if k.startswith(prefix)}


async def one(client: httpx.AsyncClient, rng: random.Random, models: list[str], tally: dict) -> None:
    n, max_tokens = rng.choice([1, 1, 2]), rng.randint(1, 12)
    body = {"model": rng.choice(models), "max_tokens": max_tokens, "n": n, "temperature": rng.choice([0.0, 1.0]),
            "seed": rng.randrange(100), "ignore_eos": rng.random() < 0.5, "stream": rng.random() < 0.5}
    text = " ".join(rng.choice(["def", "x", "(", ")", "return", "+", "1"]) for _ in range(rng.randint(1, 30)))
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    abandon = rng.random() < 0.25
    if not body["stream"]:
        try:
            r = await client.post(path, json=body, timeout=rng.uniform(0.01, 0.3) if abandon else 120)
        except httpx.TimeoutException:
            tally["abandoned"] += 1  # perhaps before the server even read the request
            return
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= n * max_tokens
        tally["completed"] += 1
        return
    async with client.stream("POST", path, json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if abandon and chunks >= 2:
                    tally["abandoned"] += 1
                    tally["abandoned_mid_stream"] += 1  # the server was handling it
                    return  # hangs up mid-stream
                if line == "data: [DONE]":
                    tally["completed"] += 1
                    return
    tally["abandoned" if abandon else "short"] += 1  # a stream shorter than 2 chunks, or ended early


@pytest.mark.asyncio
async def test_random_http_lifecycle_leaves_nothing_behind(llama_dir, adapter_dirs, tmp_path):
    modules = [f"a{i}={p}" for i, p in enumerate(adapter_dirs)]
    proc, base = start_server(llama_dir, "--served-model-name", "tiny", "--api-key", KEY, "--block-size", "4",
                              "--num-kv-blocks", "160", "--max-num-seqs", "16", "--lora-modules", *modules,
                              "--max-loras", "2", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                              workdir=tmp_path)
    try:
        rng = random.Random(7)
        tally = {"completed": 0, "abandoned": 0, "abandoned_mid_stream": 0, "short": 0}
        gate = asyncio.Semaphore(16)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=base, headers=headers, limits=httpx.Limits(max_connections=32)) as c:
            async def gated(seed: float) -> None:
                async with gate:
                    await one(c, random.Random(seed), ["tiny", "a0", "a1", "a2"], tally)

            await asyncio.wait_for(asyncio.gather(*(gated(rng.random()) for _ in range(REQUESTS))), timeout=900)
        assert tally["short"] == 0 and tally["completed"] + tally["abandoned"] == REQUESTS, tally
        assert tally["abandoned"] > 100
        for _ in range(200):  # the server notices the last hang-ups
            m = metrics(base)
            if (m["num_requests_running"], m["num_requests_waiting"], m["kv_cache_usage_perc"]) == (0, 0, 0):
                break
            await asyncio.sleep(0.05)
        assert (m["num_requests_running"], m["num_requests_waiting"], m["kv_cache_usage_perc"]) == (0, 0, 0), m
        assert m["kv_free_blocks"] + m["kv_cached_blocks"] == m["kv_total_blocks"] - 1
        assert m["spec_decode_num_drafts_total"] > 0
        logged = outcomes(base)
        # Every request the server handled is logged once; a client that timed out early may have
        # hung up before its request was read, so those may be missing.
        assert tally["completed"] + tally["abandoned_mid_stream"] <= sum(logged.values()) <= REQUESTS, (logged, tally)
        assert logged["ok"] >= tally["completed"], logged
        assert set(logged) <= {"ok", "disconnected"}, logged
        assert httpx.get(base + "/health").json() == {"status": "ok"}
    finally:
        assert stop_server(proc) == 0
