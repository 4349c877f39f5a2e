"""What the sync and asyncio watchers share: filters, the hub's messages and the
delivery state machine (the SQL is the backend's, behind `pglease.driver.listen`).

Positions are `(xid, event id)` pairs (see `pglease.cursors`). Every reader
(the process hub and each watcher catching up) reads the same immutable
prefix of the log, in position order, so a watcher can switch from its own
catch-up reads to the hub's stream by comparing positions alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Re-exported: the watch package's modules and tests import them from here.
from .._watch_common import DEFAULT_RETRY_WINDOW as DEFAULT_RETRY_WINDOW
from .._watch_common import DEFAULT_STALL_TIMEOUT as DEFAULT_STALL_TIMEOUT
from .._watch_common import RETRY_DELAYS as RETRY_DELAYS
from .._watch_common import Filters as Filters
from .._watch_common import Mode as Mode
from .._watch_common import Trouble as _Trouble
from .._watch_common import WatchHealth as WatchHealth
from .._watch_common import cannot_heal as cannot_heal
from .._watch_common import channel_name as channel_name
from .._watch_common import check_interval as check_interval
from .._watch_common import check_mode as check_mode
from .._watch_common import check_retry_window as check_retry_window
from .._watch_common import describe_plain
from .._watch_common import log as log
from .._watch_common import make_health as make_health
from .._watch_common import sqlstate_of as sqlstate_of
from ..cursors import START, Position, cursor_check, encode_cursor
from ..driver.listen_ops import LogPage
from ..dsn import redact_text
from ..errors import CursorExpiredError, WatchClosedError

# The reaper's and prune's SQL and store protocols (`watcher.Store`, `AsyncStore`):
# they move with them behind the reap/prune protocol.
from ..types import Event

#: The biggest position; the hub reads with no upper bound.
END = Position(2**64 - 1, 2**63 - 1)
PAGE = 1000


@dataclass(slots=True)
class Batch:
    """What the hub hands every subscriber after a read."""

    events: list[Event]
    positions: list[Position]
    #: The hub's position after this batch (last event or the readable frontier).
    tip: Position


@dataclass(slots=True)
class Start:
    """The first message to a subscriber: the hub position it joins at."""

    tip: Position


@dataclass(slots=True)
class Failure:
    error: BaseException


Message = Batch | Start | Failure


class WatchState:
    """The delivery state machine of one watcher, free of I/O.

    Phases: wait for the hub's `Start` (the position the stream joins at),
    catch up with our own reads from our cursor up to that position, then take
    the hub's batches, dropping anything at or before our cursor.
    """

    def __init__(
        self, position: Position, from_start: bool, filters: Filters, check: str | None = None
    ):
        self.position = position
        self.from_start = from_start
        self.filters = filters
        #: Position the hub stream joined at; None until `Start` arrives.
        self.join: Position | None = None
        self.catching_up = False
        self.pending: deque[Event] = deque()
        #: The last event handed out (None: nothing yet, `_start` applies).
        #: Public so that the watchers' per-event fast paths can set it inline.
        self.last: Event | None = None
        self._start = position
        #: The last event read (filtered out or not): the anchor a cursor at
        #: `position` carries (see `pglease.cursors`); before any, `_check`.
        self.anchor: Event | None = None
        self._check = check
        #: A watcher that failed (cursor expired) keeps failing: continuing
        #: would skip the deleted events silently.
        self.failed: BaseException | None = None

    @property
    def cursor(self) -> str:
        # Events read but not yet handed out must not be skipped on resume.
        if not self.pending:
            anchor = self.anchor
            check = cursor_check(anchor.cursor) if anchor is not None else self._check
            return encode_cursor(self.position, check)
        if self.last is not None:
            return self.last.cursor
        return encode_cursor(self._start, self._check)

    def on_message(self, message: Message) -> None:
        if isinstance(message, Failure):
            self.failed = message.error
            raise message.error
        if isinstance(message, Start):
            self.join = message.tip
            self.catching_up = self.position < message.tip
            return
        assert self.join is not None, "the hub sends Start first"
        if self.catching_up:
            # Cannot happen: catch-up finishes before the queue is read again.
            raise AssertionError("batch while catching up")
        self._take(message.events, message.positions)
        if message.tip > self.position:
            self.position = message.tip

    def rejoin(self, tip: Position) -> None:
        """The mailbox dropped batches up to `tip` (we fell behind): read that
        span from the log ourselves, then take the stream again after it.
        Called only with nothing pending, like `on_message`."""
        self.join = tip
        self.catching_up = self.position < tip

    def on_page(self, page: LogPage) -> None:
        """A catch-up page read from our position up to `join`."""
        self.check_horizon(page.horizon)
        self._take(page.events, page.positions)
        if not page.full:
            assert self.join is not None
            self.catching_up = False
            if self.join > self.position:
                self.position = self.join

    def check_horizon(self, horizon: Position) -> None:
        if self.position >= horizon:
            return
        if self.from_start and self.position == START:
            # "start" means the oldest retained event, not event zero.
            self.position = self._start = horizon
            self._check = None  # its event was pruned: nothing to check
            return
        self.failed = CursorExpiredError(
            f"cursor {encode_cursor(self.position)} is older than the pruned horizon"
            f" {encode_cursor(horizon)}: events after it were deleted; resume from 'now'"
            " or 'start' and resync"
        )
        raise self.failed

    def _take(self, events: list[Event], positions: list[Position]) -> None:
        if not events:
            return
        if positions[0] > self.position:
            # The common case (a live batch, all new): no per-event position checks.
            self.position = positions[-1]
            self.anchor = events[-1]
            if self.filters.unfiltered:
                self.pending.extend(events)
            else:
                self.pending.extend(e for e in events if self.filters.match(e))
            return
        for event, pos in zip(events, positions, strict=True):
            if pos <= self.position:
                continue  # already delivered (we read past the hub's join point)
            self.position = pos
            self.anchor = event
            if self.filters.match(event):
                self.pending.append(event)

    def take(self, limit: int) -> list[Event]:
        """Up to `limit` pending events, without waiting."""
        pending = self.pending
        n = min(limit, len(pending))
        if n <= 0:
            return []
        if n == len(pending):
            # The usual case: all of it, copied in C rather than popped one by one.
            out = list(pending)
            pending.clear()
        else:
            out = [pending.popleft() for _ in range(n)]
        self.last = out[-1]
        return out

    def next_event(self) -> Event | None:
        if self.pending:
            event = self.pending.popleft()
            self.last = event
            return event
        return None


def closed_error() -> WatchClosedError:
    return WatchClosedError("the watcher is closed")


# ------------------------------------------------------------------ errors and health


def describe_error(exc: BaseException) -> str:
    """One line naming the error and its SQLSTATE, without any password."""
    return redact_text(describe_plain(exc))


class Trouble(_Trouble):
    """`_watch_common.Trouble` for PostgreSQL readers: messages mask passwords."""

    describe = staticmethod(describe_error)
