"""What the hub hands one watcher, bounded by the number of queued events.

The hub never waits for a watcher, so a consumer slower than the write rate
would otherwise make its process hold every event since it fell behind. Past
`limit` queued events a mailbox drops further batches, remembering only the
tip of the last one, and queues one `OVERFLOW` marker. The watcher, reaching
the marker, reads the dropped span from the log itself (the log is durable, so
nothing is lost or repeated) and then takes the stream again from that tip.

`SyncMailbox` is filled by the hub thread and emptied by one consumer thread;
`AsyncMailbox` lives on one event loop (filled by the loop's fan-out).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from typing import Final

from .._watch_common import DEFAULT_MAX_PENDING as DEFAULT_MAX_PENDING
from .._watch_common import check_max_pending as check_max_pending
from ..cursors import Position
from ._core import Batch, Message


class Overflow:
    """Marker: batches were dropped; `rejoin()` says up to where."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OVERFLOW"


OVERFLOW: Final = Overflow()

#: What a consumer takes out of a mailbox; None means "closed".
Item = Message | Overflow | None


class WakeChain:
    """Wakes blocked consumer threads one after another, not all at once.

    A batch for N blocked sync watchers means N thread wake-ups. Woken together
    they all fight for the GIL (on a small machine each wake-up then costs tens
    of microseconds and the last consumer waits longest); woken in a chain,
    where each consumer wakes the next one the moment it runs, only one of them
    is runnable at a time, which roughly halves both the CPU and the spread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[SyncMailbox] = deque()
        self._running = False
        self._holds = 0

    def wake(self, mailbox: SyncMailbox) -> None:
        with self._lock:
            if self._running or self._holds:
                self._queue.append(mailbox)
                return
            self._running = True
        mailbox._signal.release()

    def hold(self) -> None:
        """Queue wake-ups without starting the chain until `unhold()`.

        The hub holds the chain while it hands a batch to every subscriber:
        a consumer woken by the first delivery could not run anyway (the hub
        thread keeps the GIL until it blocks again), and would then need a
        second wake-up to take the GIL.
        """
        with self._lock:
            self._holds += 1

    def unhold(self) -> None:
        with self._lock:
            self._holds -= 1
            if self._holds or self._running or not self._queue:
                return
            self._running = True
            first = self._queue.popleft()
        first._signal.release()

    def pass_on(self) -> None:
        """A consumer that was woken hands the wake-up to the next one."""
        with self._lock:
            if not self._queue:
                self._running = False
                return
            following = self._queue.popleft()
        following._signal.release()


#: One chain per process: every sync watcher's mailbox, whatever its hub.
CHAIN = WakeChain()


class SyncMailbox:
    """Hub thread in (or `close()` from any thread), one consumer thread out."""

    def __init__(self, limit: int, chain: WakeChain = CHAIN) -> None:
        self.limit = limit
        self._chain = chain
        self._items: deque[Item] = deque()
        self._guard = threading.Lock()
        # Released once per wake-up owed to the consumer; starts taken.
        self._signal = threading.Lock()
        self._signal.acquire()
        self._waiting = False
        # Events put and taken, each written by one thread only, so neither
        # needs a lock; their difference is what is queued.
        self._put_events = 0
        self._taken_events = 0
        self._drop_lock = threading.Lock()
        self._dropping = False
        self._dropped_tip: Position | None = None
        #: How often this mailbox overflowed (for tests and operators).
        self.overflows = 0

    @property
    def queued_events(self) -> int:
        """Events queued and not taken yet (approximate while the hub delivers)."""
        return max(0, self._put_events - self._taken_events)

    def deliver(self, message: Message) -> None:
        """Hub thread: queue `message`, or drop it when over the bound."""
        if type(message) is Batch:
            n = len(message.events)
            queued = self._put_events - self._taken_events
            if self._dropping or (queued and queued + n > self.limit):
                with self._drop_lock:
                    # Re-checked under the lock: the consumer may have just
                    # rejoined, emptying the queue.
                    queued = self._put_events - self._taken_events
                    if self._dropping or (queued and queued + n > self.limit):
                        self._dropped_tip = message.tip
                        if not self._dropping:
                            self._dropping = True
                            self.overflows += 1
                            self._push(OVERFLOW)
                        return
            self._put_events += n
        self._push(message)

    def close(self) -> None:
        self._push(None)

    def _push(self, item: Item) -> None:
        with self._guard:
            self._items.append(item)
            if not self._waiting:
                return
            self._waiting = False
        self._chain.wake(self)

    def get(self, timeout: float) -> Item:
        """Consumer: the next item; raises `queue.Empty` after `timeout` seconds."""
        with self._guard:
            if self._items:
                return self._take()
            self._waiting = True
        woken = False
        try:
            woken = self._signal.acquire(timeout=timeout)
        finally:
            # Also on KeyboardInterrupt: a wake-up already on its way must be
            # taken and passed on, or every sync watcher behind it stalls.
            if not woken:
                with self._guard:
                    owed = not self._waiting
                    self._waiting = False
                if owed:
                    self._signal.acquire()
                    woken = True
            if woken:
                self._chain.pass_on()
        with self._guard:
            if self._items:
                return self._take()
        raise queue.Empty

    def _take(self) -> Item:
        item = self._items.popleft()
        if type(item) is Batch:
            self._taken_events += len(item.events)
        return item

    def rejoin(self) -> Position:
        """Consumer, on `OVERFLOW`: the tip of the last dropped batch; stops dropping."""
        with self._drop_lock:
            self._dropping = False
            tip = self._dropped_tip
        assert tip is not None
        return tip


#: The blocking twin of `AsyncMailbox` by the generator's naming (`Async` dropped).
Mailbox = SyncMailbox


class AsyncMailbox:
    """One event loop's thread only: the fan-out fills it, one task empties it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: deque[Item] = deque()
        self._queued = 0
        self._dropping = False
        self._dropped_tip: Position | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.overflows = 0

    @property
    def queued_events(self) -> int:
        """Events queued and not taken yet."""
        return self._queued

    def deliver(self, message: Message) -> None:
        if type(message) is Batch:
            n = len(message.events)
            if self._dropping or (self._queued and self._queued + n > self.limit):
                self._dropped_tip = message.tip
                if self._dropping:
                    return
                self._dropping = True
                self.overflows += 1
                self._push(OVERFLOW)
                return
            self._queued += n
        self._push(message)

    def close(self) -> None:
        self._push(None)

    def _push(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout: float | None) -> Item:
        """The next item; raises `TimeoutError` after `timeout` seconds (None: never)."""
        if not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:
                    await waiter
                else:
                    async with asyncio.timeout(timeout):
                        await waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if type(item) is Batch:
            self._queued -= len(item.events)
        return item

    def rejoin(self) -> Position:
        self._dropping = False
        tip = self._dropped_tip
        assert tip is not None
        return tip
