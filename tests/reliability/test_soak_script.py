"""bench/soak.py, shortened to 20 seconds: mixed traffic with abandoned requests against a real
server, then every check it makes (flat RSS, KV blocks back, nothing lost, clean exit) passes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak  # noqa: E402


def test_short_soak_passes_its_checks(tmp_path):
    out = tmp_path / "soak.json"
    # 512 blocks: the pool is used once over during the warm-up (its pages are faulted in as
    # blocks are first written; the default pool of 8192 takes longer than this run to fill).
    code = soak.main(["--minutes", "0.33", "--concurrency", "4", "--sample-every", "2", "--warmup-minutes", "0.1",
                      "--max-rss-drift", "0.2", "--num-kv-blocks", "512", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["checks"]
    assert report["sent"] == report["completed"] + report["abandoned"] and report["lost"] == 0
    assert report["completed"] > 10 and report["abandoned"] > 0
    final = report["final"]
    assert final["kv_cache_usage_perc"] == 0 and final["num_requests_running"] == 0
    assert final["kv_free_blocks"] + final["kv_cached_blocks"] == final["kv_total_blocks"] - 1
    assert len(report["samples"]) >= 5 and all(s["rss_mib"] > 0 for s in report["samples"])
