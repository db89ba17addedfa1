"""Serving throughput and latency against the number of clients: `pyserve serve` (the embedded
model, CPU unless --device says otherwise) on loopback, driven by bench/serving.py's load
generator at each --concurrency (random dataset, --input-len prompt tokens, --output-len output
tokens, EOS ignored, --requests-per-client x concurrency requests, at least 8). One server serves every level; a
warm-up round runs first. Writes bench/results/concurrency.json (one row per level: output
tokens/s, requests/s, TTFT and TPOT median and p99), which bench/plots.py draws.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import harness
import serving  # the load generator
from pyserve.testing import start_server, stop_server


def main() -> None:
    ap = harness.parser(__doc__, "concurrency", device=True)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated client counts")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--server-flags", default="", help="extra flags for pyserve serve, space-separated")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start_server(None, "--device", args.device, *args.server_flags.split(), workdir=Path(tmp))
        try:
            def load(concurrency: int, seed: int) -> dict:
                return serving.main([
                    "--base-url", base, "--dataset", "random", "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--num-prompts", str(max(8, args.requests_per_client * concurrency)),
                    "--max-concurrency", str(concurrency), "--seed", str(seed)])

            load(4, seed=999)  # warm-up
            for i, c in enumerate(levels):
                r = load(c, seed=i)
                if r["failed"]:
                    sys.exit(f"concurrency {c}: {r['failed']} requests failed: {r['errors']}")
                rows.append({"concurrency": c, "requests": r["completed"],
                             "output_tokens_per_s": r["output_throughput"], "requests_per_s": r["request_throughput"],
                             "ttft_ms_median": r["ttft_ms"]["median"], "ttft_ms_p99": r["ttft_ms"]["p99"],
                             "tpot_ms_median": r["tpot_ms"]["median"], "tpot_ms_p99": r["tpot_ms"]["p99"]})
        finally:
            stop_server(proc)
    report = {**head, "input_len": args.input_len, "output_len": args.output_len, "levels": rows}
    harness.write_report(args.out, report)
    print(f"\n{'clients':>7} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}")
    for r in rows:
        print(f"{r['concurrency']:>7} {r['output_tokens_per_s']:>9.1f} {r['requests_per_s']:>7.2f} "
              f"{r['ttft_ms_median']:>9.1f} {r['ttft_ms_p99']:>9.1f} {r['tpot_ms_median']:>9.1f}")


if __name__ == "__main__":
    main()
