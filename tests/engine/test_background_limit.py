"""How many batch-job lines a step may run around interactive traffic."""

from __future__ import annotations

from pyserve.engine.background import INTERACTIVE_HOLD, BackgroundLimit


def test_the_limit_holds_while_interactive_requests_run_and_a_while_after():
    limit = BackgroundLimit(max_busy=4)
    assert limit.limit(False, 100.0) is None, "no interactive request yet: batch lines fill the step"
    assert limit.limit(True, 101.0) == 4
    assert limit.limit(False, 101.0 + INTERACTIVE_HOLD / 2) == 4, "the next request is likely to follow"
    assert limit.limit(False, 101.0 + INTERACTIVE_HOLD * 1.01) is None
    assert BackgroundLimit(max_busy=0).limit(True, 0.0) == 0
