"""`pyserve router` cache-aware vs round-robin over --replicas local replicas (2; loopback, the embedded
model, each replica on its own process), on multi-turn chats that share system prompts.

Each run: --systems system prompts of --system-words random words (text the model never saw),
--conversations chats each opening with one of them, --turns turns each (a 12-word user message,
a 16-token answer appended to the history), --concurrency chats at a time. Both routers run over
the same replicas; the policies take turns run by run, each run with texts of its own.
--kv-blocks sets each replica's KV pool: "tight" holds about half of the run's system prompts
(what data parallelism is for: together the replicas hold what one cannot), "roomy" all of them.

Figures per policy (median over runs): the replicas' prefix-cache hit rate over the run (tokens
served from cache / prompt tokens looked up), TTFT p50 and p99 (streamed, to the first content
token, client side), and the largest in-flight difference between the replicas (router gauge,
sampled every 20 ms) against the configured --balance-abs-threshold.
Goals (issue 25): hit rate >= 3x round-robin's, TTFT p50 <= 0.5x, imbalance within the bound.
Writes bench/results/router.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import harness
import httpx

from pyserve.server.child_server import start_router, start_server, stop_server
from pyserve.testing import parse_metrics

MODEL = "pyserve-default"
WORDS = ("amber basalt cobalt dune ember fjord garnet heron iris jade kestrel lumen marble nectar onyx pewter quartz "
         "raven sable topaz umber velvet willow xenon yarrow zephyr").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))


def replica_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=30).text, MODEL)
        hits += m["pyserve:prefix_cache_hits_total"]
        queries += m["pyserve:prefix_cache_queries_total"]
    return hits, queries


async def conversation(client: httpx.AsyncClient, router: str, system: str, rng: random.Random, turns: int,
                       ttfts: list[float]) -> None:
    history = [{"role": "system", "content": system}]
    for _ in range(turns):
        history.append({"role": "user", "content": words(rng, 12)})
        body = {"model": MODEL, "messages": history, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "stream": True}
        start, first, answer = time.perf_counter(), None, []
        async with client.stream("POST", router + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"]
                text = delta[0]["delta"].get("content") if delta else None
                if text:
                    first = first or time.perf_counter()
                    answer.append(text)
        ttfts.append((first or time.perf_counter()) - start)
        history.append({"role": "assistant", "content": "".join(answer)})


async def imbalance_sampler(router: str, stop: asyncio.Event, out: list[float]) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            m = parse_metrics((await client.get(router + "/metrics")).text)
            loads = [v for k, v in m.items() if k.startswith("pyserve_router:replica_in_flight")]
            out.append(max(loads) - min(loads))
            await asyncio.sleep(0.02)


async def one_run(router: str, replicas: list[str], args, seed: int) -> dict:
    rng = random.Random(seed)
    systems = [words(rng, args.system_words) for _ in range(args.systems)]
    chats = [(systems[i % args.systems], random.Random(seed * 1000 + i)) for i in range(args.conversations)]
    hits0, queries0 = replica_counts(replicas)
    ttfts: list[float] = []
    gaps: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(imbalance_sampler(router, stop, gaps))
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def run(system, crng):
            async with gate:
                await conversation(client, router, system, crng, args.turns, ttfts)
        await asyncio.gather(*(run(s, c) for s, c in chats))
    stop.set()
    await sampler
    hits1, queries1 = replica_counts(replicas)
    return {"hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1), "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * harness.p99(ttfts),
            "max_inflight_gap": max(gaps, default=0.0), "requests": len(ttfts)}


def main() -> None:
    ap = harness.parser(__doc__, "router", runs=3)
    ap.add_argument("--systems", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, nargs="+", default=[300, 2000],
                    help="each replica's KV pool (16-token blocks), one setting after another")
    ap.add_argument("--balance-abs-threshold", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2, help="local replicas (more than the cores: TTFT means little)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # replicas on the machine's cores: one thread each
    head = harness.header(__file__)
    harness.print_header(head)
    workload = ("systems", "system_words", "conversations", "turns", "concurrency", "balance_abs_threshold", "replicas")
    report = {**head, "runs": args.runs, "workload": {k: getattr(args, k) for k in workload}, "settings": []}
    policies = ("cache_aware", "round_robin")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for kv_blocks in args.kv_blocks:
            flags = ("--embedding-model", "none", "--num-kv-blocks", str(kv_blocks))
            procs = [start_server(None, *flags, workdir=work) for _ in range(args.replicas)]
            urls = [url for _, url in procs]
            routers = {p: start_router(urls, "--policy", p, "--balance-abs-threshold",
                                       str(args.balance_abs_threshold), workdir=work) for p in policies}
            try:
                results: dict[str, list[dict]] = {p: [] for p in policies}
                for run in range(args.runs):
                    order = policies if run % 2 == 0 else policies[::-1]
                    for i, p in enumerate(order):
                        results[p].append(asyncio.run(one_run(routers[p][1], urls, args, seed=1 + 10 * run + i)))
            finally:
                for proc, _ in [*routers.values(), *procs]:
                    stop_server(proc)
            summary = {p: {k: round(harness.median(r[k] for r in rs), 4) for k in rs[0]} for p, rs in results.items()}
            ca, rr = summary["cache_aware"], summary["round_robin"]
            setting = {"kv_blocks_per_replica": kv_blocks, "per_policy": summary, "per_run": results,
                       "hit_rate_ratio": round(harness.median_ratio([r["hit_rate"] for r in results["cache_aware"]],
                                                                    [r["hit_rate"] for r in results["round_robin"]]), 3),
                       "ttft_p50_ratio": round(harness.median_ratio(
                           [r["ttft_p50_ms"] for r in results["cache_aware"]],
                           [r["ttft_p50_ms"] for r in results["round_robin"]]), 3)}
            report["settings"].append(setting)
            print(f"kv blocks {kv_blocks}/replica: hit rate {ca['hit_rate']:.3f} vs {rr['hit_rate']:.3f} round-robin "
                  f"= {setting['hit_rate_ratio']}x (goal >= 3); TTFT p50 {ca['ttft_p50_ms']:.1f} vs "
                  f"{rr['ttft_p50_ms']:.1f} ms = {setting['ttft_p50_ratio']}x (goal <= 0.5); p99 "
                  f"{ca['ttft_p99_ms']:.1f} vs {rr['ttft_p99_ms']:.1f} ms; largest in-flight gap "
                  f"{ca['max_inflight_gap']:.0f} (bound {args.balance_abs_threshold})", flush=True)
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
