"""What a second served model costs the first: one client streaming from SmolLM2-135M-Instruct
(its Q4_1 file) through `pyserve serve`, the server holding it alone against the server also
holding Qwen2.5-Coder-0.5B-Instruct (idle), default settings both.

Per request: --tokens tokens (EOS ignored) after a short prompt, decode tok/s from the first
streamed token to the last. Each round starts both servers in turn (one at a time: two CPU
cores) and sends --requests requests to each after a warm-up one; medians over the rounds' medians.
Writes bench/results/second_model.json.

    python bench/second_model.py [--runs 2] [--requests 3] [--tokens 128]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx

import harness
from pyserve.testing import start_server, stop_server
from pyserve.testing.real_models import fetch


def decode_rates(base: str, requests: int, tokens: int) -> list[float]:
    rates = []
    with httpx.Client(timeout=600) as client:
        for i in range(requests + 1):  # the first warms up
            body = {"model": "a", "prompt": f"Story number {i}: once upon a time", "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            arrivals = []
            with client.stream("POST", base + "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())
            if i:
                rates.append((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
    return rates


def served(models: list[str], requests: int, tokens: int) -> float:
    with tempfile.TemporaryDirectory() as work:
        flags = [flag for m in models for flag in ("--model", m)]
        proc, base = start_server(None, *flags, "--max-model-len", "2048", workdir=Path(work))
        try:
            return statistics.median(decode_rates(base, requests, tokens))
        finally:
            stop_server(proc)


def main() -> None:
    ap = harness.parser(__doc__, "second_model", runs=2)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    first = f"a={fetch('smollm2-135m-instruct')}"
    second = f"b={fetch('qwen2.5-coder-0.5b-instruct')}"
    ways = {"alone": [first], "beside_a_second_model": [first, second]}
    rates = harness.interleaved({name: lambda m=m: served(m, args.requests, args.tokens) for name, m in ways.items()},
                                args.runs)
    ratio = harness.median_ratio(rates["beside_a_second_model"], rates["alone"])
    report = {**head, "tokens": args.tokens, "requests": args.requests,
              "tok_s": {name: [round(r, 2) for r in rs] for name, rs in rates.items()}, "ratio": round(ratio, 3)}
    print(f"SmolLM2 decode over HTTP, one client: alone {harness.median(rates['alone']):.1f} tok/s, beside an idle "
          f"second model {harness.median(rates['beside_a_second_model']):.1f} ({ratio:.2f}x)")
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
