"""HTTP streaming vs the offline engine: throughput, TTFT and ITL on the same requests.

The same requests (prompts 16-200 token ids, outputs 16-64 tokens, greedy, EOS ignored) run on the
~25M Llama of bench/offline.py, fp32 on CPU:
  offline, all at once     LLM.generate on every request (max_num_seqs 256)
  offline, matched         LLM.generate with max_num_seqs = the HTTP client's concurrency
  HTTP                     `pyserve serve` on loopback; an asyncio client streams /v1/completions
                           with at most --concurrency requests in flight, each started as soon as
                           a slot frees; TTFT and inter-token latency are measured per SSE chunk
The goal (HTTP >= 0.80 x offline) is judged against the matched run: at the same number of
sequences in flight, what remains is what HTTP, JSON, SSE and the client cost. The client runs on
the same machine as the server and shares its cores. The three runs are interleaved --repeats
times (one server serves every HTTP run); throughputs are medians, TTFT and ITL percentiles pool
every HTTP run. Writes bench/results/http_vs_offline.json.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import torch

import harness
from offline import build_llama, workload  # the same model and request generator
from pyserve import LLM, SamplingParams
from pyserve.testing import start_server, stop_server

ENGINE = dict(num_kv_blocks=4096, max_num_batched_tokens=2048)  # as bench/offline.py
GOAL = 0.80
SERVED_NAME = "bench"


def run_offline(model_dir: Path, reqs, max_num_seqs: int) -> float:
    llm = LLM(str(model_dir), max_num_seqs=max_num_seqs, **ENGINE)
    try:
        warm = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2
        llm.generate([p for p, _ in reqs[:2]], warm, use_tqdm=False)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in reqs]
    return elapsed


async def stream_one(client: httpx.AsyncClient, prompt: list[int], n: int) -> dict:
    """One streaming completion: TTFT, the gaps between chunk arrivals, and usage."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk["choices"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {"ttft": arrivals[0] - start, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "tokens": usage["completion_tokens"], "chunks": len(arrivals), "e2e": end - start}


async def run_http(base: str, reqs, concurrency: int) -> tuple[float, list[dict]]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=600) as client:
        await stream_one(client, reqs[0][0], 4)  # warm-up: connection, first forward
        slots = asyncio.Semaphore(concurrency)

        async def limited(prompt, n):
            async with slots:
                return await stream_one(client, prompt, n)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p, n) for p, n in reqs))
        elapsed = time.perf_counter() - start
    assert [r["tokens"] for r in results] == [n for _, n in reqs], "a request got fewer tokens than asked"
    return elapsed, results


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> None:
    ap = harness.parser(__doc__, "http_vs_offline", runs=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16, help="HTTP requests in flight at most")
    ap.add_argument("--max-output", type=int, default=64, help="outputs are 16..this many tokens")
    ap.add_argument("--quick", action="store_true", help="16 requests of 16-32 tokens, one run (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_output, args.runs = 16, 32, 1
    head = harness.header(__file__)
    harness.print_header(head)
    reqs = workload(args.requests, max_output=args.max_output)
    useful = sum(n for _, n in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp))
        flags = ["--served-model-name", SERVED_NAME, "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
                 "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"])]
        proc, base = start_server(model_dir, *flags, workdir=model_dir)  # idle (blocked on its inbox) during the offline runs
        results: list[dict] = []  # every HTTP run's requests, pooled for the percentiles

        def http() -> float:
            t, res = asyncio.run(run_http(base, reqs, args.concurrency))
            results.extend(res)
            return t

        try:
            runs = harness.interleaved({
                "offline_all": lambda: run_offline(model_dir, reqs, max_num_seqs=256),
                "offline_matched": lambda: run_offline(model_dir, reqs, max_num_seqs=args.concurrency),
                "http": http,
            }, args.runs)
        finally:
            stop_server(proc)
    t_all, t_matched, t_http = (harness.median(runs[k]) for k in ("offline_all", "offline_matched", "http"))
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    tps = {"offline_all": useful / t_all, "offline_matched": useful / t_matched, "http": useful / t_http}
    ratio = tps["http"] / tps["offline_matched"]
    c = args.concurrency
    print(f"model: Llama ~25M params (bench/offline.py), fp32, {torch.get_num_threads()} threads; "
          f"{len(reqs)} requests, {prompt_tokens} prompt tokens, {useful} output tokens (16-{args.max_output} each)")
    for label, key, t in [(f"offline, all {len(reqs)} at once", "offline_all", t_all),
                          (f"offline, max_num_seqs={c}", "offline_matched", t_matched),
                          (f"HTTP streaming, {c} clients", "http", t_http)]:
        print(f"{label:<30}{tps[key]:8.1f} tok/s  (median of {args.runs}: {t:.2f} s)")
    print(f"ratio HTTP / offline(max_num_seqs={c}): {ratio:.2f} (goal >= {GOAL:.2f}); "
          f"vs offline all at once: {tps['http'] / tps['offline_all']:.2f}")
    print(f"  (the matched run has the same {c} sequences in flight as the HTTP clients, so the ratio "
          f"isolates the cost of HTTP/SSE and of a client sharing the server's CPU cores)")
    print(f"TTFT p50 {pct(ttft, 50) * 1e3:7.1f} ms   p99 {pct(ttft, 99) * 1e3:7.1f} ms")
    print(f"ITL  p50 {pct(itl, 50) * 1e3:7.1f} ms   p99 {pct(itl, 99) * 1e3:7.1f} ms   "
          f"(gaps between SSE chunk arrivals, {len(itl)} gaps)")
    harness.write_report(args.out, {
        "benchmark": "http_vs_offline", **head,
        "requests": len(reqs), "concurrency": c, "prompt_tokens": prompt_tokens, "output_tokens": useful,
        "max_output": args.max_output,
        "repeats": args.runs, "seconds": runs,
        "tok_per_s": tps, "ratio_http_over_offline_matched": ratio, "goal": GOAL,
        "ttft_ms": {"p50": pct(ttft, 50) * 1e3, "p99": pct(ttft, 99) * 1e3, "mean": statistics.mean(ttft) * 1e3},
        "itl_ms": {"p50": pct(itl, 50) * 1e3, "p99": pct(itl, 99) * 1e3, "mean": statistics.mean(itl) * 1e3},
    })


if __name__ == "__main__":
    main()
