"""The actor microkernel: supervision, closed inboxes, posting to a full inbox."""

from __future__ import annotations

import asyncio

import pytest

from pyserve.actors import Actor, ActorSystem, EngineDeadError


class Crasher(Actor):
    """Takes one message, then crashes on the second."""

    async def run(self) -> None:
        await self.receive()
        await self.receive()
        raise RuntimeError("boom")


class Sink(Actor):
    """Collects every message until told to stop."""

    def __init__(self, name: str, inbox_size: int):
        super().__init__(name, inbox_size)
        self.got: list[int] = []
        self.gate = asyncio.Event()

    async def run(self) -> None:
        await self.gate.wait()
        while True:
            self.got.append(await self.receive())


async def test_crash_fails_listeners_and_wakes_blocked_senders():
    system = ActorSystem()
    crasher, other = Crasher("crasher", inbox_size=1), Sink("other", inbox_size=1)
    failures: list[BaseException] = []
    system.on_failure(failures.append)
    system.start(crasher, other)
    await other.send(0)  # fills `other`, which never reads
    blocked = asyncio.create_task(other.send(1))
    await crasher.send("a")
    await crasher.send("b")
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(blocked, timeout=5)
    assert [repr(e) for e in failures] == [repr(RuntimeError("boom"))]
    assert not system.alive
    with pytest.raises(EngineDeadError, match="engine is dead"):
        system.check_alive()
    with pytest.raises(EngineDeadError):
        other.send_nowait(2)
    await system.stop()


async def test_post_to_a_full_inbox_is_delivered_in_order_later():
    system = ActorSystem()
    sink = Sink("sink", inbox_size=2)
    system.start(sink)
    for i in range(5):
        sink.post(i)  # the last three wait in tasks of their own
    sink.gate.set()
    for _ in range(100):
        if len(sink.got) == 5:
            break
        await asyncio.sleep(0.01)
    assert sorted(sink.got) == [0, 1, 2, 3, 4] and sink.got[:2] == [0, 1]
    await system.stop()
