"""A stream's largest inter-token gap while a 900-token prompt arrives, and that newcomer's TTFT,
with the step budget following the inter-token target (--target, default the engine's
max_inter_token_latency) and with the old fixed budget (0: prompts take up to max_num_batched_tokens = 2048 a step).

A ~25M-parameter Llama (8 layers, hidden 512, 8 heads / 4 KV heads, MLP 1408, vocab 512) built
here with random weights, fp32 on CPU, engine defaults but for a 512-block KV pool; one
AsyncEngine per side, in this process, consumed as a server consumes it. Each round, on each
side: the newcomer alone (its TTFT without a stream), then a stream (16-token prompt, greedy,
token ids only) that is 32 tokens in when the newcomer arrives and is aborted once the newcomer
has its first token. Reported: the stream's largest gap between two tokens from the newcomer's
arrival on, the newcomer's TTFT with and without the stream, and their ratio; medians over
--runs interleaved rounds after one warm-up round (which also gives the cost fit its data, as a
serving engine's earlier traffic would). Goal: gap <= 150 ms, ratio <= 1.3. Writes
bench/results/stream_stall.json.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import tempfile
import time
from pathlib import Path

import torch

import harness
from pyserve import SamplingParams
from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.testing import build_tokenizer  # the tests' tiny tokenizer

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=2048, vocab_size=512)
DEFAULT_TARGET = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_inter_token_latency")


def build_llama(out: Path) -> tuple[Path, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(out)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False))
    model.save_pretrained(out, safe_serialization=True)
    return out, sum(p.numel() for p in model.parameters())


async def first_token_seconds(engine: AsyncEngine, rid: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    stream = await engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                                                  detokenize=False))
    await stream.done.wait()
    return time.perf_counter() - start


async def one_round(engine: AsyncEngine, rng: random.Random, n: int, prompt_len: int) -> dict[str, float]:
    def ids(k: int) -> list[int]:
        return [rng.randrange(2, MODEL["vocab_size"]) for _ in range(k)]  # fresh: nothing is cached

    alone = await first_token_seconds(engine, f"alone-{n}", ids(prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True, detokenize=False)
    stream = await engine.add_request(f"stream-{n}", ids(16), params)
    arrivals: list[float] = []

    async def read() -> None:
        while (delta := await stream.deltas.get()) is not None:
            arrivals.extend([time.perf_counter()] * len(delta.token_ids))

    reader = asyncio.create_task(read())
    while len(arrivals) < 32:
        await asyncio.sleep(0.001)
    arrived = time.perf_counter()
    ttft = await first_token_seconds(engine, f"newcomer-{n}", ids(prompt_len))
    await asyncio.sleep(0.2)  # the stream's next steps, once the prompt is done
    await engine.abort(f"stream-{n}")
    reader.cancel()
    times = [arrived] + [t for t in arrivals if t > arrived]
    gap = max(b - a for a, b in zip(times, times[1:]))
    return {"gap_s": gap, "ttft_s": ttft, "ttft_alone_s": alone}


async def measure(model_dir: Path, args) -> dict[str, list[dict[str, float]]]:
    engines = {side: AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=512,
                                              max_inter_token_latency=target))
               for side, target in {"target": args.target, "fixed": 0.0}.items()}
    for engine in engines.values():
        await engine.start()
    rng = random.Random(0)
    results: dict[str, list[dict[str, float]]] = {side: [] for side in engines}
    try:
        for n in range(1 + args.runs):  # interleaved by hand (the rounds are coroutines); round 0 warms up
            for side, engine in engines.items():
                r = await one_round(engine, rng, n, args.prompt_len)
                if n:
                    results[side].append(r)
    finally:
        for engine in engines.values():
            await engine.stop()
    return results


def main() -> None:
    ap = harness.parser(__doc__, "stream_stall", runs=5)
    ap.add_argument("--target", type=float, default=DEFAULT_TARGET,
                    help=f"max_inter_token_latency of the target side (default: the engine's, {DEFAULT_TARGET})")
    ap.add_argument("--prompt-len", type=int, default=900, help="the newcomer's prompt tokens (default 900)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, num_params = build_llama(Path(tmp))
        head = harness.header(__file__)
        harness.print_header(head)
        results = asyncio.run(measure(model_dir, args))
    report = {**head, "runs": args.runs, "model_parameters": num_params, "prompt_tokens": args.prompt_len,
              "max_inter_token_latency": {"target": args.target, "fixed": 0.0}, "results": {}}
    for side, rounds in results.items():
        gap = harness.median(r["gap_s"] for r in rounds)
        ttft = harness.median(r["ttft_s"] for r in rounds)
        alone = harness.median(r["ttft_alone_s"] for r in rounds)
        ratio = harness.median_ratio([r["ttft_s"] for r in rounds], [r["ttft_alone_s"] for r in rounds])
        report["results"][side] = {
            "max_gap_ms": round(1000 * gap, 1), "ttft_ms": round(1000 * ttft, 1),
            "ttft_alone_ms": round(1000 * alone, 1), "ttft_ratio": round(ratio, 3),
            "rounds": [{k: round(1000 * v, 1) for k, v in r.items()} for r in rounds],
        }
        print(f"{side:>6}: largest gap {1000 * gap:.0f} ms (goal <= 150), newcomer TTFT {1000 * ttft:.0f} ms "
              f"with the stream / {1000 * alone:.0f} ms alone = {ratio:.2f}x (goal <= 1.3)")
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
