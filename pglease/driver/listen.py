# Generated from pglease/driver/listen_async.py by tools/async_to_sync.py: do not edit.
"""The listen protocol: what the watch hub and the watchers (`pglease.watch`)
need from a backend to stream its event log.

Two roles. A *change listener* is the hub's own line to the backend (one per
process and stream): open it, wait with a bound for a wake-up, read a page of
the log after a position, close it. A *log reader* is what a watcher reads
through on its store's connections: where it starts, the pages it catches up
with, and the listener to open for the hub.

`AsyncChangeListener` and `AsyncLogReader` are the asyncio source;
`ChangeListener` and `LogReader` in `pglease/driver/listen.py` are their
generated blocking twins (the hub runs in a thread, so it opens a blocking
listener, from either reader). Parameters and results are the frozen values
of `pglease.driver.listen_ops`.

Errors: a read or a wait raises `LogReadError`, whose `permanent` flag tells
a lost connection (the hub reconnects and catches up) from trouble no retry
heals (privileges, a missing schema); a round trip that gets no answer
within its stall timeout (`ListenRequest.stall_timeout`, `PageOp.stall_timeout`)
is a lost connection, its cause a `DatabaseUnavailableError` that names the
silence; `check_position` raises
`ForeignCursorError` when the position is not one of this log; a reader's
`start` raises what any store call raises (and the cursor errors of
`pglease.cursor_check`); a closed store is `WatchClosedError`. Nothing else
but `PgleaseError`s, bar a bug.
"""

from __future__ import annotations

from typing import Protocol

from ..cursors import Cursor, Position
from .listen_ops import ListenRequest, LogPage, PageOp, StartPoint


class ChangeListener(Protocol):
    """A dedicated line to the backend's log and wake-ups."""

    def open(self) -> None:
        """Connect (and, when the request says `listen`, start listening):
        any event committed after `open` returns is read or wakes `wait`."""
        ...

    def set_listening(self, on: bool) -> None:
        """Start (True) or stop listening for wake-ups on the open line; after
        starting, read again: what committed before it does not wake `wait`."""
        ...

    def wait(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds for a wake-up; True when one came
        (also one that arrived during the last read)."""
        ...

    def frontier(self) -> Position:
        """The readable frontier now: every event not yet readable sorts after it."""
        ...

    def read_log(self, op: PageOp) -> LogPage:
        """A page of committed events after `op.after`."""
        ...

    def check_position(self, cursor: Cursor) -> None:
        """Refuse (`ForeignCursorError`) a position this log never had, or
        whose event is not the one `cursor` names (a failover lost it)."""
        ...

    def session_id(self) -> int | None:
        """The backend's id of the open line (PostgreSQL: its pid), None when closed."""
        ...

    def close(self) -> None:
        """Drop the line; closing twice, or a listener never opened, is harmless."""
        ...


class LogReader(Protocol):
    """A store's side of watching: starts, catch-up pages and the hub's listener."""

    #: Which backend this is (PostgreSQL: the DSN): watchers with the same
    #: source, schema and options share one hub.
    @property
    def source(self) -> str: ...

    @property
    def schema(self) -> str: ...

    #: Behind a transaction pooler (the hub then polls).
    @property
    def pooler(self) -> bool: ...

    def start(self, cursor: Cursor | None, stall_timeout: float | None = None) -> StartPoint:
        """Where a watcher starts: "now" for None, else `cursor`, checked against
        this log (`CursorAheadError`, `HistoryDivergedError`; an expired cursor
        fails on the first page instead). No answer within `stall_timeout`
        seconds (None: no client-side bound) is `DatabaseUnavailableError`."""
        ...

    def read_log(self, op: PageOp) -> LogPage:
        """A page of committed events after `op.after`, up to `op.upto`."""
        ...

    def listener(self, request: ListenRequest) -> ChangeListener:
        """A new, unopened blocking listener (the hub opens it in its thread)."""
        ...
