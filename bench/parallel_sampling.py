"""Parallel sampling: one request with n = 8 samples vs eight independent requests (the same
seeds), on the embedded target model, for a 1000-token prompt.

With n = 8 the prompt is computed once and the samples fork from it (copy-on-write of the
partly filled block); eight independent requests admitted together each compute it. Every run
uses a prompt of its own (pseudo-random prose the model was not trained on: words drawn from a
fixed list), so the prefix cache never serves it: the figure is the cold one. --max-tokens
output tokens per sample (default 16; with long outputs the shared decode dominates and the
ratio falls toward 1). Reports the seconds of each and the ratio (goal >= 3), the median of
--runs interleaved runs. Writes bench/results/parallel_sampling.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from pyserve import LLM, SamplingParams

HERE = Path(__file__).resolve().parent
WORDS = ("river stone lantern quiet orbit meadow copper signal harbor velvet ember thistle canyon "
         "mirror saddle glacier pepper violin tundra marble cobalt willow falcon prism").split()


def prompt_ids(llm: LLM, seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += llm.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(64)) + ".\n", add_special_tokens=False)
    return ids[:num_tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "parallel_sampling.json")
    args = ap.parse_args()
    llm = LLM(device=args.device)

    def forked(prompt: list[int]) -> list[list[int]]:
        params = SamplingParams(n=args.n, temperature=1.0, seed=7, max_tokens=args.max_tokens, ignore_eos=True)
        return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]

    def independent(prompt: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=args.max_tokens, ignore_eos=True)
                  for i in range(args.n)]
        return [o.outputs[0].token_ids for o in llm.generate([prompt] * args.n, params, use_tqdm=False)]

    forked(prompt_ids(llm, 10_000, args.prompt_tokens))  # warm-up (allocations, first calls)
    seconds: dict[str, list[float]] = {"forked": [], "independent": []}
    same = True
    for run in range(args.runs):
        for name, fn in (("forked", forked), ("independent", independent)):
            prompt = prompt_ids(llm, 2 * run + (name == "independent"), args.prompt_tokens)
            start = time.perf_counter()
            fn(prompt)
            seconds[name].append(time.perf_counter() - start)
        probe = prompt_ids(llm, 20_000 + run, 64)
        same &= forked(probe) == independent(probe)  # the same samples either way
    med = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = med["independent"] / med["forked"]
    result = {
        "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
        "n": args.n, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "runs": args.runs,
        "seconds": seconds, "median_s": med, "ratio": ratio, "same_samples": same,
    }
    print(f"n={args.n}, {args.prompt_tokens}-token prompt (uncached), {args.max_tokens} tokens each: "
          f"forked {med['forked']:.3f} s, independent {med['independent']:.3f} s -> {ratio:.2f}x "
          f"(same samples: {same})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    llm.close()


if __name__ == "__main__":
    main()
