"""run_with_deadline: results and errors come back; overdue Python work is interrupted in its
thread (which then ends) while the caller gets DeadlineExceeded at the deadline."""

from __future__ import annotations

import threading
import time

import pytest

from pyserve.server.deadline import DeadlineExceeded, run_with_deadline


@pytest.mark.asyncio
async def test_result_and_error_come_back():
    assert await run_with_deadline(sum, [1, 2, 3], timeout=5) == 6
    with pytest.raises(ZeroDivisionError):
        await run_with_deadline(lambda: 1 / 0, timeout=5)


@pytest.mark.asyncio
async def test_an_endless_loop_is_interrupted_and_its_thread_ends():
    state = {"iterations": 0}

    def spin():
        while True:
            state["iterations"] += 1

    start = time.perf_counter()
    with pytest.raises(DeadlineExceeded):
        await run_with_deadline(spin, timeout=0.3)
    assert 0.3 <= time.perf_counter() - start < 2
    deadline = time.perf_counter() + 5
    while any(t.name == "deadline-worker" for t in threading.enumerate()):
        assert time.perf_counter() < deadline, "the interrupted thread is still running"
        time.sleep(0.01)
    stopped_at = state["iterations"]
    time.sleep(0.05)
    assert state["iterations"] == stopped_at > 0


@pytest.mark.asyncio
async def test_the_gil_changes_hands_every_millisecond_while_work_runs():
    # a spinning render held the event loop waiting for the GIL for up to 0.9 s at the default
    # 5 ms switch interval; the interval is lowered while any worker runs, then restored
    import asyncio
    import sys

    before = sys.getswitchinterval()
    seen = []
    release = threading.Event()

    def work():
        seen.append(sys.getswitchinterval())
        release.wait(5)
        return "done"

    first = asyncio.ensure_future(run_with_deadline(work, timeout=5))
    second = asyncio.ensure_future(run_with_deadline(sum, [1], timeout=5))
    assert await second == 1  # one worker ended while another runs: still lowered
    assert sys.getswitchinterval() == pytest.approx(0.001)
    release.set()
    assert await first == "done"
    assert seen == [pytest.approx(0.001)]
    deadline = time.perf_counter() + 5
    while sys.getswitchinterval() != before:  # the last worker restores it as its thread ends
        assert time.perf_counter() < deadline
        await asyncio.sleep(0.01)
