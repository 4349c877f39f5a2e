"""Waiting rooms: the blocked `acquire` calls of one process on one resource share
one watcher subscription, and a release wakes one of them, not all.

Without this every waiter opened its own watcher, and every `lease.released`
woke every waiter of the process at once: N claims for one free lease, N - 1
refused (the thundering herd). A room is keyed by (process, store, resource,
event loop for asyncio). It owns one change feed of the store's runtime
driver (`driver.changes`: on PostgreSQL a `Watcher`, one subscription on the
process's watch hub; on SQLite the store's polling watcher, which sees other
processes' writes to the file too) for the resource's release/expiry events,
and hands each event to exactly one member:

* the member with the lowest *rank*: fair waiters are ranked in the order
  their queue entries were created (their first attempts run one at a time
  per room, so local rank order is the database's arrival order), unfair
  waiters in the order they joined;
* if that member already has an unconsumed wake-up, nobody else is woken: its
  next attempt starts after the event was delivered, so it sees the release.

Why no wake-up is lost. A member consumes its wake-up (clears the flag) right
before an attempt, so for every delivered event some member starts an attempt
after the release committed. If that attempt is refused, somebody else holds
the lease (or, fair, is ahead in the queue) and that holder's release is the
next event. A member leaving without a claim (timeout, cancellation, error)
while holding an unconsumed wake-up passes it to the next member. Events that
say nothing (a release nobody needs) cost one attempt. Expiry without a release
event (a dead holder and no reaper) is covered by each member's own timer to
the holder's known expiry, as before; fair waiters also keep their queue-entry
refresh timer. The room only decides who is woken early.

A room lingers `LINGER` seconds after its last member left, so a process that
acquires the same resource over and over does not re-subscribe every time.
The linger is measured on the waiters' `pglease.clock.Clock` (rooms are keyed
by it too); the room re-reads it whenever its watcher's read returns, at
least every ``LINGER / 2`` real seconds.
If its watcher cannot start or fails, the room is "broken": members fall back
to their timers plus a coarse re-check, and the next acquire builds a new room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any, Protocol

from ..clock import SYSTEM_CLOCK, Clock
from ..driver import AsyncChangeFeed, ChangeFeed

log = logging.getLogger("pglease.fleet")

#: Events on the waited-for resource that can make it claimable.
WAKE_EVENTS = ("lease.released", "lease.expired")
#: A room without members keeps its subscription this long (seconds).
LINGER = 1.0
#: How long a joining member waits for the room's watcher to be positioned.
READY_TIMEOUT = 5.0


class _Flag(Protocol):
    """`threading.Event` or `asyncio.Event`: the member's wake-up flag."""

    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...


class Member:
    """One waiting `acquire` call in a room."""

    __slots__ = ("flag", "joined", "rank")

    def __init__(self, flag: _Flag, joined: int) -> None:
        self.flag = flag
        self.joined = joined
        #: Lower is woken first; None until ranked (see `RoomCore.rank`).
        self.rank: int | None = None

    def consume(self) -> None:
        """Called right before an attempt: a wake-up set from now on is a new one."""
        self.flag.clear()


class RoomCore:
    """Who is in the room and whom an event wakes; no I/O, no locking (the sync
    room holds its lock around every call, the asyncio room runs on one loop)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.members: dict[int, Member] = {}
        self._joined = 0
        self._ranks = 0
        #: Instant on `clock` the room became empty (None while it has members).
        self.empty_since: float | None = clock.monotonic()
        #: Counters for tests and benchmarks.
        self.events = 0
        self.wakes = 0

    def join(self, flag: _Flag, fair: bool) -> Member:
        member = Member(flag, self._joined)
        self._joined += 1
        if not fair:
            self.rank(member)  # unfair: first come, first woken
        self.members[member.joined] = member
        self.empty_since = None
        return member

    def rank(self, member: Member) -> None:
        """Give `member` the next rank (fair: right after its queue entry was created)."""
        if member.rank is None:
            member.rank = self._ranks
            self._ranks += 1

    def leave(self, member: Member, won: bool) -> Member | None:
        """Remove `member`; return a member to wake in its place, if any."""
        if self.members.pop(member.joined, None) is None:
            return None
        if not self.members:
            self.empty_since = self.clock.monotonic()
        if not won and member.flag.is_set():
            # It was woken but will not attempt again: its wake-up passes on.
            return self.on_event()
        return None

    def on_event(self) -> Member | None:
        """A release/expiry event: the member to wake now, or None."""
        self.events += 1
        head = self.head()
        if head is None or head.flag.is_set():
            return None
        self.wakes += 1
        return head

    def head(self) -> Member | None:
        # Unranked members (a fair waiter's first attempt still in flight) come
        # last: they attempt anyway, right after joining.
        return min(
            self.members.values(),
            key=lambda m: (m.rank is None, m.rank or 0, m.joined),
            default=None,
        )

    def idle_for(self, now: float) -> float:
        return 0.0 if self.empty_since is None else now - self.empty_since

    def retire_due(self) -> bool:
        """Empty for `LINGER` seconds on the room's clock: time to go."""
        return self.idle_for(self.clock.monotonic()) >= LINGER


# --------------------------------------------------------------------------- sync


class SyncRoom:
    """A room for blocking waiters: one thread reads the room's change feed."""

    def __init__(
        self, store: Any, rid: str, key: tuple[Any, ...], clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.store = store
        self.rid = rid
        self.key = key
        self.core = RoomCore(clock)
        self.lock = threading.Lock()
        #: Fair waiters make their first attempt (which creates their queue
        #: entry) one at a time, so their ranks follow the database's order.
        self.enqueue = threading.Lock()
        self.ready = threading.Event()
        self.broken = False
        self.closed = False
        self._watcher: ChangeFeed | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"pglease-wait-{rid[:24]}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def join(self, fair: bool) -> Member:
        with self.lock:
            return self.core.join(threading.Event(), fair)

    def await_ready(self, limit: float | None) -> None:
        """Wait until the room's watcher is positioned (at most `limit`, capped at
        READY_TIMEOUT): events committed from then on wake a member, so an attempt
        made after this cannot miss the release that would wake it."""
        limit = READY_TIMEOUT if limit is None else min(limit, READY_TIMEOUT)
        if not self.ready.wait(max(0.0, limit)):
            log.debug("acquire watcher of %s not ready in %.1fs; timers meanwhile", self.rid, limit)

    def rank(self, member: Member) -> None:
        with self.lock:
            self.core.rank(member)

    def leave(self, member: Member, won: bool) -> None:
        with self.lock:
            nxt = self.core.leave(member, won)
            if nxt is not None:
                nxt.flag.set()

    def wait(self, member: Member, seconds: float | None) -> bool:
        """Sleep until woken (True) or `seconds` real seconds pass (False)."""
        if seconds is not None and seconds <= 0:
            return member.flag.is_set()
        return bool(member.flag.wait(seconds))  # type: ignore[attr-defined]

    def _run(self) -> None:
        try:
            watcher = self.store.runtime_driver().changes(self.rid, WAKE_EVENTS)
        except Exception as exc:  # the watcher is an optimisation, not a requirement
            log.debug("no watcher for acquire wake-ups of %s, timers only: %s", self.rid, exc)
            self._break()
            return
        self.ready.set()
        self._watcher = watcher
        try:
            while True:
                try:
                    event = watcher.get(timeout=LINGER / 2)
                except Exception as exc:
                    log.debug("acquire watcher of %s failed, timers only: %s", self.rid, exc)
                    self._break()
                    return
                with self.lock:
                    # Set under the lock: a member leaving concurrently then
                    # sees the wake-up it got and passes it on (`RoomCore.leave`).
                    nxt = self.core.on_event() if event is not None else None
                    if nxt is not None:
                        nxt.flag.set()
                if self._retire_if_idle():
                    return
        finally:
            with contextlib.suppress(Exception):
                watcher.close()

    def _retire_if_idle(self) -> bool:
        with _sync_lock, self.lock:
            if not self.core.retire_due():
                return False
            self.closed = True
            if _sync_rooms.get(self.key) is self:
                del _sync_rooms[self.key]
            return True

    def _break(self) -> None:
        """Members fall back to timers; new waiters get a new room."""
        with _sync_lock, self.lock:
            self.broken = True
            self.closed = True
            if _sync_rooms.get(self.key) is self:
                del _sync_rooms[self.key]
            members = list(self.core.members.values())
        self.ready.set()
        for member in members:
            member.flag.set()  # re-evaluate now, with the fallback re-check


_sync_rooms: dict[tuple[Any, ...], SyncRoom] = {}
_sync_lock = threading.Lock()


def join_sync(
    store: Any, rid: str, fair: bool, clock: Clock = SYSTEM_CLOCK
) -> tuple[SyncRoom, Member]:
    """Join this process's room for (store, rid, clock), creating it if needed;
    then call `room.await_ready` before the first attempt."""
    # The pid: a forked child must not join its parent's rooms (no thread there).
    # The driver: the room's feed comes from it (one per store object).
    key = (os.getpid(), id(store), store.runtime_driver(), rid, clock)
    with _sync_lock:
        room = _sync_rooms.get(key)
        if room is None or room.closed or room.store is not store:
            room = _sync_rooms[key] = SyncRoom(store, rid, key, clock)
            room.start()
        member = room.join(fair)
    return room, member


# The names the generated blocking acquire (`_acquire`, from `_acquire_async`) uses.
Room = SyncRoom
join = join_sync


# --------------------------------------------------------------------------- asyncio


class AsyncRoom:
    """A room for the asyncio waiters of one event loop: one task reads the
    room's change feed. Used only from its loop's thread, so no locks."""

    def __init__(
        self, store: Any, rid: str, key: tuple[Any, ...], clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.store = store
        self.rid = rid
        self.key = key
        self.core = RoomCore(clock)
        self.enqueue = asyncio.Lock()
        self.ready = asyncio.Event()
        self.broken = False
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self._task = self.loop.create_task(self._run(), name=f"pglease-wait-{rid[:24]}")

    def join(self, fair: bool) -> Member:
        return self.core.join(asyncio.Event(), fair)

    async def await_ready(self, limit: float | None) -> None:
        """The asyncio twin of `SyncRoom.await_ready`."""
        limit = READY_TIMEOUT if limit is None else min(limit, READY_TIMEOUT)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, limit)):
                await self.ready.wait()

    def rank(self, member: Member) -> None:
        self.core.rank(member)

    def leave(self, member: Member, won: bool) -> None:
        nxt = self.core.leave(member, won)
        if nxt is not None:
            nxt.flag.set()

    async def wait(self, member: Member, seconds: float | None) -> bool:
        """Sleep until woken (True) or `seconds` real seconds pass (False)."""
        flag: asyncio.Event = member.flag  # type: ignore[assignment]
        if seconds is not None and seconds <= 0:
            return flag.is_set()
        # asyncio.timeout, not wait_for (3.11: wait_for can swallow a cancellation).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await flag.wait()
        return flag.is_set()

    async def _run(self) -> None:
        watcher: AsyncChangeFeed | None = None
        try:
            try:
                watcher = await self.store.runtime_driver().changes(self.rid, WAKE_EVENTS)
            except Exception as exc:
                log.debug("no watcher for acquire wake-ups of %s, timers only: %s", self.rid, exc)
                self._break()
                return
            self.ready.set()
            while True:
                try:
                    event = await watcher.get(timeout=LINGER / 2)
                except Exception as exc:
                    log.debug("acquire watcher of %s failed, timers only: %s", self.rid, exc)
                    self._break()
                    return
                if event is not None:
                    nxt = self.core.on_event()
                    if nxt is not None:
                        nxt.flag.set()
                if self.core.retire_due():
                    self._forget()
                    return
        finally:
            self._forget()  # also when the loop cancels the task at shutdown
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.aclose()

    def _forget(self) -> None:
        self.closed = True
        if _async_rooms.get(self.key) is self:
            del _async_rooms[self.key]

    def _break(self) -> None:
        self.broken = True
        self._forget()
        self.ready.set()
        for member in list(self.core.members.values()):
            member.flag.set()


_async_rooms: dict[tuple[Any, ...], AsyncRoom] = {}


def join_async(
    store: Any, rid: str, fair: bool, clock: Clock = SYSTEM_CLOCK
) -> tuple[AsyncRoom, Member]:
    """The asyncio twin of `join_sync`: join the running loop's room for (store,
    rid, clock); then await `room.await_ready` before the first attempt."""
    loop = asyncio.get_running_loop()
    key = (os.getpid(), id(loop), id(store), store.runtime_driver(), rid, clock)
    room = _async_rooms.get(key)
    if room is None or room.closed or room.store is not store or room.loop is not loop:
        room = _async_rooms[key] = AsyncRoom(store, rid, key, clock)
    return room, room.join(fair)
