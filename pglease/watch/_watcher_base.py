"""What `Watcher` and `AsyncWatcher` share, free of I/O: argument checks, the
start position, health, and the store protocols they read through.

The two watchers themselves are written once, in `_watcher_async` (asyncio),
and the blocking `_watcher` is generated from it by `tools/async_to_sync.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .._watch_common import check_max_events as check_max_events
from .._watch_common import check_stall_timeout, check_tuning
from ..clock import SYSTEM_CLOCK, Clock
from ..cursors import Cursor, parse_cursor
from ..driver.listen import LogReader
from ..driver.listen_async import AsyncLogReader
from ..driver.listen_ops import LogReadError, PageOp, StartPoint
from ..errors import ValidationError, WatchClosedError
from ..validation import describe
from . import hub as _hub
from ._core import (
    PAGE,
    Filters,
    Mode,
    Trouble,
    WatchHealth,
    WatchState,
    check_interval,
    check_mode,
    check_retry_window,
    make_health,
)
from .mailbox import OVERFLOW, AsyncMailbox, Item, SyncMailbox, check_max_pending

#: Fallback poll in listen mode (a bound on latency if a wake-up is lost).
DEFAULT_FALLBACK_INTERVAL = 1.0
#: Poll period in poll mode.
DEFAULT_POLL_INTERVAL = 0.05


class WatchedStore(Protocol):
    """What a blocking watcher needs of a store: its log reader (the listen protocol)."""

    def log_reader(self) -> LogReader: ...


class AsyncWatchedStore(Protocol):
    """What an asyncio watcher needs of a store: its log reader (the listen protocol)."""

    def log_reader(self) -> AsyncLogReader: ...


def _after(after: str | None) -> tuple[Cursor | None, bool]:
    """(cursor, from_start); cursor None means "now" (resolved by a query)."""
    if after is None or after == "now":
        return None, False
    if after == "start":
        return parse_cursor("start"), True
    if not isinstance(after, str):
        raise ValidationError(f"after must be a cursor, 'now' or 'start', got {describe(after)}")
    return parse_cursor(after), False


class WatcherBase:
    """Checks the arguments (before anything is read) and holds the shared state."""

    def __init__(
        self,
        store: WatchedStore | AsyncWatchedStore,
        after: str | None,
        types: Iterable[str] | str | None,
        resources: Iterable[str] | str | None,
        event_types: Iterable[str] | str | None,
        mode: str | None,
        interval: float | None,
        max_pending: int,
        retry_window: float,
        clock: Clock | None,
        tuning: _hub.HubTuning | None,
        stall_timeout: float,
    ) -> None:
        reader = store.log_reader()
        pooler = reader.pooler
        self.mode: Mode = check_mode(("poll" if pooler else "listen") if mode is None else mode)
        if pooler and self.mode == "listen":
            # A transaction pooler hands the LISTEN's server connection to other
            # clients: notifications would go missing or reach nobody.
            raise ValidationError(
                "mode='listen' cannot work in pooler mode (a transaction pooler keeps no"
                " session for LISTEN): use mode='poll', the default there"
            )
        self.retry_window = check_retry_window(retry_window)
        self.stall_timeout = check_stall_timeout(stall_timeout)
        self._clock: Clock = SYSTEM_CLOCK if clock is None else clock
        self._options = _hub.HubOptions(
            self.retry_window,
            self._clock,
            check_tuning(tuning),
            pooler,
            self.stall_timeout,
        )
        self.max_pending = check_max_pending(max_pending)
        default = DEFAULT_FALLBACK_INTERVAL if self.mode == "listen" else DEFAULT_POLL_INTERVAL
        self.interval = check_interval(default if interval is None else interval, "interval")
        self._filters = Filters.build(types, resources, event_types)
        self._start_cursor, self._from_start = _after(after)
        self._schema = reader.schema
        #: What makes watchers share a hub (see `hub.acquire`).
        self._hub_key = (reader.source, self._schema, self.mode, self.interval, self._options)
        #: Makes the hub's listener when this watcher starts a hub.
        self._connect = reader.listener
        self._state: WatchState | None = None
        self._hub: _hub.Hub | None = None
        #: The hub last joined, kept after close for `health`.
        self._seen_hub: _hub.Hub | None = None
        self._closed = False
        self._trouble = Trouble(self._clock, self.retry_window, "pglease watcher catch-up read")
        #: Monotonic time before which a failed catch-up read is not retried.
        self._retry_at = 0.0

    def _health(self, lag_events: int) -> WatchHealth:
        hub = self._seen_hub
        state = self._state
        troubles = [self._trouble] if hub is None else [self._trouble, hub.trouble]
        return make_health(
            troubles=troubles,
            failed=state.failed if state is not None else None,
            lag_events=lag_events + (len(state.pending) if state is not None else 0),
            reconnects=hub.reconnects if hub is not None else 0,
            last_read=hub.last_read if hub is not None else None,
            last_read_wall=hub.last_read_wall if hub is not None else None,
            clock=self._clock,
        )

    def _read_failed(self, state: WatchState, exc: LogReadError) -> float:
        """A catch-up read failed: the delay before retrying, or raise when it is time.

        The driver's own error (the cause) is what health and the consumer's
        `WatchFailedError` report, as the hub's do."""
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        error = self._trouble.record(cause, permanent=exc.permanent)
        if error is not None:
            state.failed = error
            raise error
        return self._trouble.delay()

    @property
    def cursor(self) -> str:
        """Where the watcher stands: pass it as `after=` to continue from here.

        It moves past every event read, including those the filters dropped.
        """
        if self._state is None:
            raise WatchClosedError("the watcher has not started yet")
        return self._state.cursor

    def _start_state(self, start: StartPoint | None) -> WatchState:
        """The state at the start position (`start` None: "start", nothing to ask).

        Resolved before joining the hub, so a cursor from another log is refused
        (`CursorAheadError`, `HistoryDivergedError`) before anything is read; an
        expired one fails on the first read, as before.
        """
        if start is None:
            assert self._start_cursor is not None
            position, check = self._start_cursor.position, self._start_cursor.check
        else:
            position, check = start.position, start.check
        return WatchState(position, self._from_start, self._filters, check)

    def _page_op(self, state: WatchState) -> PageOp:
        assert state.join is not None
        return PageOp(state.position, state.join, PAGE, self.stall_timeout)

    @staticmethod
    def _on_item(state: WatchState, item: Item, mailbox: SyncMailbox | AsyncMailbox) -> None:
        if item is OVERFLOW:
            state.rejoin(mailbox.rejoin())
        elif item is not None:
            state.on_message(item)  # type: ignore[arg-type]
