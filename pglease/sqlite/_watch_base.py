"""What `SqliteWatcher` and `AsyncSqliteWatcher` share, free of I/O: argument
checks, the position, the bounded queue, the file's identity and health.

The two watchers are written once, in `_watch_async` (asyncio); the blocking
`_watch` is generated from it by `tools/async_to_sync.py`.
"""

from __future__ import annotations

import os
import sqlite3
from collections import deque
from collections.abc import Iterable

from .._watch_common import (
    Filters,
    HubTuning,
    Mode,
    Trouble,
    WatchHealth,
    check_interval,
    check_max_pending,
    check_mode,
    check_retry_window,
    check_stall_timeout,
    check_tuning,
    make_health,
)
from ..clock import SYSTEM_CLOCK, Clock
from ..cursors import decode_cursor
from ..errors import ValidationError, WatchClosedError, WatchFailedError
from ..types import Event
from ..validation import describe

#: Poll period when `interval` is not given.
DEFAULT_INTERVAL = 0.05
#: Most events one poll query reads.
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
    """The cursor to read after; None means "now" (resolved on start)."""
    if after == "start":
        return "start"
    if after is None or after == "now":
        return None
    if not isinstance(after, str):
        raise ValidationError(f"after must be a cursor, 'now' or 'start', got {describe(after)}")
    decode_cursor(after)  # validates the shape
    return after


def check_sqlite_mode(mode: object) -> None:
    """SQLite has no LISTEN/NOTIFY: None and "poll" poll, "listen" is refused."""
    if check_mode(mode if mode is not None else "poll") == "listen":
        raise ValidationError(
            "mode='listen' needs LISTEN/NOTIFY, which SQLite does not have: a SQLite"
            " watcher polls (mode='poll', the default)"
        )


class SqliteWatcherBase:
    """Checks the arguments (before anything is read) and holds the shared state."""

    def __init__(
        self,
        path: str,
        after: str | None,
        types: Iterable[str] | str | None,
        resources: Iterable[str] | str | None,
        event_types: Iterable[str] | str | None,
        mode: str | None,
        interval: float | None,
        max_pending: int,
        retry_window: float,
        clock: Clock | None,
        tuning: HubTuning | None,
        stall_timeout: float,
    ) -> None:
        check_sqlite_mode(mode)
        self.mode: Mode = "poll"
        self.interval = check_interval(
            DEFAULT_INTERVAL if interval is None else interval, "interval"
        )
        self.max_pending = check_max_pending(max_pending)
        self.retry_window = check_retry_window(retry_window)
        # Accepted so that code written for either store runs on both; a
        # SQLite watcher has no hub, so there is nothing to tune.
        self.tuning = check_tuning(tuning)
        # Checked and kept for the same reason: a local file has no network path
        # that could go silent, so nothing waits on an answer from a server.
        self.stall_timeout = check_stall_timeout(stall_timeout)
        self._filters = Filters.build(types, resources, event_types)
        #: The position after the last event read (handed out or not, matching
        #: the filters or not); None until the start is resolved.
        self._cursor = _start(after)
        #: The cursor of the last event handed out (None: none yet).
        self._handed: str | None = None
        #: Where the watcher started: its cursor until it hands an event out.
        self._start_at: str | None = None
        #: The event id the next poll reads after (set once the start is resolved).
        self._after_id = 0
        self._started = False
        #: Events read and not handed out yet: at most `max_pending`.
        self._buffer: deque[Event] = deque()
        #: The last poll stopped at `max_pending` with more events in the file.
        self._behind = False
        #: How often the watcher fell `max_pending` events behind (see `overflows`).
        self._overflows = 0
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

    @property
    def overflows(self) -> int:
        """How often the bound held events back: `max_pending` were queued and
        more waited in the file, read by the next polls (nothing is lost)."""
        return self._overflows

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
        """Where the watcher stands: pass it as `after=` to continue from here
        (None before an asyncio watcher starts).

        Events read but not handed out yet are not behind it; with none
        pending it moves past every event read, including those the filters
        dropped.
        """
        if not self._buffer:
            return self._cursor
        return self._handed if self._handed is not None else self._start_at

    def _next(self) -> Event:
        event = self._buffer.popleft()
        self._handed = event.cursor
        return event

    def _started_at(self, cursor: str) -> None:
        self._cursor = self._start_at = cursor
        self._after_id = decode_cursor(cursor).event_id
        self._started = True

    def _room(self) -> int:
        """How many events the next page may add to the queue (0: it is full)."""
        return min(PAGE, self.max_pending - len(self._buffer))

    def _take(self, page: list[Event], wanted: int) -> bool:
        """Queue the first `wanted` events of `page` (read with one more, to see
        whether the file has more); True when it has."""
        more = len(page) > wanted
        for event in page[:wanted]:
            self._cursor = event.cursor
            self._after_id = event.id
            if self._filters.match(event):
                self._buffer.append(event)
        if not more:
            self._behind = False
        elif len(self._buffer) >= self.max_pending and not self._behind:
            self._behind = True
            self._overflows += 1
        return more

    def _check_open(self) -> None:
        if self._closed:
            raise WatchClosedError("the watcher was closed")
        if self._failed is not None:
            raise self._failed

    def _take_batch(self, first: Event, max_events: int) -> list[Event]:
        batch = [first]
        while len(batch) < max_events and self._buffer:
            batch.append(self._next())
        return batch
