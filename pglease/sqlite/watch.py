"""Watching a SQLite store: polling the event table with the store's cursors.

SQLite has no LISTEN/NOTIFY, and one writer at a time makes event ids
commit-ordered, so a poll of `events_after(cursor)` every `interval` seconds
delivers every committed event exactly once, in order, with no gap; a saved
cursor resumes exactly where the watcher stopped, also in another process.

Errors, as for PostgreSQL watchers: a failed poll is logged and retried
(``database is locked``, a file that cannot be opened for a moment) until
`retry_window` seconds pass, then raised as `WatchFailedError`; errors that
cannot heal raise at once: the file deleted or replaced (the store's pooled
connections would go on reading the old, unlinked file and see nothing, a
silent stall), not a database, corrupt, no events table, access denied.
A file made unreadable (chmod) while the watcher runs is noticed only when a
new connection is opened: pooled connections keep their open file.

A cursor is checked once, when the watcher starts: one that is not a position
in this file's log (`CursorAheadError`, `HistoryDivergedError`: another file,
or this file replaced by an older copy) is refused. The polls after it are not
checked again.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING

from ..clock import SYSTEM_CLOCK, Clock
from ..cursors import decode_cursor
from ..errors import ValidationError, WatchClosedError, WatchFailedError
from ..types import Event
from ..validation import describe
from ..watch._core import (
    DEFAULT_RETRY_WINDOW,
    Filters,
    Trouble,
    WatchHealth,
    check_interval,
    check_retry_window,
    make_health,
)
from ._db import SqliteFileError

if TYPE_CHECKING:
    from .async_store import AsyncSqliteStore
    from .store import SqliteStore

DEFAULT_INTERVAL = 0.05
PAGE = 1000
#: SQLite result codes no retry heals.
_PERMANENT_CODES = frozenset({"SQLITE_NOTADB", "SQLITE_CORRUPT", "SQLITE_PERM", "SQLITE_AUTH"})


def _cannot_heal(exc: BaseException) -> bool:
    # A SqliteFileError carries the sqlite3 error as its cause.
    for err in (exc, exc.__cause__):
        if getattr(err, "sqlite_errorname", None) in _PERMANENT_CODES:
            return True
        # The events table is gone: the file is not (or no longer) a pglease store.
        if isinstance(err, sqlite3.OperationalError) and "no such table" in str(err):
            return True
    return False


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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
        path: str,
        retry_window: float,
        clock: Clock | None,
    ) -> None:
        self.interval = check_interval(interval, "interval")
        self.retry_window = check_retry_window(retry_window)
        self._filters = Filters.build(types, resources, event_types)
        self._cursor = _start(after)
        #: The event id the next poll reads after (set once the start is resolved).
        self._after_id = 0
        self._started = False
        self._buffer: deque[Event] = deque()
        self._closed = False
        self._path = path
        self._clock: Clock = SYSTEM_CLOCK if clock is None else clock
        self._trouble = Trouble(self._clock, self.retry_window, f"SQLite watcher of {path!r}")
        self._failed: WatchFailedError | None = None
        #: (st_dev, st_ino) of the file when the watcher started.
        self._file = _identity(path)
        self._last_read: float | None = None
        self._last_read_wall: float | None = None

    @property
    def health(self) -> WatchHealth:
        """The last error, since when polls fail, and the lag (a snapshot)."""
        return make_health(
            troubles=[self._trouble],
            failed=self._failed,
            lag_events=len(self._buffer),
            reconnects=0,  # no connection of its own: the store's pool reconnects
            last_read=self._last_read,
            last_read_wall=self._last_read_wall,
            clock=self._clock,
        )

    def _check_file(self) -> None:
        """Raise when the file was deleted or replaced since the watcher started."""
        now = _identity(self._path)
        if now == self._file:
            return
        what = "deleted" if now is None else "replaced by another file"
        exc = FileNotFoundError(f"{self._path!r} was {what}")
        self._give_up(
            exc,
            True,
            " (the watcher's position belongs to the old file; open a store on the new"
            " one and watch from 'start' or 'now')",
        )

    def _give_up(self, exc: BaseException, permanent: bool | None, hint: str = "") -> float:
        """Record a failed poll: the delay before retrying, or raise when it is time."""
        error = self._trouble.record(exc, permanent, hint)
        if error is not None:
            self._failed = error
            raise error
        return self._trouble.delay()

    def _poll_failed(self, exc: Exception) -> float:
        return self._give_up(exc, _cannot_heal(exc) or None)

    def _polled(self) -> None:
        self._last_read = self._clock.monotonic()
        self._last_read_wall = self._clock.time()
        if self._trouble.failing_since is not None:
            self._trouble.healed()

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
        if self._failed is not None:
            raise self._failed


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
        retry_window: float = DEFAULT_RETRY_WINDOW,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            after, types, resources, event_types, interval, store.path, retry_window, clock
        )
        self._store = store
        if self._cursor is None:  # "now" means now, not the first poll
            self._started_at(store._now_cursor())
        else:
            if self._cursor != "start":
                store._check_cursor(self._cursor)
            self._started_at(self._cursor)

    def _poll(self) -> None:
        self._check_file()
        while not self._buffer and (page := self._store._events_after_id(self._after_id, PAGE)):
            self._take(page)
            if len(page) < PAGE:
                break
        self._polled()

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            pause = self.interval
            if not self._buffer:
                try:
                    self._poll()
                except (sqlite3.Error, SqliteFileError) as exc:
                    pause = self._poll_failed(exc)
            if self._buffer:
                return self._buffer.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            left = pause if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(pause, left)))

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
        retry_window: float = DEFAULT_RETRY_WINDOW,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            after, types, resources, event_types, interval, store.path, retry_window, clock
        )
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
        self._check_file()
        sync = self._store.sync_store
        while not self._buffer and (
            page := await asyncio.to_thread(sync._events_after_id, self._after_id, PAGE)
        ):
            self._take(page)
            if len(page) < PAGE:
                break
        self._polled()

    async def get(self, timeout: float | None = None) -> Event | None:
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
                return self._buffer.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            left = pause if deadline is None else deadline - time.monotonic()
            await asyncio.sleep(max(0.0, min(pause, left)))

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
