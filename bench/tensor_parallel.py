"""Tensor parallelism on the CPU: one rank vs two gloo ranks (one thread each: the machine's two
cores split between them) vs one rank on both cores, on a Llama built here (random weights: the
tokens are compared, not their sense).

Per configuration and batch size (--batches): greedy decode of --tokens tokens after a 64-token
prompt; the step time (decode wall time / steps), and for two ranks rank 0's seconds inside
collectives per step (step inputs broadcast, the two all-reduces per layer, the logits
all-gather), the rest counted as compute. The greedy tokens of two ranks must equal one rank's.
Medians of --runs interleaved runs. Writes bench/results/tensor_parallel.json.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

import harness
from batch1_decode import MODELS, build
from pyserve import LLM, SamplingParams


def decode(llm: LLM, batch: int, tokens: int, seed: int) -> tuple[float, float, int, list[list[int]]]:
    """(seconds, collective seconds, steps, tokens) of one greedy decode of `batch` prompts."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 500) for _ in range(64)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # the prompts cached
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    comm = after.get("tensor_parallel_comm_seconds", 0.0) - before.get("tensor_parallel_comm_seconds", 0.0)
    return seconds, comm, after["num_steps"] - before["num_steps"], [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = harness.parser(__doc__, "tensor_parallel", runs=3)
    ap.add_argument("--model", choices=sorted(MODELS), default="25m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / args.model, MODELS[args.model])
        threads = torch.get_num_threads()
        configs = {"1 rank, all threads": (1, threads), "1 rank, 1 thread": (1, 1), "2 ranks": (2, None)}
        engines = {}
        for name, (size, n_threads) in configs.items():
            if n_threads is not None:
                torch.set_num_threads(n_threads)
            engines[name] = LLM(str(model_dir), tensor_parallel_size=size, max_model_len=256)
        torch.set_num_threads(threads)  # rank 0 of the group took its share; the header reports the process's
        head = harness.header(__file__)
        harness.print_header(head)
        results: dict[str, dict[int, list]] = {name: {b: [] for b in args.batches} for name in configs}
        tokens: dict[str, dict[int, list]] = {name: {} for name in configs}
        for run in range(args.runs):
            for name, (size, n_threads) in configs.items():
                if n_threads is not None:
                    torch.set_num_threads(n_threads)
                else:
                    torch.set_num_threads(max(1, threads // 2))
                for b in args.batches:
                    seconds, comm, steps, toks = decode(engines[name], b, args.tokens, seed=run * 100 + b)
                    results[name][b].append((seconds / steps, comm / steps))
                    tokens[name][b] = toks
        torch.set_num_threads(threads)
        for llm in engines.values():
            llm.close()
    report = {**head, "model": args.model, "runs": args.runs, "tokens": args.tokens, "per_batch": {}}
    for b in args.batches:
        same = tokens["2 ranks"][b] == tokens["1 rank, all threads"][b]
        row = {"greedy_tokens_identical": same}
        for name in configs:
            step = harness.median(s for s, _ in results[name][b])
            comm = harness.median(c for _, c in results[name][b])
            row[name] = {"step_ms": round(1000 * step, 3), "comm_ms": round(1000 * comm, 3),
                         "compute_ms": round(1000 * (step - comm), 3)}
        report["per_batch"][b] = row
        two, one = row["2 ranks"], row["1 rank, all threads"]
        print(f"batch {b}: step {one['step_ms']:.2f} ms on 1 rank ({row['1 rank, 1 thread']['step_ms']:.2f} ms on 1 "
              f"thread), {two['step_ms']:.2f} ms on 2 ranks = {two['comm_ms']:.2f} ms in collectives + "
              f"{two['compute_ms']:.2f} ms compute; greedy tokens identical: {same}", flush=True)
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
