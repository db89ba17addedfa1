"""A tensor-parallel server whose follower rank dies or hangs: the in-flight request fails with
503 (a stream with an error event), /health turns 503, the group is shut down, and nothing waits
longer than the collective timeout."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from pyserve.testing import start_server, stop_server

MODEL = "tiny"


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def serve(model_dir, *flags):
    return start_server(model_dir, "--served-model-name", MODEL, "--tensor-parallel-size", "2", "--embedding-model",
                        "none", *flags, workdir=model_dir.parent)


def wait_health(base: str, status: str, within: float) -> dict:
    deadline = time.monotonic() + within
    while True:
        r = httpx.get(base + "/health", timeout=5)
        if r.json().get("status") == status:
            return r.json()
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.05)


def test_a_killed_rank_fails_the_stream_and_health(model_dirs):
    proc, base = serve(model_dirs["llama"])
    try:
        [follower] = children(proc.pid)
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                if len(lines) == 3:
                    os.kill(follower, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        assert '"code":503' in lines[-2].replace(" ", "") or '"service_unavailable"' in lines[-2], lines[-2]
        assert len(lines) < 400
        wait_health(base, "dead", within=2.0)
        r = httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert r.status_code == 503
    finally:
        stop_server(proc)


def test_a_hung_rank_fails_requests_within_the_timeout(model_dirs):
    proc, base = serve(model_dirs["llama"], "--distributed-timeout", "2")
    try:
        [follower] = children(proc.pid)
        os.kill(follower, signal.SIGSTOP)
        start = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503
        assert time.monotonic() - start < 10
        wait_health(base, "dead", within=2.0)
        time.sleep(0.5)
        assert not Path(f"/proc/{follower}").exists() or "Z" in Path(f"/proc/{follower}/stat").read_text().split()[2]
    finally:
        stop_server(proc)
