"""This tree against an earlier commit, side by side: a change meant to keep behaviour (a
restructuring) must not cost speed. Builds the earlier commit in a git worktree of its own
(under ~/.cache/pyserve/side_by_side/, its Rust extension built there by maturin), then runs
each bench below in both trees, interleaved (A B, B A, ...), each tree's own script on its own
code, and prints every figure's median in each tree and their ratio (this tree / the earlier,
so > 1 is faster here for rates, slower for latencies: see `higher`). Quick settings: a single
run of a script is noisy on a shared 2-core machine (+-15-30%); read the medians of --rounds.

    python bench/side_by_side.py --base 2a08dc2 --rounds 3

Writes bench/results/side_by_side.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import harness

REPO = harness.HERE.parent
CACHE = Path.home() / ".cache" / "pyserve" / "side_by_side"

# script, its quick arguments, and the figures read from its JSON: (name, key path, higher is better)
BENCHES = [
    ("scheduler.py", ["--quick"], [("scheduler step, 256 requests (us)", ["results", 0, "rust_us_per_step"], False)]),
    ("engine_overhead.py", ["--runs", "1"], [
        ("engine overhead, text (tok/s)", ["pyserve_tokens_per_s"], True),
        ("engine overhead, ids only (tok/s)", ["pyserve_ids_only_tokens_per_s"], True)]),
    ("offline.py", ["--repeats", "1"], [("offline LLM.generate, 48 requests (s)", ["pyserve_s", 0], False)]),
    ("http_batch1.py", ["--runs", "1"], [
        ("HTTP batch 1, one body (tok/s)", ["http_tokens_per_s"], True),
        ("HTTP batch 1, streamed (tok/s)", ["http_stream_tokens_per_s"], True),
        ("offline batch 1 (tok/s)", ["offline_tokens_per_s"], True)]),
    ("spec_decode.py", ["--runs", "1", "--max-tokens", "96"], [
        ("plain decode, batch 1 (tok/s)", ["results", "code", "plain_tokens_per_s"], True),
        ("n-gram speculation, quoting output (tok/s)", ["results", "reuse", "ngram_tokens_per_s"], True),
        ("draft-model speculation, code (tok/s)", ["results", "code", "draft_tokens_per_s"], True),
        ("n-gram speculation, batch 16 (tok/s)", ["results", "batch16", "ngram_tokens_per_s"], True)]),
    # (a base before b5c2ffd counts the prompt's prefill in these figures, a later tree does not: they compare
    # only when both trees are on the same side of it)
    ("gguf_decode.py", ["--no-llama-cpp", "--models", "qwen2.5-coder-1.5b-instruct", "--runs", "2", "--tokens", "64"], [
        ("Qwen2.5-Coder-1.5B Q4_K_M, batch 1 (tok/s)", ["models", "qwen2.5-coder-1.5b-instruct", "pyserve"], True),
        ("Qwen2.5-Coder-1.5B Q4_K_M, batch 5 (tok/s)", ["models", "qwen2.5-coder-1.5b-instruct", "pyserve_batch5"],
         True),
        ("Qwen2.5-Coder-1.5B Q4_K_M, 5-row step / 1-row",
         ["models", "qwen2.5-coder-1.5b-instruct", "step_5_rows_over_1"], False)]),
]


def base_tree(commit: str) -> Path:
    """A worktree of `commit` with its own extension module built."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = CACHE / sha[:12]
    if not (tree / "pyserve").is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), sha], cwd=REPO, check=True)
    if not list((tree / "pyserve").glob("_core.*.so")):
        with tempfile.TemporaryDirectory() as out:
            subprocess.run(["maturin", "build", "--release", "-q", "-o", out], cwd=tree, check=True,
                           env={**os.environ, "CARGO_TARGET_DIR": str(CACHE / "target")})
            (wheel,) = Path(out).glob("*.whl")
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if name.startswith("pyserve/_core.") and name.endswith(".so"):
                        (tree / name).write_bytes(z.read(name))
    return tree


def run_bench(tree: Path, script: str, args: list[str]) -> dict:
    """One run of `script` in `tree`, importing that tree's pyserve (and nothing else of the
    tree: its top-level kernels/ would hide the `kernels` package transformers imports)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        (Path(tmp) / "pyserve").symlink_to(tree / "pyserve")
        env = {**os.environ, "PYTHONPATH": tmp}
        subprocess.run([sys.executable, str(tree / "bench" / script), *args, "--out", str(out)], cwd=tree, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def dig(report: dict, path: list):
    for key in path:
        report = report[key]
    return float(report)


def main() -> None:
    ap = harness.parser(__doc__, "side_by_side")
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated script names (default: all)")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    trees = {"base": base_tree(args.base), "here": REPO}
    chosen = [b for b in BENCHES if args.only is None or b[0] in args.only.split(",")]
    values: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        order = ["base", "here"] if round_ % 2 == 0 else ["here", "base"]
        for script, script_args, figures in chosen:
            for side in order:
                report = run_bench(trees[side], script, script_args)
                for name, path, _ in figures:
                    values.setdefault(name, {"base": [], "here": []})[side].append(dig(report, path))
            print(f"round {round_ + 1}: {script} done", flush=True)
    rows = []
    print(f"\n{'figure':48} {'base':>10} {'here':>10} {'here/base':>10}  (faster here when)")
    for script, _, figures in chosen:
        for name, _, higher in figures:
            b, h = harness.median(values[name]["base"]), harness.median(values[name]["here"])
            rows.append({"figure": name, "base": b, "here": h, "ratio": h / b, "higher_is_better": higher,
                         "runs": values[name]})
            print(f"{name:48} {b:10.1f} {h:10.1f} {h / b:10.3f}  ({'> 1' if higher else '< 1'})")
    harness.write_report(args.out, {**head, "base": args.base, "rounds": args.rounds, "figures": rows})


if __name__ == "__main__":
    main()
