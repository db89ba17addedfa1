"""Batch-1 greedy decode against the weight-read roofline and transformers, fp32 CPU.

Models: the embedded 4.2M target; a 25M Llama (8 layers, hidden 512, GQA 8/4, vocab 512) and a
~95M one (8 layers, hidden 1024, GQA 16/8, vocab 512), random weights, built here with
transformers (the tests' 300-token tokenizer: text output is on, as users get by default, and
ids past its vocabulary decode to nothing). One request at a time, a 16-token prompt, --tokens
greedy output tokens (EOS ignored), default settings otherwise.

The roofline is the model's weight bytes over the time to read them once as one buffer (a torch
sum over a buffer of that many bytes, on torch's threads, median of 5), measured in the same
run: the most tokens per second a batch-1 decode that reads every weight once per token can
reach. transformers runs `generate` with its KV cache (greedy, batch 1). Each figure is the
median of --runs interleaved runs after a warm-up; goals: >= 0.7 of the roofline and >= 2x
transformers on the 25M and ~95M models, >= 600 tok/s on the embedded one.

`--sweep` adds pyserve's decode throughput at batch 1-64 on the 25M model (the plot's data).
Writes bench/results/batch1_decode.json.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

import harness
from pyserve import LLM, SamplingParams
from pyserve.default_model import resolve_model
from pyserve.testing import build_tokenizer

MODELS = {
    "25m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=512),
    "95m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=512),
}
EMBEDDED_PROMPT = "def merge_intervals(intervals):\n    "


def build(out: Path, shape: dict) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied tensors count once


def read_seconds(nbytes: int) -> float:
    buf = torch.ones(nbytes // 4)
    buf.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return harness.median(times)


def pyserve_tok_s(llm: LLM, prompts: list, params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def hf_tok_s(hf, prompt_ids: list[int], tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                    min_new_tokens=tokens, pad_token_id=0)
    return tokens / (time.perf_counter() - start)


def measure(name: str, model_dir: Path, prompt, args) -> dict:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    nbytes = weight_bytes(hf)
    runs = harness.interleaved({
        "pyserve": lambda: pyserve_tok_s(llm, [prompt_ids], params),
        "transformers": lambda: hf_tok_s(hf, prompt_ids, args.tokens),
        "roofline": lambda: 1.0 / read_seconds(nbytes),
    }, runs=args.runs, warmup=1)
    row = {"weight_bytes": nbytes, **{k: harness.median(v) for k, v in runs.items()}, "runs": runs}
    row["of_roofline"] = harness.median_ratio(runs["pyserve"], runs["roofline"])
    row["vs_transformers"] = harness.median_ratio(runs["pyserve"], runs["transformers"])
    print(f"{name}: {nbytes / 1e6:.1f} MB of weights; pyserve {row['pyserve']:.1f} tok/s, transformers "
          f"{row['transformers']:.1f}, roofline {row['roofline']:.1f}: {row['of_roofline']:.2f} of the roofline, "
          f"{row['vs_transformers']:.2f}x transformers", flush=True)
    if args.sweep and name == "25m":
        row["sweep"] = sweep(llm, args)
    llm.close()
    return row


def sweep(llm: LLM, args) -> dict[int, float]:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    out = {}
    for batch in (1, 2, 4, 8, 16, 32, 64):
        prompts = [[rng.randrange(2, 512) for _ in range(16)] for _ in range(batch)]
        pyserve_tok_s(llm, prompts, params)
        out[batch] = harness.median(pyserve_tok_s(llm, prompts, params) for _ in range(args.runs))
        print(f"  batch {batch}: {out[batch]:.1f} tok/s", flush=True)
    return out


def main() -> None:
    ap = harness.parser(__doc__, "batch1_decode", runs=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default="embedded,25m,95m", help="comma-separated: embedded, 25m, 95m")
    ap.add_argument("--sweep", action="store_true", help="also tok/s at batch 1-64 on the 25M model")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    rng = random.Random(0)
    report = {**head, "tokens": args.tokens, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "embedded":
                model_dir, prompt = Path(resolve_model(None)), EMBEDDED_PROMPT
            else:
                model_dir = build(Path(tmp) / name, MODELS[name])
                prompt = [rng.randrange(2, MODELS[name]["vocab_size"]) for _ in range(16)]
            report["models"][name] = measure(name, model_dir, prompt, args)
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
