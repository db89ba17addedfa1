"""`pyserve serve --quantization int8` on the embedded model: it serves, /metrics shows the
quantized weight bytes, and an unknown method stops the start with the field named."""

from __future__ import annotations

import subprocess
import sys

import httpx

from pyserve.testing import scrape_metrics, start_server, stop_server


def test_an_int8_server_serves_and_reports_its_weight_bytes(tmp_path):
    proc, base = start_server(None, "--quantization", "int8", workdir=tmp_path)
    try:
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": "pyserve-default", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        assert scrape_metrics(base)["pyserve:weight_bytes"] < 0.55 * 16_786_432
    finally:
        stop_server(proc)


def test_an_unknown_method_stops_the_start_naming_the_field(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pyserve.cli", "serve", "--quantization", "int3", "--port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "quantization must be one of int8" in proc.stdout + proc.stderr
