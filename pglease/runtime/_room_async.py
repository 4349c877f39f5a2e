"""Waiting rooms, asyncio source: `_room` is its generated blocking twin.

What a room does is told in `pglease.runtime._rooms`; who is woken is decided
in `_room_core`. The flavours differ in who reads the room's change feed (a
task on the waiters' loop; a daemon thread in the twin) and in locking: the
twin's threads hold a room's lock around every `RoomCore` call, the asyncio
room runs on one loop and needs none (`thread_lock` is a no-op here).
"""

from __future__ import annotations

import asyncio  # sync: import threading
import contextlib
import logging
import os
from typing import Any

from .._compat_async import Event, Lock, thread_lock
from ..clock import SYSTEM_CLOCK, Clock
from ..driver import AsyncChangeFeed
from ._room_core import LINGER, READY_TIMEOUT, WAKE_EVENTS, Member, RoomCore

log = logging.getLogger("pglease.runtime")


class AsyncRoom:
    """A room for the waiters of one process (asyncio: of one event loop) on one
    resource: one task (a thread in the twin) reads the room's change feed."""

    def __init__(
        self, store: Any, rid: str, key: tuple[Any, ...], clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.store = store
        self.rid = rid
        self.key = key
        self.core = RoomCore(clock)
        self.lock = thread_lock()
        #: Fair waiters make their first attempt (which creates their queue
        #: entry) one at a time, so their ranks follow the database's order.
        self.enqueue = Lock()
        self.ready = Event()
        self.broken = False
        self.closed = False
        self.loop = asyncio.get_running_loop()  # sync: -
        self._task: asyncio.Task[None] | None = None  # sync: -

    def start(self) -> None:
        """Start reading the change feed."""
        name = f"pglease-wait-{self.rid[:24]}"
        self._task = self.loop.create_task(self._run(), name=name)  # sync: -
        # sync: self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # sync: self._thread.start()

    def serves(self, store: Any) -> bool:
        """Still open and for `store` (asyncio: on the running loop): ids get reused."""
        here = self.loop is asyncio.get_running_loop()  # sync: here = True
        return here and not self.closed and self.store is store

    def join(self, fair: bool) -> Member:
        with self.lock:
            return self.core.join(Event(), fair)

    async def await_ready(self, limit: float | None) -> None:
        """Wait until the room's watcher is positioned (at most `limit`, capped at
        READY_TIMEOUT): events committed from then on wake a member, so an attempt
        made after this cannot miss the release that would wake it."""
        limit = READY_TIMEOUT if limit is None else min(limit, READY_TIMEOUT)
        # async-only: begin
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, limit)):
                await self.ready.wait()
        # async-only: end
        # sync: self.ready.wait(max(0.0, limit))
        if not self.ready.is_set():
            log.debug("acquire watcher of %s not ready in %.1fs; timers meanwhile", self.rid, limit)

    def rank(self, member: Member) -> None:
        with self.lock:
            self.core.rank(member)

    def leave(self, member: Member, won: bool) -> None:
        with self.lock:
            nxt = self.core.leave(member, won)
            if nxt is not None:
                nxt.flag.set()

    async def wait(self, member: Member, seconds: float | None) -> bool:
        """Sleep until woken (True) or `seconds` real seconds pass (False)."""
        flag: Event = member.flag  # type: ignore[assignment]
        if seconds is not None and seconds <= 0:
            return flag.is_set()
        # Inline, not a helper: every waiter's every wake-up passes here.
        # async-only: begin
        # asyncio.timeout, not wait_for (3.11: wait_for can swallow a cancellation).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await flag.wait()
        return flag.is_set()
        # async-only: end
        # sync: return flag.wait(seconds)

    async def _run(self) -> None:
        watcher: AsyncChangeFeed | None = None
        try:
            try:
                watcher = await self.store.runtime_driver().changes(self.rid, WAKE_EVENTS)
            except Exception as exc:  # the watcher is an optimisation, not a requirement
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
                with self.lock:
                    # Set under the lock: a member leaving concurrently then
                    # sees the wake-up it got and passes it on (`RoomCore.leave`).
                    nxt = self.core.on_event() if event is not None else None
                    if nxt is not None:
                        nxt.flag.set()
                if self._retire_if_idle():
                    return
        finally:
            with _lock, self.lock:
                self._forget()  # also when the loop cancels the task at shutdown
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.aclose()

    def _retire_if_idle(self) -> bool:
        with _lock, self.lock:
            if not self.core.retire_due():
                return False
            self._forget()
            return True

    def _forget(self) -> None:
        """Closed: new waiters get a new room (call with both locks held)."""
        self.closed = True
        if _rooms_async.get(self.key) is self:
            del _rooms_async[self.key]

    def _break(self) -> None:
        """Members fall back to timers; new waiters get a new room."""
        with _lock, self.lock:
            self.broken = True
            self._forget()
            members = list(self.core.members.values())
        self.ready.set()
        for member in members:
            member.flag.set()  # re-evaluate now, with the fallback re-check


_rooms_async: dict[tuple[Any, ...], AsyncRoom] = {}
_lock = thread_lock()


def join_async(
    store: Any, rid: str, fair: bool, clock: Clock = SYSTEM_CLOCK
) -> tuple[AsyncRoom, Member]:
    """Join this process's room for (store, rid, clock) (asyncio: the running
    loop's), creating it if needed; then wait for `room.await_ready` before the
    first attempt."""
    # The pid: a forked child must not join its parent's rooms (no thread there).
    # The driver: the room's feed comes from it (one per store object).
    where = (os.getpid(), id(asyncio.get_running_loop()))  # sync: where = (os.getpid(),)
    key = (*where, id(store), store.runtime_driver(), rid, clock)
    with _lock:
        room = _rooms_async.get(key)
        if room is None or not room.serves(store):
            room = _rooms_async[key] = AsyncRoom(store, rid, key, clock)
            room.start()
        member = room.join(fair)
    return room, member
