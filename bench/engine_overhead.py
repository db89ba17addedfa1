"""Engine overhead: pyserve's per-step bookkeeping vs a static transformers loop, on a model whose
forward costs almost nothing (1 layer, hidden 64, vocab 300: the tests' tokenizer), fp32 CPU.

256 requests of 16 prompt tokens, 64 greedy output tokens each (EOS ignored): pyserve runs them
with continuous batching (max_num_seqs 256) twice, with text output (the default: detokenize=True,
what users get; the headline `ratio`) and with token ids only (detokenize=False, as `generate`
returns ids: `ratio_ids_only`); transformers `generate` runs them as one batch of 256
(min_new_tokens = max_new_tokens = 64). Output tokens per second, the three sides interleaved,
median of --runs rounds; goal: pyserve with text >= 1.0x. Writes bench/results/engine_overhead.json.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

import harness
from pyserve import LLM, SamplingParams
from pyserve.testing import build_tokenizer  # the tests' tiny tokenizer


def build(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    ap = harness.parser(__doc__, "engine_overhead", runs=3)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from transformers import LlamaForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    head = harness.header(__file__)
    harness.print_header(head)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 300) for _ in range(16)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp))
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        llm = LLM(str(model_dir), device="cpu", max_num_seqs=args.requests, max_num_batched_tokens=8192)
        text = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        ids_only = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
        ids = torch.tensor(prompts)

        def run_hf() -> float:
            start = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.tokens, min_new_tokens=args.tokens, pad_token_id=0)
            return (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - start)

        def run_pyserve(params: SamplingParams) -> float:
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            if params.detokenize:  # the text is the output being measured: check it is there
                assert all(o.outputs[0].text for o in outs)
            return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

        rates = harness.interleaved({"transformers": run_hf, "pyserve": lambda: run_pyserve(text),
                                     "pyserve_ids_only": lambda: run_pyserve(ids_only)}, args.runs, warmup=1)
        llm.close()
    ratio = harness.median_ratio(rates["pyserve"], rates["transformers"])
    ratio_ids = harness.median_ratio(rates["pyserve_ids_only"], rates["transformers"])
    report = {**head, "runs": args.runs,
              "requests": args.requests, "output_tokens": args.tokens,
              "pyserve_tokens_per_s": round(harness.median(rates["pyserve"]), 1),
              "pyserve_ids_only_tokens_per_s": round(harness.median(rates["pyserve_ids_only"]), 1),
              "transformers_tokens_per_s": round(harness.median(rates["transformers"]), 1),
              "ratio": round(ratio, 3), "ratio_ids_only": round(ratio_ids, 3)}
    harness.write_report(args.out, report)
    print(f"{args.requests} x {args.tokens} tokens on a 1-layer model, transformers batch {args.requests} "
          f"{report['transformers_tokens_per_s']} tok/s; pyserve with text {report['pyserve_tokens_per_s']} tok/s = "
          f"{ratio:.2f}x (goal >= 1.0), token ids only {report['pyserve_ids_only_tokens_per_s']} tok/s = "
          f"{ratio_ids:.2f}x")


if __name__ == "__main__":
    main()
