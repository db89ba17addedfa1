"""Speculative decoding vs plain decoding, same requests, same process, on the embedded model family
(the Python-code target, its draft, its EAGLE-3 head), greedy, fp32 on CPU unless --device says
otherwise.

Workloads (prompts from the held-out standard-library modules the family never trained on):
  reuse   batch 1: a function, then the request to repeat it: "# the same function again:\n" and its
          first line; the output quotes the prompt (n-gram lookup's case; goal >= 2x)
  code    batch 1: the first lines of a function, continue it (the draft model's case; goal >= 1.5x);
          8 functions, one request at a time, throughput over all of them
  unseen  batch 1: the same over 10 function openings written for this bench (ordinary
          application code, in no training corpus; the figure that holds in general: >= 1.3x)
  batch4, batch16, batch64
          4, 16, 64 code continuations at once, adaptive depth (goal: never below 0.95x of plain);
          with `code` they give the speedup against batch size that bench/plots.py draws
The draft model verifies up to 8 guesses a step (its guesses are mostly accepted on this family,
so deeper verification pays), the EAGLE head up to 6 (`eagle`: token trees of up to 16 drafts, the
default; `eagle_chain`: one chain), n-gram lookup up to 4; adaptive depth picks the depth each
step.
Each figure is output tokens per second; "warm" ratios are the median over --runs interleaved
runs after a first one (a server that has been up for a while has measured its costs), "pooled"
the ratio of all warm runs' tokens over their time together (what a server sustains: a run that
pays for an exploration counts in it, where a median leaves it out), "cold" the ratio in that
first run of a fresh engine on the workload (a server's first requests). --workloads picks some
(e.g. `--workloads batch64 --runs 30` for the sustained figure at a large batch). Also
checks that every speculative output equals the plain one token for token. Writes
bench/results/spec_decode.json.
"""

from __future__ import annotations

import json
import time

import harness
from pyserve import LLM, SamplingParams
from pyserve.default_model.training import corpus

CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True},
    "draft": {"method": "draft_model", "num_speculative_tokens": 8, "adaptive": True},
    "eagle": {"method": "eagle3", "num_speculative_tokens": 6, "adaptive": True},  # token trees (the default)
    "eagle_chain": {"method": "eagle3", "num_speculative_tokens": 6, "adaptive": True, "tree_nodes": 0},
}


# Written for this bench: openings of ordinary application code the embedded family never saw.
UNSEEN = [
    "def parse_price(text):\n    \"\"\"Return the amount in cents of a price such as '$12.50'.\"\"\"\n",
    "class ShoppingCart:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, sku, quantity=1):\n",
    "def load_users(path):\n    users = []\n    with open(path) as f:\n        for line in f:\n",
    "def retry(func, attempts=3, delay=0.5):\n    \"\"\"Call func until it succeeds or attempts run out.\"\"\"\n",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n",
    "def slugify(title):\n    \"\"\"Lower-case title with runs of non-alphanumerics turned into one dash.\"\"\"\n",
    "class RateLimiter:\n    def __init__(self, rate, per):\n        self.rate = rate\n        self.per = per\n",
    "def group_by_day(events):\n    days = {}\n    for event in events:\n        day = event['timestamp'][:10]\n",
    "def normalize_phone(number, country='US'):\n    digits = ''.join(c for c in number if c.isdigit())\n",
    "def merge_configs(base, override):\n    \"\"\"Deep-merge two dicts; values in override win.\"\"\"\n    result = dict(base)\n",
]


def held_out_functions(limit: int, min_chars: int = 300, max_chars: int = 1200) -> list[str]:
    _, held = corpus.source_files()
    fns = [fn.source for _, text in held for fn in corpus.functions(text) if min_chars <= len(fn.source) <= max_chars]
    return fns[:limit]


def workloads(max_tokens: int) -> dict[str, tuple[list[str], list[str], bool]]:
    """name -> (prompts, speculative methods, whether the prompts go one at a time)."""
    fns = held_out_functions(9)
    reuse = [f"{fns[0]}\n\n# the same function again:\n{fns[0].splitlines()[0]}\n"]
    starts = ["\n".join(f.splitlines()[:3]) + "\n" for f in fns]
    # 64 distinct prompts need the shorter functions too (42 are 300-1200 characters long)
    many = ["\n".join(f.splitlines()[:3]) + "\n" for f in held_out_functions(64, min_chars=150, max_chars=10**6)]
    methods = ["eagle", "eagle_chain", "draft", "ngram"]
    return {"reuse": (reuse, ["ngram", "eagle", "eagle_chain"], True), "code": (starts[1:9], methods, True),
            "unseen": (UNSEEN, methods, True),
            **{f"batch{n}": (many[:n], methods, False) for n in (4, 16, 64)}}


def run(llm: LLM, prompts: list[str], params: SamplingParams, one_at_a_time: bool) -> tuple[float, list[list[int]]]:
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    start = time.perf_counter()
    outs = [o for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def pooled_rate(measured: list[tuple[float, list[list[int]]]]) -> float:
    """Tokens over seconds of (rate, outputs) runs taken together."""
    tokens = [sum(map(len, outputs)) for _, outputs in measured]
    return sum(tokens) / sum(n / rate for n, (rate, _) in zip(tokens, measured, strict=True))


def main() -> None:
    ap = harness.parser(__doc__, "spec_decode", runs=3, device=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", help="comma-separated: reuse, code, unseen, batch4, batch16, batch64 (default all)")
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {name: LLM(device=args.device, speculative_config=cfg) for name, cfg in CONFIGS.items()}
    head = harness.header(__file__)  # after the engines: torch is imported
    harness.print_header(head)
    results = {}
    chosen = workloads(args.max_tokens)
    if args.workloads:
        chosen = {name: chosen[name] for name in args.workloads.split(",")}
    for name, (prompts, methods, one_at_a_time) in chosen.items():
        # round 0 is the cold one; the rest are warm (a long-running server explored its depths)
        before = {m: engines[m].stats() for m in methods}
        runs = harness.interleaved({m: lambda m=m: run(engines[m], prompts, params, one_at_a_time)
                                    for m in ["plain", *methods]}, args.runs + 1)
        reference = runs["plain"][0][1]
        for m, measured in runs.items():
            for _, tokens in measured:
                assert tokens == reference, f"{name}/{m}: speculative output differs from plain decoding"
        rates = {m: [rate for rate, _ in measured[1:]] for m, measured in runs.items()}
        row = {"requests": len(prompts), "batch": 1 if one_at_a_time else len(prompts),
               "plain_tokens_per_s": round(harness.median(rates["plain"]), 1)}
        for m in methods:
            row[f"{m}_tokens_per_s"] = round(harness.median(rates[m]), 1)
            row[f"{m}_ratio"] = round(harness.median_ratio(rates[m], rates["plain"]), 3)
            row[f"{m}_pooled_ratio"] = round(pooled_rate(runs[m][1:]) / pooled_rate(runs["plain"][1:]), 3)
            row[f"{m}_cold_ratio"] = round(runs[m][0][0] / runs["plain"][0][0], 3)
            row[f"{m}_mean_acceptance_length"] = round(harness.acceptance_length(before[m], engines[m].stats()), 2)
        results[name] = row
        print(name, json.dumps(row), flush=True)
    for llm in engines.values():
        llm.close()
    report = {**head, "runs": args.runs, "max_tokens": args.max_tokens, "results": results}
    harness.write_report(args.out, report)
    print(f"\n{'workload':<9} {'plain tok/s':>11}  speculative (warm ratio, pooled, cold ratio, mean acceptance length)")
    for name, row in results.items():
        specs = "  ".join(f"{m} {row[m + '_ratio']:.2f}x {row[m + '_pooled_ratio']:.2f}x {row[m + '_cold_ratio']:.2f}x "
                          f"({row[m + '_mean_acceptance_length']})" for m in CONFIGS if m + "_ratio" in row)
        print(f"{name:<9} {row['plain_tokens_per_s']:>11.1f}  {specs}")


if __name__ == "__main__":
    main()
