"""Quantization at load (weight-only int8; int4 in groups of 64; w8a8: int8 weights and
activations) against fp32, same process, on the CPU.

  speed    greedy decode of a ~118M-parameter Llama (10 layers, hidden 1024, GQA 16/8, vocab 512,
           random weights, built here: memory-bound on this machine) at batch 1 (128 tokens) and
           batch 32 (32 tokens each), fp32 and quantized engines interleaved --runs times; output
           tok/s and the ratios (goals: int8 >= 2.5x and int4 >= 3.5x at batch 1, int8 >= 1.5x
           at batch 32); the embedded model at batch 1 too. w8a8 only where the CPU has VNNI
           (elsewhere the engine refuses it; the bench says so)
  quality  the embedded model on its held-out text (the standard-library modules it never
           trained on, `corpus.source_files()`): perplexity and top-1 agreement of the quantized
           weights against fp32, computed with transformers on the dequantized weights (the
           values pyserve's kernels compute with: tests/model/test_quantized_linear.py holds
           them to greedy parity), w8a8 on its reference layers (the same); goals int8 +0.5% /
           97%, int4 +5% / 90%
  load     seconds from `LLM(...)` to ready, each method, both models (quantizing at load)

Writes bench/results/quantization.json.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

import harness
from batch1_decode import build
from pyserve import LLM, SamplingParams
from pyserve.default_model import TARGET_DIR
from pyserve.default_model.training import corpus
from pyserve.model.quantized_linear import Int4Linear, Int8Linear, fast_int8_matmul
from pyserve.testing.quantized_reference import use_w8a8_reference

BIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=10, num_attention_heads=16,
           num_key_value_heads=8, vocab_size=512)


def decode_tok_s(llm: LLM, batch: int, tokens: int) -> float:
    prompts = [[5 + i % 50, 6, 7, 8] * 4 for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - start)


def loaded(model: str, quantization: str | None) -> tuple[LLM, float]:
    start = time.perf_counter()
    llm = LLM(model, quantization=quantization)
    return llm, time.perf_counter() - start


# int4 in groups of 64 (the default group size); w8a8 where the engine serves it
METHODS = (None, "int8", "int4") + (("w8a8",) if fast_int8_matmul() else ())


def quality(max_chars: int) -> dict[str, dict[str, float]]:
    from transformers import AutoModelForCausalLM

    from pyserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(TARGET_DIR)
    _, held = corpus.source_files()
    text = "\n".join(t for _, t in held)[:max_chars]
    ids = tok.encode(text, add_special_tokens=False)
    models = {"fp32": AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()}
    for method in ("int8", "int4"):
        m = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
        m.config.tie_word_embeddings = False
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
        with torch.no_grad():
            for lin in m.modules():
                if isinstance(lin, torch.nn.Linear):
                    layer = Int8Linear.from_linear(lin) if method == "int8" else Int4Linear.from_linear(lin, 64)
                    lin.weight.copy_(layer.dequantized())
        models[method] = m
    models["w8a8"] = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    use_w8a8_reference(models["w8a8"])
    window = 1024
    nll = dict.fromkeys(models, 0.0)
    agree = dict.fromkeys(models, 0)
    count = 0
    with torch.no_grad():
        for lo in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[lo : lo + window + 1]])
            if chunk.shape[1] < 2:
                break
            inputs, targets = chunk[:, :-1], chunk[0, 1:]
            logits = {name: m(inputs).logits[0] for name, m in models.items()}
            for name, lg in logits.items():
                nll[name] += torch.nn.functional.cross_entropy(lg, targets, reduction="sum").item()
                agree[name] += (lg.argmax(-1) == logits["fp32"].argmax(-1)).sum().item()
            count += len(targets)
    ppl = {k: math.exp(v / count) for k, v in nll.items()}
    return {name: {"tokens": count, "ppl": ppl[name], "ppl_change": ppl[name] / ppl["fp32"] - 1,
                   "top1_agreement": agree[name] / count} for name in models}


def main() -> None:
    ap = harness.parser(__doc__, "quantization", runs=3)
    ap.add_argument("--quality-chars", type=int, default=200_000, help="held-out characters scored")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    if "w8a8" not in METHODS:
        print("w8a8 not measured: this CPU has no VNNI (or oneDNN is off), where the engine refuses it")
    big = build(Path("/tmp/pyserve-bench-quant-118m"), BIG)
    report: dict = {**head, "load_s": {}}
    results: dict[str, dict] = {}
    for name, model in (("118m", str(big)), ("embedded", None)):
        llms = {}
        for q in METHODS:
            llm, seconds = loaded(model, q)
            key = q or "fp32"
            llms[key] = llm
            report["load_s"][f"{name}_{key}"] = seconds
            report[f"{name}_{key}_weight_bytes"] = llm.stats()["weight_bytes"]
            decode_tok_s(llm, 1, 16)  # warm-up
        sides = {f"{k}_b1": (lambda llm=llm: decode_tok_s(llm, 1, 128)) for k, llm in llms.items()}
        if name == "118m":
            sides |= {f"{k}_b32": (lambda llm=llm: decode_tok_s(llm, 32, 32)) for k, llm in llms.items()}
        runs = harness.interleaved(sides, args.runs)
        results[name] = {"tok_s": {k: harness.median(v) for k, v in runs.items()}, "runs": runs}
        for side in sides:
            method, batch = side.split("_")
            if method != "fp32":
                results[name][f"{side}_vs_fp32"] = harness.median_ratio(runs[side], runs[f"fp32_{batch}"])
        for llm in llms.values():
            llm.close()
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in results[name]["tok_s"].items()) + "; "
              + ", ".join(f"{k} {v:.2f}x" for k, v in results[name].items() if k.endswith("_vs_fp32")), flush=True)
    report["speed"] = results
    report["quality"] = quality(args.quality_chars)
    for method, qual in report["quality"].items():
        print(f"quality {method} (embedded, {qual['tokens']} held-out tokens): perplexity {qual['ppl']:.3f} "
              f"({100 * qual['ppl_change']:+.2f}%), top-1 agreement with fp32 {100 * qual['top1_agreement']:.2f}%")
    print("load s: " + ", ".join(f"{k} {v:.2f}" for k, v in report["load_s"].items()))
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
