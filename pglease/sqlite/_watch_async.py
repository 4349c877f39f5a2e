"""`AsyncSqliteWatcher`, written once: the source of the blocking `SqliteWatcher`.

This module is the hand-written asyncio source; `_watch.py` is generated from
it by `tools/async_to_sync.py`. The asyncio watcher runs each poll (sqlite3
blocks) in a worker thread; the blocking one polls in the caller's thread.
See `pglease.sqlite.watch` for what they guarantee.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

from .._watch_common import (
    DEFAULT_MAX_PENDING,
    DEFAULT_RETRY_WINDOW,
    DEFAULT_STALL_TIMEOUT,
    HubTuning,
    check_max_events,
)
from ..clock import Clock
from ..errors import WatchClosedError
from ..types import Event
from ._db import SqliteFileError
from ._watch_base import SqliteWatcherBase

if TYPE_CHECKING:
    from .async_store import AsyncSqliteStore  # sync: from .store import SqliteStore


class AsyncSqliteWatcher(SqliteWatcherBase):
    """Stream a SQLite store's committed events, in order, from `after` on.

    `SqliteWatcher` blocks (``for event in watcher``, `get`, `get_batch`);
    `AsyncSqliteWatcher` is its asyncio twin (``async for``, ``await
    watcher.get()``). A `SqliteWatcher` starts in its constructor, an
    `AsyncSqliteWatcher` in `start()`, ``async with`` or its first `get`.
    The arguments are `PostgresStore.watch`'s; see `pglease.sqlite.watch`
    for what `mode`, `max_pending`, `tuning` and `stall_timeout` mean for SQLite.
    """

    def __init__(
        self,
        store: AsyncSqliteStore,
        *,
        after: str | None = "now",
        types: Iterable[str] | str | None = None,
        resources: Iterable[str] | str | None = None,
        event_types: Iterable[str] | str | None = None,
        mode: str | None = None,
        interval: float | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        retry_window: float = DEFAULT_RETRY_WINDOW,
        clock: Clock | None = None,
        tuning: HubTuning | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        super().__init__(
            store.path, after, types, resources, event_types, mode, interval, max_pending,
            retry_window, clock, tuning, stall_timeout,
        )  # fmt: skip
        self._store = store
        # A blocking watcher starts at once: "now" means when it was made.
        # sync: self.start()

    async def start(self) -> AsyncSqliteWatcher:
        """Pin "now" to the current end of the log, or check the cursor; once only."""
        if self._started:
            return self
        store = self._store
        if self._cursor is None:  # "now" means now, not the first poll
            cursor = await store._now_cursor()
        else:
            cursor = self._cursor
            if cursor != "start":
                await store._check_cursor(cursor)
        self._started_at(cursor)
        return self

    async def _poll(self) -> None:
        self._check_file()
        store = self._store
        # Until something matches the filters (as soon as possible, not as
        # much as possible), at most `max_pending` events at a time.
        while not self._buffer and (wanted := self._room()) > 0:
            # One event more than wanted: whether the file has more than fits.
            after = self._after_id
            page = await store._events_after_id(after, wanted + 1)
            if not self._take(page, wanted):
                break
        self._polled()

    async def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass without one."""
        if not self._started:
            await self.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            pause = self.interval
            if not self._buffer:
                try:
                    await self._poll()
                except (sqlite3.Error, SqliteFileError) as exc:
                    pause = self._poll_failed(exc)
            if self._buffer:
                return self._next()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            left = pause if deadline is None else deadline - time.monotonic()
            wait = max(0.0, min(pause, left))
            await asyncio.sleep(wait)  # sync: time.sleep(wait)

    async def get_batch(
        self, timeout: float | None = None, max_events: int = 10_000
    ) -> list[Event]:
        """Up to `max_events` events: waits for the first, takes what is ready after it."""
        check_max_events(max_events)
        first = await self.get(timeout)
        if first is None:
            return []
        return self._take_batch(first, max_events)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        try:
            got = await self.get(None)
        except WatchClosedError:
            raise StopAsyncIteration from None
        assert got is not None
        return got

    async def aclose(self) -> None:
        """Stop watching; a waiting `get` returns within `interval` (a blocking
        watcher may be closed from any thread)."""
        self._closed = True

    async def __aenter__(self) -> AsyncSqliteWatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
