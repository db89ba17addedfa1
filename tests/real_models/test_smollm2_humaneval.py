"""`pyserve eval --data humaneval` end to end on SmolLM2-135M-Instruct: the built-in set asked
through the chat endpoint, every answer run in the sandbox, pass@1 with Wilson's interval."""

from __future__ import annotations

import json
import subprocess
import sys


def test_pyserve_eval_runs_humaneval_on_a_real_instruct_model(smollm2, tmp_path):
    configs = tmp_path / "configs.yaml"
    configs.write_text(f"configs:\n  - {{name: smollm2, model: '{smollm2}', max_tokens: 256}}\n")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "pyserve.cli", "eval", "--data", "humaneval", "--configs",
                          str(configs), "--out", str(out), "--limit", "4"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads((out / "eval.json").read_text())["configs"]
    assert row["status"] == "ok" and row["items"] == 4
    assert [r["id"] for r in row["results"]] == [f"HumanEval/{n}" for n in range(4)]
    assert all(r["score"] in (0.0, 1.0) and r["detail"] in ("passed", "failed", "timeout") for r in row["results"])
    assert all(0 < r["output_tokens"] <= 256 for r in row["results"])
    passed = sum(r["score"] for r in row["results"])
    assert row["quality"] == passed / 4 and row["ci_low"] <= row["quality"] <= row["ci_high"]
    assert row["ci_high"] - row["ci_low"] > 0.4  # 4 items: a wide interval, never a point
