"""Watching a SQLite store: polling the event table with the store's cursors.

SQLite has no LISTEN/NOTIFY, and one writer at a time makes event ids
commit-ordered, so a poll of `events_after(cursor)` every `interval` seconds
delivers every committed event exactly once, in order, with no gap; a saved
cursor resumes exactly where the watcher stopped, also in another process.

A cursor is checked once, when the watcher starts: one that is not a position
in this file's log (`CursorAheadError`, `HistoryDivergedError`: another file,
or this file replaced by an older copy) is refused. The polls after it are not
checked again.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING

from ..cursors import decode_cursor
from ..errors import ValidationError, WatchClosedError
from ..types import Event
from ..validation import describe
from ..watch._core import Filters, check_interval

if TYPE_CHECKING:
    from .async_store import AsyncSqliteStore
    from .store import SqliteStore

DEFAULT_INTERVAL = 0.05
PAGE = 1000


def _start(after: str | None) -> str | None:
    """The cursor to read after; None means "now" (resolved on first read)."""
    if after == "start":
        return "start"
    if after is None or after == "now":
        return None
    if not isinstance(after, str):
        raise ValidationError(f"after must be a cursor, 'now' or 'start', got {describe(after)}")
    decode_cursor(after)  # validates the shape
    return after


class _Base:
    def __init__(
        self,
        after: str | None,
        types: Iterable[str] | str | None,
        resources: Iterable[str] | str | None,
        event_types: Iterable[str] | str | None,
        interval: float,
    ) -> None:
        self.interval = check_interval(interval, "interval")
        self._filters = Filters.build(types, resources, event_types)
        self._cursor = _start(after)
        #: The event id the next poll reads after (set once the start is resolved).
        self._after_id = 0
        self._started = False
        self._buffer: deque[Event] = deque()
        self._closed = False

    @property
    def cursor(self) -> str | None:
        """The position after the last event handed out (save it to resume)."""
        return self._cursor

    def _started_at(self, cursor: str) -> None:
        self._cursor = cursor
        self._after_id = decode_cursor(cursor).event_id
        self._started = True

    def _take(self, page: list[Event]) -> None:
        for event in page:
            self._cursor = event.cursor
            self._after_id = event.id
            if self._filters.match(event):
                self._buffer.append(event)

    def _check_open(self) -> None:
        if self._closed:
            raise WatchClosedError("the watcher was closed")


class SqliteWatcher(_Base):
    """Blocking iterator over a `SqliteStore`'s events (see the module docstring)."""

    def __init__(
        self,
        store: SqliteStore,
        *,
        after: str | None = "now",
        types: Iterable[str] | str | None = None,
        resources: Iterable[str] | str | None = None,
        event_types: Iterable[str] | str | None = None,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        super().__init__(after, types, resources, event_types, interval)
        self._store = store
        if self._cursor is None:  # "now" means now, not the first poll
            self._started_at(store._now_cursor())
        else:
            if self._cursor != "start":
                store._check_cursor(self._cursor)
            self._started_at(self._cursor)

    def _poll(self) -> None:
        while not self._buffer and (page := self._store._events_after_id(self._after_id, PAGE)):
            self._take(page)
            if len(page) < PAGE:
                break

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            if not self._buffer:
                self._poll()
            if self._buffer:
                return self._buffer.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            left = self.interval if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(self.interval, left)))

    def get_batch(self, timeout: float | None = None, max_events: int = 10_000) -> list[Event]:
        """Up to `max_events` events: waits for the first, takes what is ready after it."""
        first = self.get(timeout)
        if first is None:
            return []
        batch = [first]
        while len(batch) < max_events and self._buffer:
            batch.append(self._buffer.popleft())
        return batch

    def __iter__(self) -> Iterator[Event]:
        while not self._closed:
            event = self.get(None)
            if event is not None:
                yield event

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> SqliteWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSqliteWatcher(_Base):
    """The asyncio twin of `SqliteWatcher`: ``async for event in store.watch()``."""

    def __init__(
        self,
        store: AsyncSqliteStore,
        *,
        after: str | None = "now",
        types: Iterable[str] | str | None = None,
        resources: Iterable[str] | str | None = None,
        event_types: Iterable[str] | str | None = None,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        super().__init__(after, types, resources, event_types, interval)
        self._store = store

    async def start(self) -> AsyncSqliteWatcher:
        """Pin "now" to the current end of the log, or check the cursor
        (``async with`` does this)."""
        if self._started:
            return self
        sync = self._store.sync_store
        if self._cursor is None:
            self._started_at(await asyncio.to_thread(sync._now_cursor))
        else:
            if self._cursor != "start":
                await asyncio.to_thread(sync._check_cursor, self._cursor)
            self._started_at(self._cursor)
        return self

    async def _poll(self) -> None:
        await self.start()
        sync = self._store.sync_store
        while not self._buffer and (
            page := await asyncio.to_thread(sync._events_after_id, self._after_id, PAGE)
        ):
            self._take(page)
            if len(page) < PAGE:
                break

    async def get(self, timeout: float | None = None) -> Event | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            if not self._buffer:
                await self._poll()
            if self._buffer:
                return self._buffer.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            left = self.interval if deadline is None else deadline - time.monotonic()
            await asyncio.sleep(max(0.0, min(self.interval, left)))

    async def get_batch(
        self, timeout: float | None = None, max_events: int = 10_000
    ) -> list[Event]:
        first = await self.get(timeout)
        if first is None:
            return []
        batch = [first]
        while len(batch) < max_events and self._buffer:
            batch.append(self._buffer.popleft())
        return batch

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while not self._closed:
            event = await self.get(None)
            if event is not None:
                yield event

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> AsyncSqliteWatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
