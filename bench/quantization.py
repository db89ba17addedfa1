"""int8 weight-only quantization against fp32, same process, fp32 activations on the CPU.

  speed    greedy decode of a ~118M-parameter Llama (10 layers, hidden 1024, GQA 16/8, vocab 512,
           random weights, built here: memory-bound on this machine) at batch 1 (128 tokens) and
           batch 32 (32 tokens each), fp32 and int8 engines interleaved --runs times; output tok/s
           and the ratio (goals: int8 >= 2.5x at batch 1, >= 1.5x at batch 32); the embedded
           model at batch 1 too
  quality  the embedded model on its held-out text (the standard-library modules it never
           trained on, `corpus.source_files()`): perplexity and top-1 agreement of the int8
           weights against fp32, computed with transformers on the dequantized weights (the
           values pyserve's int8 kernels compute with: tests/model/test_quantized_linear.py holds
           them to greedy parity); goals +0.5% perplexity, >= 97% agreement
  load     seconds from `LLM(...)` to ready, fp32 and int8, both models (quantizing at load)

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
from pyserve.model.quantized_linear import quantize_int8

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


def quality(max_chars: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from pyserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(TARGET_DIR)
    _, held = corpus.source_files()
    text = "\n".join(t for _, t in held)[:max_chars]
    ids = tok.encode(text, add_special_tokens=False)
    full = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    q8 = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    q8.config.tie_word_embeddings = False
    q8.lm_head.weight = torch.nn.Parameter(q8.lm_head.weight.detach().clone())
    with torch.no_grad():
        for m in q8.modules():
            if isinstance(m, torch.nn.Linear):
                q, s = quantize_int8(m.weight)
                m.weight.copy_(q.float() * s[:, None])
    window = 1024
    nll = {"fp32": 0.0, "int8": 0.0}
    agree = count = 0
    with torch.no_grad():
        for lo in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[lo : lo + window + 1]])
            if chunk.shape[1] < 2:
                break
            inputs, targets = chunk[:, :-1], chunk[0, 1:]
            logits = {"fp32": full(inputs).logits[0], "int8": q8(inputs).logits[0]}
            for name, lg in logits.items():
                nll[name] += torch.nn.functional.cross_entropy(lg, targets, reduction="sum").item()
            agree += (logits["fp32"].argmax(-1) == logits["int8"].argmax(-1)).sum().item()
            count += len(targets)
    ppl = {k: math.exp(v / count) for k, v in nll.items()}
    return {"tokens": count, "ppl_fp32": ppl["fp32"], "ppl_int8": ppl["int8"],
            "ppl_change": ppl["int8"] / ppl["fp32"] - 1, "top1_agreement": agree / count}


def main() -> None:
    ap = harness.parser(__doc__, "quantization", runs=3)
    ap.add_argument("--quality-chars", type=int, default=200_000, help="held-out characters scored")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    big = build(Path("/tmp/pyserve-bench-quant-118m"), BIG)
    report: dict = {**head, "load_s": {}}
    results: dict[str, dict] = {}
    for name, model in (("118m", str(big)), ("embedded", None)):
        llms = {}
        for q in (None, "int8"):
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
        results[name] = {"tok_s": {k: harness.median(v) for k, v in runs.items()}, "runs": runs,
                         "int8_vs_fp32_b1": harness.median_ratio(runs["int8_b1"], runs["fp32_b1"])}
        if name == "118m":
            results[name]["int8_vs_fp32_b32"] = harness.median_ratio(runs["int8_b32"], runs["fp32_b32"])
        for llm in llms.values():
            llm.close()
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in results[name]["tok_s"].items())
              + f"; int8/fp32 batch 1 {results[name]['int8_vs_fp32_b1']:.2f}x"
              + (f", batch 32 {results[name]['int8_vs_fp32_b32']:.2f}x" if name == "118m" else ""), flush=True)
    report["speed"] = results
    report["quality"] = quality(args.quality_chars)
    qual = report["quality"]
    print(f"quality (embedded, {qual['tokens']} held-out tokens): perplexity fp32 {qual['ppl_fp32']:.3f}, int8 "
          f"{qual['ppl_int8']:.3f} ({100 * qual['ppl_change']:+.2f}%; goal <= +0.5%), top-1 agreement "
          f"{100 * qual['top1_agreement']:.2f}% (goal >= 97%)")
    print("load s: " + ", ".join(f"{k} {v:.2f}" for k, v in report["load_s"].items()))
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
