"""What the benchmark scripts share: their common arguments, interleaved runs with the median of
each side, and the report header (machine, threads, date, commit, command) that each script
prints first and writes at the top of its JSON.

The scripts run as `python bench/NAME.py`, so bench/ is first on sys.path and `import harness`
finds this file; it imports nothing heavy (torch's thread count is read only when the script
has imported torch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
T = TypeVar("T")


def parser(doc: str, name: str, *, runs: int | None = None, device: bool = False) -> argparse.ArgumentParser:
    """An ArgumentParser described by the script's docstring, with `--out` (default
    bench/results/NAME.json); `--runs N` (also spelled `--repeats`, default `runs`) when `runs` is
    given; `--device` (auto, cpu or cuda; default auto) when `device`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if runs is not None:
        ap.add_argument("--runs", "--repeats", dest="runs", type=int, default=runs,
                        help=f"interleaved runs of each measured side; medians are reported (default {runs})")
    if device:
        ap.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="the JSON report")
    return ap


def interleaved(fns: Mapping[str, Callable[[], T]], runs: int, warmup: int = 0) -> dict[str, list[T]]:
    """Calls every function once per round, in the mapping's order (A, B, A, B, ...), so that the
    machine's noise hits every side alike: `warmup` rounds whose results are dropped, then `runs`
    rounds. Returns each function's results, one per kept round, under its name."""
    results: dict[str, list[T]] = {name: [] for name in fns}
    for round_ in range(warmup + runs):
        for name, fn in fns.items():
            value = fn()
            if round_ >= warmup:
                results[name].append(value)
    return results


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def p99(values: Iterable[float]) -> float:
    """The 99th percentile by rank: the value at index int(0.99 n) of the sorted values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the per-round ratios: each round's two sides shared that round's noise."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def _cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> tuple[str | None, bool | None]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True)
        return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None, None


def header(script: str, argv: Sequence[str] | None = None) -> dict:
    """Where and how the figures were measured: the report's first keys. `script` is the
    script's `__file__`, `argv` its arguments (default: the command line's)."""
    torch = sys.modules.get("torch")
    commit, dirty = _git_commit()
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "machine": platform.platform(), "processor": _cpu_name(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": commit, "git_dirty": dirty,
        "command": shlex.join(["python", f"bench/{Path(script).name}", *args]),
    }


def print_header(head: dict) -> None:
    threads = "" if head["torch_threads"] is None else f", torch {head['torch_threads']} threads"
    commit = "" if head["git_commit"] is None else f", {head['git_commit'][:10]}{'+' if head['git_dirty'] else ''}"
    print(f"# {head['command']}\n# {head['machine']}, {head['processor']}, {head['cpu_count']} CPUs, "
          f"Python {head['python']}{threads}, {head['date']}{commit}", flush=True)


def write_report(path: Path, report: dict) -> None:
    """Writes `report` as indented JSON to `path` (through a temporary file, so that an
    interrupted run leaves the previous report whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


def acceptance_length(before: Mapping[str, float], after: Mapping[str, float]) -> float:
    """Tokens per verifying sequence step (accepted drafts + 1) between two `LLM.stats()`: a
    workload's own figure where one engine serves several (the engine's counter is since start)."""
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return 1.0 + accepted / drafts if drafts else 0.0
