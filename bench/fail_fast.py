"""How fast `pyserve serve` gives up on a model it cannot serve, and whether its message names the
cause (issue 43: a bad file, an unknown architecture and an unreachable hub each fail in under a
second). Each case launches `pyserve serve MODEL` --runs times and reports, median: the seconds
from launch to the `server_load_failed` event (the server's own count since its process began)
and to the process's exit (status 1 expected).

  missing      a path that does not exist and is no hub id
  bad-file     1 KB of random bytes named model.gguf
  unknown-arch SmolLM2-135M-Instruct's GGUF file rewritten as general.architecture "phi3": its
               first open (an empty metadata cache) and a later one (from the cache)
  hub          a hub id with HF_ENDPOINT at a closed local port (an unreachable hub)

  python bench/fail_fast.py [--runs 3]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

import harness
from pyserve.testing.real_models import fetch
from pyserve.testing.tiny_gguf import gguf_rewritten

GOAL_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, env: dict[str, str]) -> dict:
    """One `pyserve serve MODEL`: seconds to the failure event and to exit, the exit status, and
    the command's last line (its message)."""
    start = time.time()
    proc = subprocess.run(["pyserve", "serve", model, "--port", str(free_port())], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    exited = time.time() - start
    failed = None
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("{") and '"server_load_failed"' in line:
            stamp = json.loads(line)["timestamp"].replace("Z", "+00:00")
            failed = datetime.fromisoformat(stamp).timestamp() - start
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return {"failed_s": failed, "exit_s": exited, "status": proc.returncode, "message": last}


def main() -> None:
    ap = harness.parser(__doc__, "fail_fast", runs=3)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    report = {**head, "goal_s": GOAL_S, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bad = tmp / "model.gguf"
        bad.write_bytes(os.urandom(1024))
        phi3 = gguf_rewritten(fetch("smollm2-135m-instruct"), tmp / "phi3.gguf", architecture="phi3")
        hub_env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp / "hf")}
        cases = {
            "missing": (lambda i: (str(tmp / "nothing" / "model.gguf"), {}), "neither a local path nor a hub id"),
            "bad-file": (lambda i: (str(bad), {}), "not a readable GGUF file"),
            "unknown-arch first open": (lambda i: (str(phi3), {"PYSERVE_GGUF_CACHE": str(tmp / f"cache-{i}")}),
                                        "general.architecture 'phi3'"),
            "unknown-arch cached": (lambda i: (str(phi3), {"PYSERVE_GGUF_CACHE": str(tmp / "cache-0")}),
                                    "general.architecture 'phi3'"),
            "hub": (lambda i: ("org/some-model", hub_env), "cannot be reached"),
        }
        for name, (make, cause) in cases.items():
            runs = [launch(*make(i)) for i in range(args.runs)]
            named = all(r["status"] == 1 and cause in r["message"] for r in runs)
            row = {"failed_s": round(harness.median(r["failed_s"] for r in runs), 3),
                   "exit_s": round(harness.median(r["exit_s"] for r in runs), 3),
                   "cause_named": named, "message": runs[0]["message"], "runs": runs}
            report["cases"][name] = row
            print(f"{name}: failure logged at {row['failed_s']:.2f} s, exit at {row['exit_s']:.2f} s "
                  f"(goal {GOAL_S} s); cause named: {named}: {row['message']}", flush=True)
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
