"""bench/gpu_check.py's dry run: every step at tiny shapes on the CPU under the Triton
interpreter, so the script a GPU window depends on keeps working."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_check  # noqa: E402


def test_the_dry_run_runs_every_step_and_writes_its_report(tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["step"] for s in report["steps"]] == [fn.__name__ for fn in gpu_check.STEPS]
    rows = {s["step"]: s["rows"] for s in report["steps"]}
    assert all(r["ok"] for step in rows.values() for r in step)
    assert "passed" in rows["kernel_tests"][0]["summary"]
    assert len(rows["correctness"]) == 15 and max(r["decode_err"] for r in rows["correctness"]) < 1e-3
    counts = rows["compile_count"][0]
    assert (counts["_decode_stage1_kernel"], counts["_decode_stage2_kernel"], counts["_extend_attention_kernel"]) \
        == (2, 1, 1)
    assert rows["batch1_decode"][0]["tok_s"] > 0 and rows["batch1_decode"][0]["same_tokens_as_eager"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n| ") == 1 + sum(len(step) for step in rows.values())  # header + one line per case
