"""How actors call the worker's blocking methods: in a thread (server) or on the loop (offline)."""

from __future__ import annotations

import threading

import pytest

from pyserve.engine.worker_call import worker_call


@pytest.mark.parametrize("on_loop", [False, True])
@pytest.mark.asyncio
async def test_the_call_runs_where_it_is_told_and_returns_the_value(on_loop):
    loop_thread = threading.get_ident()
    ran_on = []

    def work(a, b):
        ran_on.append(threading.get_ident())
        return a + b

    assert await worker_call(on_loop)(work, 2, 3) == 5
    assert (ran_on[0] == loop_thread) == on_loop
