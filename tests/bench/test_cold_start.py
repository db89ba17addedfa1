"""bench/cold_start.py's bookkeeping: the server's start-up events read from its log, and the
per-round difference to the import of torch (the launches themselves are the bench's job)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cold_start  # noqa: E402


def test_events_keep_the_first_json_line_of_each_name():
    """The served model's start-up events come first; a model served beside it logs its own after."""
    log = "\n".join(["plain text", json.dumps({"event": "a", "n": 1}), json.dumps({"event": "b"}),
                     json.dumps({"event": "a", "n": 2})])
    assert cold_start._events(log) == {"a": {"event": "a", "n": 1}, "b": {"event": "b"}}


def test_healthy_minus_torch_is_the_median_of_each_rounds_difference():
    def run(healthy):
        return {"first_answer_s": 0.5, "healthy_s": healthy, "server_torch_import_s": 3.0, "weights_s": 0.1,
                "weights_gb_per_s": 2.0, "weights_bytes": 100, "weights_tensors": 3, "weights_in_place": 3}

    out = cold_start.summarize([run(4.0), run(5.0), run(9.0)], [3.5, 3.0, 3.2])
    # differences 0.5, 2.0, 5.8: not median(healthy) - median(torch) = 5.0 - 3.2
    assert (out["healthy_s"], out["torch_import_s"], out["healthy_minus_torch_s"]) == (5.0, 3.2, 2.0)
    assert out["healthy_minus_server_torch_s"] == 2.0  # 5.0 - 3.0
    assert (out["weights_bytes"], out["weights_in_place"], out["first_answer_s"]) == (100, 3, 0.5)
