"""`python -m bench`: the quick suite (about 4 minutes on 2 CPU cores), one script after another,
each writing its JSON under bench/results/quick/ and printing its own ratios; then a summary of
every ratio with its goal, and the plots (bench/plots.py) in bench/results/quick/plots/. Quick runs are single or double runs: on a noisy machine trust the
full runs (bench/README.md) over them. Run from the repository root. Each script's full version is its own command (see
bench/README.md); --device is passed to the scripts that take it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quick"  # the full runs' JSON (quoted in bench/README.md) stay in results/

# (script, quick arguments, takes --device)
SUITE = [
    ("scheduler.py", ["--quick"], False),
    ("kv_efficiency.py", [], False),
    ("prefix_cache.py", ["--runs", "2"], True),
    ("engine_overhead.py", ["--runs", "1"], False),
    ("offline.py", ["--repeats", "1"], False),
    ("http_vs_offline.py", ["--quick"], False),
    ("concurrency.py", ["--concurrency", "1,4,16"], True),
    ("spec_decode.py", ["--runs", "2", "--max-tokens", "96"], True),
    ("lora.py", ["--runs", "1"], True),
    ("parallel_sampling.py", ["--runs", "2"], True),
]

# (results file, key path, what it is, goal)
SUMMARY = [
    ("prefix_cache.json", ["shared", "ratio"], "TTFT p50, cached 2000-token prefix / recomputed", "<= 0.1"),
    ("prefix_cache.json", ["unique", "ratio"], "throughput with no shared prefix, cache on / off", ">= 0.99"),
    ("kv_efficiency.json", ["peak_waste"], "KV waste at the peak", "< 0.04"),
    ("engine_overhead.json", ["ratio"], "engine vs transformers batch 256, 1-layer model", ">= 1.0"),
    ("spec_decode.json", ["results", "reuse", "ngram_ratio"], "n-gram speculation, batch 1, quoting output", ">= 2.0"),
    ("spec_decode.json", ["results", "code", "draft_ratio"], "draft-model speculation, batch 1, code", ">= 1.5"),
    ("parallel_sampling.json", ["ratio"], "n = 8 of one request vs 8 requests, 1000-token prompt", ">= 3.0"),
    ("spec_decode.json", ["results", "batch16", "ngram_ratio"], "n-gram speculation, batch 16", ">= 0.95"),
    ("spec_decode.json", ["results", "batch64", "ngram_ratio"], "n-gram speculation, large batch", ">= 0.95"),
    ("lora.json", ["ratio"], "8 rank-16 adapters / base, decode throughput", ">= 0.8"),
]


def lookup(name: str, keys: list[str]):
    try:
        value = json.loads((RESULTS / name).read_text())
        for k in keys:
            value = value[k]
        return value
    except (OSError, KeyError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--only", nargs="*", help="run only these scripts (e.g. lora.py)")
    args = ap.parse_args()
    failed = []
    for script, extra, takes_device in SUITE:
        if args.only and script not in args.only:
            continue
        out = RESULTS / script.replace(".py", ".json")
        cmd = [sys.executable, str(HERE / script), *extra, "--out", str(out),
               *(["--device", args.device] if takes_device else [])]
        print(f"\n== {script} {' '.join(extra)}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd).returncode != 0:
            failed.append(script)
        print(f"== {script}: {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n{'measure':58} {'value':>8}  goal")
    for name, keys, what, goal in SUMMARY:
        value = lookup(name, keys)
        print(f"{what:58} {'-' if value is None else f'{value:8.3f}':>8}  {goal}")
    if not args.only:
        try:
            from bench import plots  # needs matplotlib: pip install '.[bench]'
        except ImportError as e:
            print(f"\nno plots: {e} (pip install '.[bench]')")
        else:
            print()
            plots.main([str(RESULTS)])
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
