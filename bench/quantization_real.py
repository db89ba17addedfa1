"""Quantization on real weights (issue 46 item 7): each format pyserve serves Qwen2.5-Coder-0.5B-
Instruct in (or --model's), against the file's own weights widened to fp32 (`gguf_dequantize`).

    python bench/quantization_real.py [--humaneval 40] [--tokens 8192] [--model NAME] [--formats fp32,file]

Formats, each through pyserve's engine with default settings otherwise:
- `file`: the Q4_K_M file's layers as they are, the default (Q4_K, Q6_K and Q5_0 blocks in place
  on int8 activations, Q8_0 blocks in place on int16 ones);
- `fp32`: every tensor widened (the reference);
- `int8`, `int4`: the widened weights quantized at load (`--quantization`, default group size);
- `w8a8`: only where the CPU multiplies int8 fast (VNNI); refused elsewhere, and said so.

Measures: perplexity of this repository's README.md and docs/*.md (written after the model was
trained; the first --tokens tokens, windows of 1024, prompt logprobs) and top-1 agreement with
fp32's prediction at each position; greedy agreement on 16 HumanEval prompts (chat template, 64
tokens): the share of answers equal to fp32's and the mean common prefix; and pass@1 on the
first --humaneval problems through `pyserve eval --data humaneval` (one run, every format a
configuration). Writes bench/results/quantization_real.json.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from pyserve import LLM, SamplingParams
from pyserve.eval.humaneval import humaneval_items
from pyserve.model.quantized_linear import fast_int8_matmul
from pyserve.testing.real_models import fetch

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen2.5-coder-0.5b-instruct"
WINDOW = 1024
GREEDY_PROMPTS, GREEDY_TOKENS = 16, 64
FORMATS = {"fp32": {"gguf_dequantize": True}, "file": {},
           "int8": {"gguf_dequantize": True, "quantization": "int8"},
           "int4": {"gguf_dequantize": True, "quantization": "int4"},
           "w8a8": {"gguf_dequantize": True, "quantization": "w8a8"}}


def scored(llm: LLM, ids: list[int]) -> tuple[float, list[int], int]:
    """(summed negative log-likelihood, the top-1 token at each position, positions) of ids."""
    windows = [ids[lo : lo + WINDOW + 1] for lo in range(0, len(ids) - 1, WINDOW)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    nll, tops, count = 0.0, [], 0
    for window, out in zip(windows, outs):
        for pos in range(1, len(window)):
            entries = out.prompt_logprobs[pos]
            nll -= entries[window[pos]].logprob
            tops.append(next(t for t, e in entries.items() if e.rank == 1))
            count += 1
    return nll, tops, count


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = harness.parser(__doc__, "quantization_real")
    ap.add_argument("--humaneval", type=int, default=40, help="HumanEval problems for pass@1 (0: none)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the docs scored")
    ap.add_argument("--model", default=MODEL, help="a GGUF model of pyserve.testing.real_models")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, fp32 first (the reference)")
    args = ap.parse_args()
    chosen = args.formats.split(",")
    if chosen[0] != "fp32" or any(f not in FORMATS for f in chosen):
        ap.error(f"--formats: fp32 first, then any of {', '.join(FORMATS)}")
    head = harness.header(__file__)
    harness.print_header(head)
    path = fetch(args.model)
    formats = {k: FORMATS[k] for k in chosen if k != "w8a8" or fast_int8_matmul()}
    skipped = {} if "w8a8" in formats or "w8a8" not in chosen else {
        "w8a8": "this CPU has no fast int8 matmul (VNNI): pyserve refuses w8a8"}
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    questions = [item.messages for item in humaneval_items()[:GREEDY_PROMPTS]]
    rows, reference = {}, {}
    for name, settings in formats.items():
        with LLM(str(path), **settings) as llm:
            ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[: args.tokens + 1]
            nll, tops, count = scored(llm, ids)
            greedy = [o.outputs[0].token_ids for o in
                      llm.chat(questions, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS), use_tqdm=False)]
            weight_bytes = llm.stats()["weight_bytes"]
        if name == "fp32":
            reference = {"nll": nll, "tops": tops, "greedy": greedy}
        rows[name] = {
            "settings": settings, "weight_bytes": weight_bytes, "perplexity": round(math.exp(nll / count), 4),
            "perplexity_change": round(math.exp((nll - reference["nll"]) / count) - 1, 5),
            "top1_agreement": round(sum(a == b for a, b in zip(tops, reference["tops"])) / count, 4),
            "greedy_same_answers": sum(a == b for a, b in zip(greedy, reference["greedy"])) / len(greedy),
            "greedy_common_prefix": round(sum(common_prefix(a, b) / max(len(b), 1)
                                              for a, b in zip(greedy, reference["greedy"])) / len(greedy), 3)}
        r = rows[name]
        print(f"{name:5s} {weight_bytes / 1e6:7.1f} MB  perplexity {r['perplexity']:.3f} "
              f"({100 * r['perplexity_change']:+.2f}%), top-1 agreement {100 * r['top1_agreement']:.1f}%, greedy "
              f"answers equal {100 * r['greedy_same_answers']:.0f}%, common prefix {r['greedy_common_prefix']:.2f}",
              flush=True)
    pass_at_1 = {}
    if args.humaneval:
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp) / "configs.yaml"
            plan.write_text("configs:\n" + "".join(
                f"  - {json.dumps({'name': name, 'model': str(path), **settings})}\n"
                for name, settings in formats.items()))
            out = args.out.with_suffix("") / "humaneval"
            subprocess.run([sys.executable, "-m", "pyserve.cli", "eval", "--data", "humaneval", "--configs",
                            str(plan), "--out", str(out), "--limit", str(args.humaneval)], check=True)
            report = json.loads((out / "eval.json").read_text())
        pass_at_1 = {c["name"]: {k: c[k] for k in ("quality", "ci_low", "ci_high", "items", "output_tok_s", "status")}
                     for c in report["configs"]}
        for name, p in pass_at_1.items():
            rows[name]["pass_at_1"] = p
    harness.write_report(args.out, {**head, "model": args.model, "tokens_scored": args.tokens, "window": WINDOW,
                                    "greedy_prompts": GREEDY_PROMPTS, "greedy_tokens": GREEDY_TOKENS,
                                    "humaneval_problems": args.humaneval, "formats": rows, "not_run": skipped})


if __name__ == "__main__":
    main()
