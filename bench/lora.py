"""Multi-LoRA decode throughput: one batch spread over 8 rank-16 adapters (all seven projections)
vs the same batch on the base model, in the same process, on the embedded target model.

64 requests (held-out code prompts, 64 greedy output tokens each, EOS ignored); the LoRA engine
holds all 8 adapters in device slots (`max_loras=8`), so every step mixes 8 adapters and the
base-less batch goes through the batched shrink/expand path of every projection. Reports output
tokens per second of both and their ratio (goal >= 0.8), the median of --runs interleaved runs.
Writes bench/results/lora.json.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

import harness
from pyserve import LLM, LoRARequest, SamplingParams
from pyserve.default_model import TARGET_DIR
from pyserve.default_model.training import corpus

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(root: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=MODULES,
                                                      init_lora_weights=False))
        peft_model.save_pretrained(root / f"a{i}", safe_serialization=True)
        paths.append(root / f"a{i}")
    return paths


def prompts(n: int) -> list[str]:
    _, held = corpus.source_files()
    fns = [fn.source for _, text in held for fn in corpus.functions(text) if len(fn.source) >= 200]
    return ["\n".join(fns[i % len(fns)].splitlines()[:3]) + "\n" for i in range(n)]


def main() -> None:
    ap = harness.parser(__doc__, "lora", runs=3, device=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ps = prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(Path(tmp), 8, 16)
        loras = [LoRARequest(f"a{i % 8}", i % 8 + 1, str(paths[i % 8])) for i in range(len(ps))]
        base = LLM(device=args.device)
        multi = LLM(device=args.device, enable_lora=True, max_loras=8, max_lora_rank=16)

        def rate(llm: LLM, lora) -> float:
            start = time.perf_counter()
            outs = llm.generate(ps, params, lora_request=lora, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

        # the warm-up round also loads the adapters
        rates = harness.interleaved({"base": lambda: rate(base, None), "lora": lambda: rate(multi, loras)},
                                    args.runs, warmup=1)
        base.close()
        multi.close()
    ratio = harness.median_ratio(rates["lora"], rates["base"])
    report = {**head, "runs": args.runs,
              "requests": len(ps), "max_tokens": args.max_tokens, "adapters": 8, "rank": 16,
              "base_tokens_per_s": round(harness.median(rates["base"]), 1),
              "lora_tokens_per_s": round(harness.median(rates["lora"]), 1), "ratio": round(ratio, 3)}
    harness.write_report(args.out, report)
    print(json.dumps(report))
    print(f"8 adapters x rank 16: {report['lora_tokens_per_s']} tok/s vs base {report['base_tokens_per_s']} tok/s "
          f"= {ratio:.2f}x (goal >= 0.8)")


if __name__ == "__main__":
    main()
