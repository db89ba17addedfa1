"""`pyserve serve --tensor-parallel-size 2` started by torchrun: rank 0 serves HTTP, rank 1
follows, and the answer is one rank's."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pyserve import LLM, SamplingParams
from pyserve.server.child_server import free_port


def test_torchrun_ranks_serve_one_ranks_tokens(model_dirs):
    model = model_dirs["llama"]
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed beside this Python")
    port = free_port()
    log = (model.parent / f"torchrun-{port}.log").open("w")
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pyserve.cli", "serve",
                             str(model), "--tensor-parallel-size", "2", "--served-model-name", "tiny",
                             "--embedding-model", "none", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=model.parent)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (model.parent / f"torchrun-{port}.log").read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": [5, 17, 42, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        served = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    with LLM(str(model)) as llm:
        want = llm.generate([[5, 17, 42, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert served["usage"]["completion_tokens"] == 12
    assert served["choices"][0]["text"] == want.text
