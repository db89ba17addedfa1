"""Cold start: `pyserve serve` from launch to its first /health answer and to healthy (200).

Two models, fp32 on the CPU: the embedded one, and a ~95M-parameter Llama (hidden 768, 12 layers,
12 heads, MLP 1536, vocabulary 32000, tied embeddings, random weights, the tests' tokenizer) built
here with transformers into a temporary directory. Each launch polls /health every 50 ms. In
each round `python -c "import torch"` is timed too, in its own process: the floor pyserve cannot
move; the figure that matters is healthy minus that import, taken per round (and minus the
import of torch inside the server, from its `engine_loaded` event).

warm: the bytecode cache and the page cache as they are (after --warmup rounds); cold: the first
ever start of an interpreter, emulated by a fresh PYTHONPYCACHEPREFIX per launch (every module,
torch's included, compiled from source; the import of torch measured the same way). The page
cache is not dropped: that needs root and would disturb the machine's other work. No compile step
of pyserve's own lands on a CPU start (no torch.compile; Triton's cache is for CUDA).

The weights: the server logs `weights_loaded` (tensors mapped from the safetensors files and
checked; used in place); a child process also loads the 95M model and reads every byte of it (a
torch.sum per tensor), timed apart: the page-cache read rate the first forward sees; the same sums
again, every page resident, give the sums' own cost. Writes bench/results/cold_start.json.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import harness

GOAL_WARM_OVER_TORCH_S = 1.0  # embedded model, healthy minus import torch
GOAL_READ_GB_PER_S = 1.0
POLL_S = 0.05  # polling at 50 Hz measurably slowed the load it watches (2 cores)
LLAMA = dict(vocab_size=32000, hidden_size=768, intermediate_size=1536, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
             initializer_range=0.02, tie_word_embeddings=True)
READ_WEIGHTS = """
import json, sys, time
import torch
from pyserve.model.config import ModelConfig
from pyserve.model.loader import load_model
cfg = ModelConfig.from_dir(sys.argv[1])
start = time.perf_counter()
model = load_model(sys.argv[1], cfg, torch.float32, torch.device("cpu"), 2048, gguf_dequantize=False)
mapped = time.perf_counter()
params = list(model.parameters())
total = sum(float(p.sum()) for p in params)
read = time.perf_counter()
total = sum(float(p.sum()) for p in params)  # again, every page now resident: the sum's own cost
again = time.perf_counter()
print(json.dumps({"bytes": sum(p.nbytes for p in params), "load_s": mapped - start, "read_s": read - mapped,
                  "resident_s": again - read}))
"""


def build_llama(out: Path) -> Path:
    from pyserve.testing import build_model

    return build_model(out, "llama", **LLAMA)


def _env(pycache: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def time_torch_import(pycache: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env=_env(pycache))
    return time.perf_counter() - start


def _events(log: str) -> dict[str, dict]:
    """The server's JSON log lines by event name, the first of each: the served model's
    `weights_loaded` and `engine_loaded` come before those of any model served beside it (the
    embedded target's draft, which `pyserve serve` serves too)."""
    events = {}
    for line in log.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            events.setdefault(record.get("event"), record)
    return events


def launch(model: Path | None, workdir: Path, pycache: Path | None = None, timeout: float = 600) -> dict:
    """One start of `pyserve serve`: seconds from Popen to the first /health answer and to 200,
    and the server's own start-up events."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pyserve.cli", "serve", *([str(model)] if model else []), "--port", str(port)]
    log_path = workdir / f"serve-{port}.log"
    url = f"http://127.0.0.1:{port}/health"
    first = None
    with log_path.open("w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=_env(pycache))
    try:
        with httpx.Client(timeout=5) as client:  # one pooled connection: the poller shares the cores
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
                if time.perf_counter() - start > timeout:
                    raise RuntimeError(f"server not healthy within {timeout} s")
                try:
                    status = client.get(url).status_code
                except httpx.HTTPError:
                    time.sleep(POLL_S)
                    continue
                now = time.perf_counter() - start
                first = now if first is None else first
                if status == 200:
                    healthy = now
                    break
                time.sleep(POLL_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    events = _events(log_path.read_text())
    weights = events["weights_loaded"]
    return {"first_answer_s": first, "healthy_s": healthy,
            "server_ready_s": events["server_ready"]["seconds"],
            "server_torch_import_s": events["engine_loaded"]["torch_import_seconds"],
            "server_engine_import_s": events["engine_loaded"]["import_seconds"],
            "server_engine_build_s": events["engine_loaded"]["build_seconds"],
            "weights_s": weights["seconds"], "weights_bytes": weights["bytes"], "weights_gb_per_s": weights["gb_per_s"],
            "weights_in_place": weights["in_place"], "weights_tensors": weights["tensors"]}


def read_weights(model: Path) -> dict:
    run = subprocess.run([sys.executable, "-c", READ_WEIGHTS, str(model)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], torch_s: list[float]) -> dict:
    over = [r["healthy_s"] - t for r, t in zip(runs, torch_s, strict=True)]
    over_own = [r["healthy_s"] - r["server_torch_import_s"] for r in runs]
    keys = [k for k in runs[0] if k not in ("weights_bytes", "weights_tensors", "weights_in_place")]
    out = {k: round(harness.median(r[k] for r in runs), 4) for k in keys}
    out.update(torch_import_s=round(harness.median(torch_s), 4), healthy_minus_torch_s=round(harness.median(over), 4),
               healthy_minus_server_torch_s=round(harness.median(over_own), 4),
               weights_bytes=runs[0]["weights_bytes"], weights_tensors=runs[0]["weights_tensors"],
               weights_in_place=runs[0]["weights_in_place"], runs=runs, torch_import_runs=torch_s)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, "cold_start", runs=5)
    ap.add_argument("--cold-runs", type=int, default=2, help="first-ever starts of the embedded model (default 2)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds dropped before the warm ones (default 1)")
    args = ap.parse_args(argv)
    head = harness.header(__file__, argv)
    harness.print_header(head)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        llama = build_llama(tmp / "llama95m")
        fresh = iter(range(1 << 30))

        def pycache() -> Path:
            return tmp / f"pycache-{next(fresh)}"

        cold = harness.interleaved({"torch": lambda: time_torch_import(pycache()),
                                    "embedded": lambda: launch(None, tmp, pycache())}, args.cold_runs)
        warm = harness.interleaved({"torch": time_torch_import, "embedded": lambda: launch(None, tmp),
                                    "llama95m": lambda: launch(llama, tmp)}, args.runs, warmup=args.warmup)
        reads = [read_weights(llama) for _ in range(args.runs)]
    read_s = harness.median(r["read_s"] for r in reads)
    resident_s = harness.median(r["resident_s"] for r in reads)
    report = {
        **head,
        "cold_embedded": summarize(cold["embedded"], cold["torch"]),
        "warm_embedded": summarize(warm["embedded"], warm["torch"]),
        "warm_llama95m": summarize(warm["llama95m"], warm["torch"]),
        "llama95m_read": {"bytes": reads[0]["bytes"], "load_s": round(harness.median(r["load_s"] for r in reads), 4),
                          "read_s": round(read_s, 4), "read_gb_per_s": round(reads[0]["bytes"] / read_s / 1e9, 2),
                          "resident_s": round(resident_s, 4),
                          "resident_gb_per_s": round(reads[0]["bytes"] / resident_s / 1e9, 2), "runs": reads},
        "goals": {"warm_embedded_healthy_minus_torch_s": f"<= {GOAL_WARM_OVER_TORCH_S}",
                  "llama95m_read_gb_per_s": f">= {GOAL_READ_GB_PER_S}"},
    }
    for name in ("cold_embedded", "warm_embedded", "warm_llama95m"):
        r = report[name]
        print(f"{name:14s} first answer {r['first_answer_s']:.3f} s, healthy {r['healthy_s']:.3f} s, import torch "
              f"{r['torch_import_s']:.3f} s (in the server {r['server_torch_import_s']:.3f} s), healthy - torch "
              f"{r['healthy_minus_torch_s']:.3f} s (- the server's {r['healthy_minus_server_torch_s']:.3f} s); weights "
              f"{r['weights_bytes'] / 1e6:.0f} MB in {r['weights_s']:.3f} s ({r['weights_gb_per_s']} GB/s, "
              f"{r['weights_in_place']}/{r['weights_tensors']} in place)")
    r = report["llama95m_read"]
    print(f"llama95m read  {r['bytes'] / 1e6:.0f} MB: loaded in {r['load_s']:.3f} s, every byte read in "
          f"{r['read_s']:.3f} s ({r['read_gb_per_s']} GB/s; the same sum with every page resident "
          f"{r['resident_s']:.3f} s, {r['resident_gb_per_s']} GB/s)")
    harness.write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
