"""bench/serving.py against a real pyserve server on loopback: exact prompt lengths, fixed output
lengths, every request accounted for; and it refuses non-loopback targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pyserve.testing import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serving  # noqa: E402


def test_load_generator_measures_every_request(tmp_path):
    proc, base = start_server(None, "--max-num-seqs", "4", workdir=tmp_path)
    try:
        report = serving.main(["--base-url", base, "--dataset", "random", "--num-prompts", "6", "--input-len", "20",
                               "--range-ratio", "0.5", "--output-len", "8", "--request-rate", "50",
                               "--burstiness", "0.5", "--max-concurrency", "3", "--slo", "ttft=60000",
                               "--out", str(tmp_path / "r.json")])
        shared = serving.main(["--base-url", base, "--dataset", "shared-prefix", "--num-prompts", "4",
                               "--num-prefixes", "2", "--prefix-len", "32", "--input-len", "8", "--output-len", "4"])
    finally:
        assert stop_server(proc) == 0
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["output_tokens"] == 6 * 8
    assert report["input_tokens"] == sum(report["input_lens"])  # the server counted what we generated
    assert all(10 <= n <= 30 for n in report["input_lens"])
    assert report["goodput"] == report["request_throughput"]  # a 60 s TTFT SLO: every request meets it
    assert report["ttft_ms"]["median"] > 0 and report["itl_ms"]["p99"] >= report["itl_ms"]["median"]
    assert shared["completed"] == 4 and shared["output_tokens"] == 16


def test_only_loopback_targets():
    with pytest.raises(SystemExit, match="loopback"):
        serving.check_loopback("http://10.1.2.3:8000")
    serving.check_loopback("http://localhost:8000")
