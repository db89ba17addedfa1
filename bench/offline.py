"""Offline throughput: pyserve's engine vs transformers `generate` with static padded batches.

The same 48 requests (prompts 16-200 tokens, outputs 16-128 tokens, greedy, EOS ignored) run on a
~25M-parameter Llama built here with random weights, fp32 on CPU. transformers runs them in static
batches of 16, left-padded, each batch until its longest output; pyserve runs them all at once
with continuous batching. Throughput counts only the tokens each request asked for. Prints the
ratio; writes bench/results/offline.json.
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

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=5, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, vocab_size=8192)


def build_llama(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(out)
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return out


def workload(n: int, seed: int = 0, max_output: int = 128) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs: prompts of 16-200 tokens, outputs of 16-max_output."""
    rng = random.Random(seed)
    return [([rng.randrange(2, MODEL["vocab_size"]) for _ in range(rng.randint(16, 200))],
             rng.randint(16, max_output)) for _ in range(n)]


def run_transformers(model_dir: Path, reqs, batch_size: int) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.no_grad():
        for b in range(0, len(reqs), batch_size):
            batch = reqs[b : b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, (p, _) in enumerate(batch):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            new = max(n for _, n in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def run_pyserve(model_dir: Path, reqs) -> tuple[float, dict]:
    llm = LLM(str(model_dir), num_kv_blocks=4096, max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in reqs]
    stats = llm.stats()
    llm.close()
    return elapsed, stats


def main() -> None:
    ap = harness.parser(__doc__, "offline", runs=3)
    ap.add_argument("--requests", type=int, default=48)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    reqs = workload(args.requests)
    useful = sum(n for _, n in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp))
        params = sum(t.numel() for t in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            str(model_dir / "model.safetensors")).values())
        seconds = harness.interleaved({"pyserve": lambda: run_pyserve(model_dir, reqs)[0],
                                       "transformers": lambda: run_transformers(model_dir, reqs, 16)}, args.runs)
    ours, theirs = seconds["pyserve"], seconds["transformers"]
    t_ours, t_theirs = harness.median(ours), harness.median(theirs)
    ratio = t_theirs / t_ours
    print(f"model: Llama {params / 1e6:.1f}M params, fp32, {torch.get_num_threads()} threads; "
          f"{len(reqs)} requests, {useful} output tokens")
    print(f"pyserve       {useful / t_ours:8.1f} tok/s  (median of {args.runs}: {t_ours:.2f} s)")
    print(f"transformers  {useful / t_theirs:8.1f} tok/s  (static batches of 16: {t_theirs:.2f} s)")
    print(f"ratio pyserve/transformers: {ratio:.2f}x (goal >= 3.0x)")
    harness.write_report(args.out, {
        "benchmark": "offline", **head,
        "params": params, "requests": len(reqs), "output_tokens": useful,
        "pyserve_s": ours, "transformers_s": theirs, "ratio": ratio, "goal": 3.0,
    })


if __name__ == "__main__":
    main()
