"""Prefix caching on vs off, same requests, same process, on the embedded model (CPU unless
--device says otherwise):

  shared   a 2000-token system prompt shared by --requests requests (each with its own 24-token
           question), sent one after another; TTFT = the time to the first token (max_tokens=1).
           The cache-on engine sees the system prompt once before timing. Goal: p50 ratio <= 0.1.
  unique   --batch requests with unrelated 256-token prompts, 32 tokens each, all at once; output
           throughput. Goal: cache on >= 0.99x of cache off (the lookups cost nothing).
Ratios are medians over --runs interleaved runs. Writes bench/results/prefix_cache.json, with
every TTFT sample (bench/plots.py draws their distribution).
"""

from __future__ import annotations

import json
import random
import time

import harness
from pyserve import LLM, SamplingParams
from pyserve.default_model import TARGET_DIR


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]  # 0-4 are the special tokens


def main() -> None:
    ap = harness.parser(__doc__, "prefix_cache", runs=3, device=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    vocab = json.loads((TARGET_DIR / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    system = random_ids(rng, 2000, vocab)
    engines = {on: LLM(device=args.device, enable_prefix_caching=on) for on in (True, False)}
    head = harness.header(__file__)  # after the engines: torch is imported
    harness.print_header(head)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engines[True].generate([system + random_ids(rng, 24, vocab)], first, use_tqdm=False)  # the prefix is cached
    ttft: dict[bool, list[float]] = {True: [], False: []}
    rates: dict[bool, list[float]] = {True: [], False: []}
    decode = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for _ in range(args.runs):  # interleaved by hand: both engines get each run's fresh requests
        questions = [random_ids(rng, 24, vocab) for _ in range(args.requests)]
        unique = [random_ids(rng, 256, vocab) for _ in range(args.batch)]
        for on, llm in engines.items():
            for q in questions:
                start = time.perf_counter()
                out = llm.generate([system + q], first, use_tqdm=False)[0]
                ttft[on].append(time.perf_counter() - start)
                assert (out.num_cached_tokens >= 1984) == on, out.num_cached_tokens
            start = time.perf_counter()
            outs = llm.generate(unique, decode, use_tqdm=False)
            rates[on].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    for llm in engines.values():
        llm.close()
    p50 = {on: harness.median(v) for on, v in ttft.items()}
    report = {
        **head, "runs": args.runs,
        "shared": {"system_prompt_tokens": 2000, "requests_per_run": args.requests,
                   "ttft_p50_ms_cache_on": round(1000 * p50[True], 2), "ttft_p50_ms_cache_off": round(1000 * p50[False], 2),
                   "ratio": round(p50[True] / p50[False], 4),
                   "ttft_ms_cache_on": [round(1000 * t, 2) for t in ttft[True]],
                   "ttft_ms_cache_off": [round(1000 * t, 2) for t in ttft[False]]},
        "unique": {"requests": args.batch, "tokens_per_s_cache_on": round(harness.median(rates[True]), 1),
                   "tokens_per_s_cache_off": round(harness.median(rates[False]), 1),
                   "ratio": round(harness.median_ratio(rates[True], rates[False]), 3)},
    }
    harness.write_report(args.out, report)
    s, u = report["shared"], report["unique"]
    print(f"shared 2000-token prefix: TTFT p50 {s['ttft_p50_ms_cache_on']} ms cached vs "
          f"{s['ttft_p50_ms_cache_off']} ms uncached = {s['ratio']:.3f} (goal <= 0.1)")
    print(f"no shared prefix: {u['tokens_per_s_cache_on']} vs {u['tokens_per_s_cache_off']} tok/s = "
          f"{u['ratio']:.3f}x (goal >= 0.99)")


if __name__ == "__main__":
    main()
