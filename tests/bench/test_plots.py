"""bench/plots.py draws the README's plots from results JSON, and skips a missing one."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import plots  # noqa: E402

CONCURRENCY = {"input_len": 128, "output_len": 32, "levels": [
    {"concurrency": c, "output_tokens_per_s": 100.0 * c ** 0.5, "ttft_ms_median": 20.0 * c, "tpot_ms_median": 5.0 + c}
    for c in (1, 2, 4, 8)]}
PREFIX = {"shared": {"system_prompt_tokens": 2000, "ratio": 0.07,
                     "ttft_ms_cache_on": [25.0, 27.5, 26.0], "ttft_ms_cache_off": [400.0, 410.0, 395.0]}}
SPEC = {"results": {name: {"requests": n, "batch": b, "ngram_ratio": r, "draft_ratio": r - 0.1}
                    for name, n, b, r in (("code", 8, 1, 1.4), ("batch4", 4, 4, 1.2), ("batch16", 16, 16, 1.05),
                                          ("batch64", 64, 64, 1.0))}}

DECODE = {"tokens": 64, "models": {"25m": {"sweep": {"1": 150.0, "2": 280.0, "4": 500.0}}}}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_are_drawn_from_results_json(tmp_path):
    for name, report in (("concurrency.json", CONCURRENCY), ("prefix_cache.json", PREFIX), ("spec_decode.json", SPEC),
                         ("batch1_decode.json", DECODE)):
        (tmp_path / name).write_text(json.dumps(report))
    written = plots.main([str(tmp_path), "--out", str(tmp_path / "png")])
    assert [p.name for p in written] == [
        "throughput_vs_concurrency.png", "ttft_prefix_cache.png", "spec_speedup_vs_batch.png", "decode_vs_batch.png"]
    assert png_size(written[0]) == (600, 600)  # 6 x 6 inches at 100 dpi
    assert png_size(written[1]) == png_size(written[2]) == png_size(written[3]) == (600, 400)


def test_a_plot_without_its_json_is_skipped(tmp_path, capsys):
    (tmp_path / "prefix_cache.json").write_text(json.dumps(PREFIX))
    written = plots.main([str(tmp_path)])
    assert [p.name for p in written] == ["ttft_prefix_cache.png"]
    assert (tmp_path / "plots" / "ttft_prefix_cache.png").stat().st_size > 1000
    assert "skipped throughput_vs_concurrency.png" in capsys.readouterr().out
