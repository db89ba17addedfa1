"""The actor inbox: bounded, FIFO across waiting senders, closed for everyone at once."""

from __future__ import annotations

import asyncio

import pytest

from pyserve.actors.inbox import Inbox, InboxClosed, InboxFull


async def test_waiting_senders_go_in_order_before_later_messages():
    inbox = Inbox(2)
    inbox.put_nowait(0)
    inbox.put_nowait(1)
    with pytest.raises(InboxFull):
        inbox.put_nowait(2)
    waiting = [asyncio.create_task(inbox.put(i)) for i in (2, 3, 4)]
    await asyncio.sleep(0)
    assert not any(t.done() for t in waiting)
    assert inbox.get_nowait() == 0  # a slot for the first waiting sender, not for put_nowait
    with pytest.raises(InboxFull):
        inbox.put_nowait(5)
    got = [await inbox.get() for _ in range(4)]
    await asyncio.gather(*waiting)
    assert got == [1, 2, 3, 4]
    inbox.put_nowait(5)  # no sender waits: room again for anyone
    assert inbox.get_nowait() == 5


async def test_posts_past_the_bound_keep_their_order_before_later_messages():
    inbox = Inbox(2)
    for i in range(5):
        inbox.post(i)  # 0 and 1 go in, 2-4 wait in order without a task
    assert len(inbox._items) == 2
    waiting = asyncio.create_task(inbox.put(5))
    await asyncio.sleep(0)
    assert inbox.get_nowait() == 0  # the freed slot goes to the first posted message
    with pytest.raises(InboxFull):
        inbox.put_nowait(6)
    got = [await inbox.get() for _ in range(5)]
    await waiting
    assert got == [1, 2, 3, 4, 5]
    inbox.post(7)
    inbox.close()  # what still waits is dropped; posting now fails
    with pytest.raises(InboxClosed):
        inbox.post(8)


async def test_a_reader_waits_for_the_next_message_and_never_holds_more_than_the_size():
    inbox = Inbox(3)
    reader = asyncio.create_task(inbox.get())
    await asyncio.sleep(0)
    assert not reader.done()
    inbox.put_nowait("a")
    assert await reader == "a"
    for i in range(3):
        inbox.put_nowait(i)
    blocked = asyncio.create_task(inbox.put(3))
    await asyncio.sleep(0)
    assert len(inbox._items) == 3 and not blocked.done()
    assert [await inbox.get() for _ in range(4)] == [0, 1, 2, 3]
    await blocked


async def test_a_cancelled_sender_passes_on_its_slot():
    inbox = Inbox(1)
    inbox.put_nowait(0)
    first, second = asyncio.create_task(inbox.put(1)), asyncio.create_task(inbox.put(2))
    await asyncio.sleep(0)
    assert inbox.get_nowait() == 0  # the slot goes to `first`...
    first.cancel()  # ...which is cancelled before it runs
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)
    assert inbox.get_nowait() == 2


async def test_a_sender_cancelled_while_waiting_gives_up_no_one_elses_slot():
    inbox = Inbox(1)
    inbox.put_nowait(0)
    first, second = asyncio.create_task(inbox.put(1)), asyncio.create_task(inbox.put(2))
    await asyncio.sleep(0)
    first.cancel()  # its turn is cancelled before any slot frees...
    assert inbox.get_nowait() == 0  # ...so this slot goes to `second`
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)
    assert inbox.get_nowait() == 2
    inbox.put_nowait(3)  # no slot is left reserved
    with pytest.raises(InboxFull):
        inbox.put_nowait(4)


async def test_close_fails_waiting_and_later_senders_and_wakes_the_reader():
    full, empty = Inbox(1), Inbox(1)
    full.put_nowait(0)
    sender = asyncio.create_task(full.put(1))
    reader = asyncio.create_task(empty.get())
    await asyncio.sleep(0)
    full.close()
    empty.close()
    with pytest.raises(InboxClosed):
        await sender
    with pytest.raises(InboxClosed):
        await reader
    with pytest.raises(InboxClosed):
        full.put_nowait(2)
    with pytest.raises(InboxClosed):
        full.get_nowait()
