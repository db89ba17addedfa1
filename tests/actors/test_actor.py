"""The actor microkernel: supervision, closed inboxes, posting to a full inbox, actors on a thread
of their own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pyserve.actors import Actor, ActorSystem, EngineDeadError
from pyserve.actors.loop_thread import LoopThread, resolve


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


class Echo(Actor):
    """Replies to every message with (message, the thread it was handled on); crashes on "die"."""

    def __init__(self, name: str, reply_to: Sink):
        super().__init__(name)
        self.reply_to = reply_to

    async def run(self) -> None:
        while True:
            msg = await self.receive()
            if msg == "die":
                raise RuntimeError("died on its thread")
            await self.reply_to.send((msg, threading.get_ident()))


async def test_an_actor_on_its_own_thread_gets_messages_in_order_and_replies_across():
    system = ActorSystem()
    sink = Sink("sink", inbox_size=4)
    sink.gate.set()
    thread = LoopThread("test-actor-thread")
    echo = Echo("echo", sink)
    system.start(sink)
    system.start(echo, thread=thread)
    for i in range(50):  # more than the sink's inbox holds: replies from the thread never block
        await echo.send(i)
    for _ in range(500):
        if len(sink.got) == 50:
            break
        await asyncio.sleep(0.01)
    assert [m for m, _ in sink.got] == list(range(50))
    assert {t for _, t in sink.got} == {thread._thread.ident} != {threading.get_ident()}
    await system.stop()
    thread.close()
    thread._thread.join(5)
    assert not thread._thread.is_alive()


async def test_a_crash_on_another_thread_is_reported_on_the_starting_loop():
    system = ActorSystem()
    sink = Sink("sink", inbox_size=4)
    thread = LoopThread("test-actor-thread")
    echo = Echo("echo", sink)
    heard: list[tuple[str, int]] = []
    system.on_failure(lambda e: heard.append((str(e), threading.get_ident())))
    system.start(sink)
    system.start(echo, thread=thread)
    echo.post("die")
    for _ in range(500):
        if heard:
            break
        await asyncio.sleep(0.01)
    assert heard == [("died on its thread", threading.get_ident())]
    with pytest.raises(EngineDeadError):
        await echo.send(1)  # closed: refused at once, from this thread too
    await system.stop()
    thread.close()


async def test_resolve_settles_a_future_from_another_thread_once():
    loop = asyncio.get_running_loop()
    accepted, refused = loop.create_future(), loop.create_future()
    worker = threading.Thread(target=lambda: (resolve(accepted), resolve(refused, ValueError("no")),
                                              resolve(refused)))
    worker.start()
    worker.join()
    assert await asyncio.wait_for(accepted, 5) is None
    with pytest.raises(ValueError, match="no"):
        await asyncio.wait_for(refused, 5)
