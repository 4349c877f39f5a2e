"""The values of the listen protocol (`pglease.driver.listen_async`): what a
watch hub asks of a backend's change listener and log reader, and what it
gets back.

Positions are `(xid, event id)` pairs (see `pglease.cursors`); every reader
reads the same immutable prefix of the log in position order, so a page read
by the hub and one read by a watcher catching up can be joined by comparing
positions alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cursors import Position
from ..errors import PgleaseError
from ..types import Event


@dataclass(frozen=True, slots=True)
class ListenRequest:
    """Open a change listener on `source` (a backend's address, e.g. a DSN).

    `listen`: wait for the backend's wake-ups (NOTIFY), else only poll;
    `pooler`: behind a transaction pooler (no session state, no prepared
    statements; never with `listen`); `stall_timeout`: seconds each round trip
    on the listener's line (the connect included) may go without an answer
    before it fails as a lost line (None: no client-side bound)."""

    source: str
    schema: str
    listen: bool
    pooler: bool
    stall_timeout: float | None = None


@dataclass(frozen=True, slots=True)
class PageOp:
    """Read at most `limit` committed events after `after`, up to `upto` (included).

    `stall_timeout`: seconds the read may go without an answer before it fails
    as a lost connection (None: a listener's own `ListenRequest.stall_timeout`,
    a log reader's no client-side bound)."""

    after: Position
    upto: Position
    limit: int
    stall_timeout: float | None = None


@dataclass(frozen=True, slots=True)
class LogPage:
    """One read: events in position order plus what the snapshot said."""

    events: list[Event]
    positions: list[Position]
    #: Readable frontier: every event not yet committed sorts after it.
    frontier: Position
    #: True when an event may still become readable below the frontier without
    #: any further wake-up (a writer in flight): the reader must re-poll.
    held_back: bool
    #: The last position ever deleted by prune (START when none).
    horizon: Position
    #: The page holds `limit` events: read again after its last position.
    full: bool


@dataclass(frozen=True, slots=True)
class StartPoint:
    """Where a watcher starts: a position and the fingerprint of the event at it
    (None: nothing to check, as at the log's start)."""

    position: Position
    check: str | None


class LogReadError(PgleaseError):
    """A listener or a log read failed.

    `permanent` says whether retrying can heal it (a lost connection can, a
    revoked privilege or a dropped schema cannot); the backend's own error is
    the `__cause__`, which is what a reader records and reports."""

    def __init__(self, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent
