"""Runs an eval set through one configuration's server and measures it.

Generating items are sent streamed (chat for `messages`, completions for `prompt`) so that
time to first token and the gaps between tokens are seen as a client sees them; `choice` and
`perplexity` items are scored from prompt logprobs (/tokenize for the token boundary, then
/v1/completions with echo, logprobs and max_tokens 0). `concurrency` requests are in flight.
The device-seconds of a configuration are the wall time of its measured run (it holds the
machine alone); its cost is those seconds at its price per hour.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import orjson

from pyserve.eval.configs import EvalConfig
from pyserve.eval.items import ChoiceItem, PerplexityItem
from pyserve.eval.scorers import Score, score_choice, score_perplexity, score_text


DEFAULT_MAX_TOKENS = 64  # an item's output when it sets no max_tokens


class ServerError(RuntimeError):
    """The server answered an eval request with an error (the message is its body)."""


@dataclass(slots=True)
class Timing:
    ttft: float | None = None  # seconds to the first token (generating items)
    gaps: list[float] = field(default_factory=list)  # seconds between streamed chunks with tokens
    e2e: float = 0.0
    output_tokens: int = 0


@dataclass(slots=True)
class ItemResult:
    id: str
    score: Score
    timing: Timing
    output: str = ""


class Client:
    """One configuration's server, as the eval talks to it."""

    def __init__(self, base_url: str, cfg: EvalConfig, model: str, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        if not cfg.semantic_cache:  # a server's cache (a url one's) would replay the warm-up's answers
            headers["Cache-Control"] = "no-store"
        self.http = httpx.AsyncClient(base_url=base_url.removesuffix("/v1"), timeout=timeout, headers=headers)
        self.cfg, self.model = cfg, model

    async def close(self) -> None:
        await self.http.aclose()

    async def _post(self, path: str, body: dict) -> dict:
        r = await self.http.post(path, json=body)
        if r.status_code != 200:
            raise ServerError(f"{path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def _sampling(self, item) -> dict:
        max_tokens = min(item.max_tokens or DEFAULT_MAX_TOKENS, self.cfg.max_tokens or DEFAULT_MAX_TOKENS << 20)
        body = {"model": self.model, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p,
                "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.cfg.seed is not None:
            body["seed"] = self.cfg.seed
        if item.stop:
            body["stop"] = item.stop
        return body

    async def generate(self, item) -> tuple[str, Timing]:
        body = self._sampling(item)
        if item.messages is not None:
            messages = list(item.messages)
            if self.cfg.system_prompt is not None:
                messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
            path, body["messages"] = "/v1/chat/completions", messages
        else:
            path, body["prompt"] = "/v1/completions", self.cfg.prompt_template.replace("{prompt}", item.prompt)
        timing, parts = Timing(), []
        start = last = time.perf_counter()
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise ServerError(f"{path}: {r.status_code} {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    raise ServerError(f"{path}: {chunk['error']}")
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):  # each chunk carries new tokens (its text may be held back)
                    delta = choice.get("delta") or {}
                    if "role" in delta and not delta.get("content"):
                        continue  # a chat stream's opening chunk: no token yet
                    text = choice.get("text") if "text" in choice else delta.get("content")
                    now = time.perf_counter()
                    if timing.ttft is None:
                        timing.ttft = now - start
                    else:
                        timing.gaps.append(now - last)
                    last = now
                    parts.append(text or "")
        timing.e2e = time.perf_counter() - start
        return "".join(parts), timing

    async def continuation_logprobs(self, context: str, continuation: str) -> list[float]:
        """The logprobs of `continuation`'s tokens after `context` (tokenized together, split
        where the context's own tokens end)."""
        ctx = (await self._post("/tokenize", {"model": self.model, "prompt": context}))["tokens"]
        whole = (await self._post("/tokenize", {"model": self.model, "prompt": context + continuation}))["tokens"]
        body = {"model": self.model, "prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
        logprobs = (await self._post("/v1/completions", body))["choices"][0]["logprobs"]["token_logprobs"]
        return [float(v) for v in logprobs[split_point(ctx, whole):]]

    async def run_item(self, item) -> ItemResult:
        start = time.perf_counter()
        if isinstance(item, ChoiceItem):
            lls = [math.fsum(await self.continuation_logprobs(item.prompt, c)) for c in item.choices]
            return ItemResult(item.id, score_choice(item, lls), Timing(e2e=time.perf_counter() - start))
        if isinstance(item, PerplexityItem):
            lps = await self.continuation_logprobs(item.prompt, item.reference)
            return ItemResult(item.id, score_perplexity(item, lps), Timing(e2e=time.perf_counter() - start))
        text, timing = await self.generate(item)
        return ItemResult(item.id, await asyncio.to_thread(score_text, item, text), timing, text)


async def run_items(client: Client, items: list, concurrency: int, on_done=None) -> list[ItemResult]:
    """Every item through `client`, `concurrency` at a time; results in item order. An item whose
    request fails raises (the configuration fails, reported with the error)."""
    semaphore = asyncio.Semaphore(concurrency)
    results: list[ItemResult | None] = [None] * len(items)

    async def one(i: int) -> None:
        async with semaphore:
            results[i] = await client.run_item(items[i])
        if on_done is not None:
            on_done()

    await asyncio.gather(*(one(i) for i in range(len(items))))
    return results


def split_point(context: list[int], whole: list[int]) -> int:
    """Where the continuation's tokens begin in `whole` (context and continuation tokenized
    together): after the tokens it shares with the context alone, so a token spanning the
    boundary belongs to the continuation; at least 1 (the first token has no logprob) and at most
    len(whole) - 1 (a continuation has a token)."""
    shared = 0
    for a, b in zip(context, whole):
        if a != b:
            break
        shared += 1
    return max(1, min(shared, len(whole) - 1))


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
