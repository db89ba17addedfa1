"""A load generator for any OpenAI-compatible server on loopback (pyserve or a peer).

Datasets (prompts are text, made exact in length by decode/re-encode with the model's tokenizer):
  random         input lengths in [L * (1 - r), L * (1 + r)] (--input-len, --range-ratio)
  shared-prefix  --num-prefixes prefixes of --prefix-len tokens, each request one of them plus a
                 random suffix of --input-len tokens, shuffled
  chat           a chat-like mix: short questions, medium requests, a few long documents
Arrivals: a gamma process at --request-rate requests/s (--burstiness 1 = Poisson, < 1 burstier),
or all at once (--request-rate inf); at most --max-concurrency requests in flight. Every request
streams /v1/completions with a fixed output length (max_tokens = --output-len, ignore_eos) and asks
for the usage chunk. Per request: TTFT, inter-token latencies (between content chunks), end-to-end
latency, output tokens (from usage). Reports request and output-token throughput, TTFT / TPOT /
ITL / E2EL mean, median and p99 in ms, and goodput (requests/s meeting every --slo), as JSON
(--out) and a short table. Bounded: --num-prompts requests, --max-duration seconds.

  python bench/serving.py --base-url http://127.0.0.1:8000 --model pyserve-default --dataset random
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import orjson

CHAT_MIX = ((0.6, 32, 128), (0.3, 256, 128), (0.1, 1024, 64))  # (share, input tokens, output tokens)


@dataclass(slots=True)
class Request:
    prompt: str
    input_len: int
    output_len: int


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    output_tokens: int = 0
    input_tokens: int = 0


class ExactText:
    """Random text of an exact token length under a tokenizer (decode, re-encode, trim, repeat)."""

    def __init__(self, tokenizer_path: Path, seed: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_path))
        special = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        # Tokens that are printable text on their own and encode back to themselves: random byte
        # fragments would decode to U+FFFD and re-encode to something else.
        self.ids = sorted(i for t, i in self.tok.get_vocab().items() if t not in special
                          and (d := self.tok.decode([i])).isascii() and d.isprintable()
                          and self.tok.encode(d, add_special_tokens=False).ids == [i])
        self.rng = random.Random(seed)

    def text(self, n: int) -> str:
        ids = [self.rng.choice(self.ids) for _ in range(n)]
        for _ in range(50):
            text = self.tok.decode(ids)
            got = self.tok.encode(text, add_special_tokens=False).ids
            if len(got) == n:
                return text
            ids = got[:n] if len(got) > n else got + [self.rng.choice(self.ids) for _ in range(n - len(got))]
        raise RuntimeError(f"could not make text of exactly {n} tokens")

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def make_requests(args, gen: ExactText) -> list[Request]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "random":
        lo, hi = max(1, int(args.input_len * (1 - args.range_ratio))), int(args.input_len * (1 + args.range_ratio))
        reqs = [Request(gen.text(length := rng.randint(lo, hi)), length, args.output_len) for _ in range(n)]
    elif args.dataset == "shared-prefix":
        prefixes = [gen.text(args.prefix_len) for _ in range(args.num_prefixes)]
        reqs = []
        for i in range(n):
            prompt = prefixes[i % len(prefixes)] + gen.text(args.input_len)
            reqs.append(Request(prompt, gen.count(prompt), args.output_len))
        rng.shuffle(reqs)
    else:
        reqs = []
        for _ in range(n):
            x, acc = rng.random(), 0.0
            for share, inp, out in CHAT_MIX:
                acc += share
                if x <= acc:
                    break
            reqs.append(Request(gen.text(inp), inp, out))
    return reqs


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request starts: gamma(shape=burstiness, mean=1/rate); zeros for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, model: str, req: Request) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.input_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2el = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage chunk"
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def run(args, reqs: list[Request]) -> tuple[list[Result], float]:
    url = args.base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(args.max_concurrency or len(reqs))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    delays = arrival_delays(len(reqs), args.request_rate, args.burstiness, args.seed)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.max_duration), headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def limited(req: Request) -> Result:
            async with sem:
                return await one(client, url, args.model, req)

        start = time.perf_counter()
        tasks = []
        for req, delay in zip(reqs, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(req)))
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, args.max_duration - (time.perf_counter() - start)))
        for t in pending:
            t.cancel()
        elapsed = time.perf_counter() - start
    return [t.result() if t in done else Result(error="timed out") for t in tasks], elapsed


def stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(values)
    return {"mean": round(1000 * statistics.fmean(s), 2), "median": round(1000 * statistics.median(s), 2),
            "p99": round(1000 * s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)], 2)}


def summarize(results: list[Result], elapsed: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    good = [r for r in ok if r.ttft * 1000 <= slos.get("ttft", math.inf) and r.e2el * 1000 <= slos.get("e2el", math.inf)
            and (r.output_tokens <= 1 or (r.e2el - r.ttft) / (r.output_tokens - 1) * 1000 <= slos.get("tpot", math.inf))]
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": round(elapsed, 3),
        "input_tokens": sum(r.input_tokens for r in ok), "output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": round(len(ok) / elapsed, 3),
        "output_throughput": round(sum(r.output_tokens for r in ok) / elapsed, 2),
        "goodput": round(len(good) / elapsed, 3), "slo_ms": slos,
        "ttft_ms": stats_ms([r.ttft for r in ok]), "tpot_ms": stats_ms(tpot),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]), "e2el_ms": stats_ms([r.e2el for r in ok]),
    }


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loop = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = host == "localhost"
    if not loop:
        raise SystemExit(f"bench/serving.py only targets loopback servers, got {host!r}")


def parse_args(argv=None):
    from pyserve.default_model import TARGET_DIR

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="pyserve-default")
    ap.add_argument("--tokenizer", type=Path, default=TARGET_DIR / "tokenizer.json")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--dataset", choices=["random", "shared-prefix", "chat"], default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--request-rate", type=float, default=math.inf)
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-duration", type=float, default=600.0)
    ap.add_argument("--slo", action="append", default=[], metavar="METRIC=MS",
                    help="goodput SLO, e.g. --slo ttft=500 --slo tpot=100 (ttft, tpot, e2el)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_loopback(args.base_url)
    slos = {k: float(v) for k, _, v in (s.partition("=") for s in args.slo)}
    reqs = make_requests(args, ExactText(args.tokenizer, args.seed))
    results, elapsed = asyncio.run(run(args, reqs))
    report = {"dataset": args.dataset, "num_prompts": len(reqs), "request_rate": args.request_rate,
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "input_lens": [r.input_len for r in reqs], **summarize(results, elapsed, slos)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['completed']} ok / {report['failed']} failed in {report['duration_s']} s: "
          f"{report['request_throughput']} req/s, {report['output_throughput']} output tok/s, "
          f"goodput {report['goodput']} req/s")
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = report[m]
        print(f"  {m[:-3].upper():5} mean {s['mean']:9.2f}  median {s['median']:9.2f}  p99 {s['p99']:9.2f} ms")
    return report


if __name__ == "__main__":
    main()
