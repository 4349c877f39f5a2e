"""Watcher mailboxes on real threads and a real event loop: ordering, bounds,
and the chained wake-ups of blocked sync consumers (no database involved)."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from pglease.cursors import Position
from pglease.watch._core import Batch, Start
from pglease.watch.mailbox import OVERFLOW, AsyncMailbox, SyncMailbox, WakeChain


def batch(i: int, events: int = 1) -> Batch:
    # The mailbox only counts events; any objects do.
    return Batch([i] * events, [], Position(i, i))  # type: ignore[list-item]


def consume(mailbox: SyncMailbox, timeout: float, out: list[object]) -> None:
    while True:
        try:
            item = mailbox.get(timeout)
        except queue.Empty:
            continue
        if item is None:
            return
        out.append(item)


def start_consumers(
    boxes: list[SyncMailbox], timeout: float
) -> tuple[list[threading.Thread], list[list[object]]]:
    """One consumer thread per mailbox, each appending what it takes to its list."""
    got: list[list[object]] = [[] for _ in boxes]
    threads = [
        threading.Thread(target=consume, args=(b, timeout, g))
        for b, g in zip(boxes, got, strict=True)
    ]
    for t in threads:
        t.start()
    return threads, got


@pytest.mark.parametrize("timeout", [5.0, 0.0005])
def test_chained_wakeups_deliver_everything_in_order(timeout: float) -> None:
    # A tiny timeout makes consumers give up waiting while wake-ups are on
    # their way through the chain: those must still be taken and passed on.
    chain = WakeChain()
    boxes = [SyncMailbox(10**9, chain) for _ in range(30)]
    threads, got = start_consumers(boxes, timeout)
    sent = [batch(i) for i in range(300)]
    for message in sent:
        for box in boxes:
            box.deliver(message)
    for box in boxes:
        box.close()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert all(g == sent for g in got)


@pytest.mark.parametrize("timeout", [5.0, 0.0005])
def test_a_held_chain_wakes_nobody_until_unheld(timeout: float) -> None:
    chain = WakeChain()
    boxes = [SyncMailbox(100, chain) for _ in range(5)]
    threads, got = start_consumers(boxes, timeout)
    # Wait until every consumer is blocked (waiting for a wake-up).
    for box in boxes:
        while not box._waiting:
            threading.Event().wait(0.001)
    chain.hold()
    chain.hold()  # two hubs delivering at once
    for box in boxes:
        box.deliver(batch(1))
    chain.unhold()
    threading.Event().wait(0.2)
    if timeout > 1:
        # Blocked consumers stay blocked while the chain is held.
        assert got == [[] for _ in boxes]
    # (With a tiny timeout a consumer that was between two waits takes its item
    # at once; one whose wait ran out after the delivery waits for the wake-up
    # it is owed, so nobody is left stranded either way.)
    chain.unhold()
    for box in boxes:
        box.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert got == [[batch(1)] for _ in boxes]


def test_unhold_with_nothing_queued_leaves_the_chain_idle() -> None:
    chain = WakeChain()
    chain.hold()
    chain.unhold()
    box = SyncMailbox(10, chain)
    out: list[object] = []
    t = threading.Thread(target=consume, args=(box, 5.0, out))
    t.start()
    box.deliver(batch(7))
    box.close()
    t.join(5)
    assert not t.is_alive() and out == [batch(7)]


def test_get_times_out_and_close_wakes_a_blocked_consumer() -> None:
    box = SyncMailbox(10)
    with pytest.raises(queue.Empty):
        box.get(0.01)
    out: list[object] = []
    t = threading.Thread(target=consume, args=(box, 5.0, out))
    t.start()
    box.deliver(Start(Position(1, 0)))
    threading.Timer(0.05, box.close).start()
    t.join(5)
    assert not t.is_alive() and out == [Start(Position(1, 0))]


def test_sync_mailbox_bound() -> None:
    box = SyncMailbox(5)
    box.deliver(Start(Position(0, 0)))  # never counted, never dropped
    box.deliver(batch(1, 3))
    box.deliver(batch(2, 2))
    box.deliver(batch(3, 1))  # 6 > 5: dropped, marker queued
    box.deliver(batch(4, 7))  # dropped too
    assert box.overflows == 1
    items = [box.get(0) for _ in range(4)]
    assert items[1:] == [batch(1, 3), batch(2, 2), OVERFLOW]
    with pytest.raises(queue.Empty):
        box.get(0)
    assert box.rejoin() == Position(4, 4)
    # Back to queueing; a single batch larger than the bound still passes
    # when nothing is queued (it could never be taken otherwise).
    box.deliver(batch(5, 50))
    assert box.get(0) == batch(5, 50)
    assert box.overflows == 1


def test_async_mailbox_bound_and_wakeup() -> None:
    async def main() -> None:
        box = AsyncMailbox(3)
        with pytest.raises(TimeoutError):
            await box.get(0.01)
        waiter = asyncio.create_task(box.get(None))
        await asyncio.sleep(0)
        box.deliver(batch(1, 2))
        assert await waiter == batch(1, 2)
        box.deliver(batch(2, 2))
        box.deliver(batch(3, 2))  # 4 > 3
        box.deliver(batch(4, 1))
        assert box.overflows == 1
        assert [await box.get(0), await box.get(0)] == [batch(2, 2), OVERFLOW]
        assert box.rejoin() == Position(4, 4)
        box.close()
        assert await box.get(0) is None

    asyncio.run(main())
