"""Parallel sampling: one request with n = 8 samples vs eight independent requests (the same
seeds), on the embedded target model, for a 1000-token prompt.

With n = 8 the prompt is computed once and the samples fork from it (copy-on-write of the
partly filled block). Eight independent requests each compute it, except that with prefix
caching on (the default) the ones admitted after the first step find the first ones' full blocks
in the cache: so both engines are measured, prefix caching on (default) and off. Every run uses
a prompt of its own (pseudo-random prose the model was not trained on: words drawn from a fixed
list), so no run is served from an earlier one's cache: the figures are cold. --max-tokens output
tokens per sample (default 16; with long outputs the shared decode dominates and the ratio falls
toward 1). Reports the seconds of each and the ratio (goal >= 3), the median of the per-round
ratios of --runs interleaved runs. Writes bench/results/parallel_sampling.json.
"""

from __future__ import annotations

import random
import time

import harness

from pyserve import LLM, SamplingParams

WORDS = ("river stone lantern quiet orbit meadow copper signal harbor velvet ember thistle canyon "
         "mirror saddle glacier pepper violin tundra marble cobalt willow falcon prism").split()


def prompt_ids(llm: LLM, seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += llm.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(64)) + ".\n", add_special_tokens=False)
    return ids[:num_tokens]


def main() -> None:
    ap = harness.parser(__doc__, "parallel_sampling", runs=5, device=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    engines = {"prefix_cache_on": LLM(device=args.device),
               "prefix_cache_off": LLM(device=args.device, enable_prefix_caching=False)}
    rounds = iter(range(10**6))  # a fresh prompt for every call: no run is a cache hit of another

    def sides(llm: LLM) -> dict:
        def forked(prompt: list[int]) -> list[list[int]]:
            params = SamplingParams(n=args.n, temperature=1.0, seed=7, max_tokens=args.max_tokens, ignore_eos=True)
            return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]

        def independent(prompt: list[int]) -> list[list[int]]:
            params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=args.max_tokens, ignore_eos=True)
                      for i in range(args.n)]
            return [o.outputs[0].token_ids for o in llm.generate([prompt] * args.n, params, use_tqdm=False)]

        return {"forked": forked, "independent": independent}

    def timed(llm: LLM, fn):
        def run() -> float:
            prompt = prompt_ids(llm, next(rounds), args.prompt_tokens)
            start = time.perf_counter()
            fn(prompt)
            return time.perf_counter() - start
        return run

    for llm in engines.values():  # warm-up (allocations, first calls)
        sides(llm)["forked"](prompt_ids(llm, next(rounds), args.prompt_tokens))
    fns = {f"{name}/{side}": timed(llm, fn) for name, llm in engines.items() for side, fn in sides(llm).items()}
    seconds = harness.interleaved(fns, args.runs)
    result = {**head, "n": args.n, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "runs": args.runs}
    for name, llm in engines.items():
        forked, independent = seconds[f"{name}/forked"], seconds[f"{name}/independent"]
        probe = prompt_ids(llm, next(rounds), 64)
        same = sides(llm)["forked"](probe) == sides(llm)["independent"](probe)  # the same samples either way
        ratio = harness.median_ratio(independent, forked)
        result[name] = {"forked_s": forked, "independent_s": independent, "ratio": ratio, "same_samples": same}
        print(f"{name}: n={args.n}, {args.prompt_tokens}-token prompt, {args.max_tokens} tokens each: forked "
              f"{harness.median(forked):.3f} s, independent {harness.median(independent):.3f} s -> {ratio:.2f}x "
              f"(same samples: {same})")
    result["ratio"] = result["prefix_cache_on"]["ratio"]
    harness.write_report(args.out, result)
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
