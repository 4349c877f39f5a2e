# Generated from pglease/watch/_watcher_async.py by tools/async_to_sync.py: do not edit.
"""`AsyncWatcher`, written once: the source of the blocking `Watcher`.

This module is the hand-written asyncio source; `_watcher.py` is generated
from it by `tools/async_to_sync.py` (``AsyncWatcher`` -> ``Watcher``,
``aclose`` -> ``close``, ``await`` dropped, and the few marked lines).
Both drive the same state machine (`_core.WatchState`) over the same hub; they
differ in how they start (the blocking watcher in its constructor, the asyncio
one in `start()`), in how a mailbox joins the hub (`_fanout`), and in how
they wait.

Errors of the watcher's own catch-up reads follow the hub's rule: retried
with backoff (and logged) while they may heal, raised as `WatchFailedError`
when they cannot or when they persisted for `retry_window` seconds.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable, Iterator

from ..clock import Clock
from ..driver.listen_ops import LogReadError
from ..errors import WatchClosedError
from ..types import Event
from . import hub as _hub
from ._core import DEFAULT_RETRY_WINDOW, DEFAULT_STALL_TIMEOUT, WatchHealth
from ._fanout import Subscription, subscribe
from ._watcher_base import WatchedStore, WatcherBase, check_max_events
from .mailbox import DEFAULT_MAX_PENDING, Mailbox

#: A blocked `get` wakes this often (a bound, so that no wait is unbounded).
_SLICE = 0.25


class Watcher(WatcherBase):
    """Stream committed events, in log order, from `after` on.

    `Watcher` blocks (``for event in watcher``, `get`, `get_batch`);
    `AsyncWatcher` is its asyncio twin (``async for``, ``await watcher.get()``),
    with the same arguments and semantics. A `Watcher` starts in its
    constructor; an `AsyncWatcher` in `start()`, ``async with`` or its first
    `get`. Both share the process hub, whose thread hands batches to the
    blocking watchers' mailboxes and to one fan-out per event loop.

    `after` is a cursor from a previous event (or `watcher.cursor`), ``"now"``
    (the default: only events committed from now on) or ``"start"`` (the
    oldest retained event). `types`, `resources` and `event_types` narrow what
    is yielded. `mode="poll"` never LISTENs (PgBouncer transaction pooling; the
    default, and the only mode, for a store in pooler mode); `interval` is then
    the poll period (50 ms default), in listen mode the fallback poll.

    Raises `CursorExpiredError` when the cursor is older than the prune
    horizon, and `WatchFailedError` (its ``__cause__`` the database error)
    when reads fail with an error that cannot heal (privileges revoked, schema
    dropped) or keep failing for `retry_window` seconds (default 30);
    transient errors meanwhile are retried and logged on the ``pglease.watch``
    logger. `stall_timeout` (default 5 s, in (0, 3600]) bounds each round trip
    to the server: the stream reads at least that often, also while it waits
    for NOTIFYs, and a read, connect or catch-up read that gets no answer for
    that long fails as a lost connection (a stalled path that keeps its
    socket open, a hung server): `health` then turns unhealthy, its
    `last_error` saying "no answer from the server", the connection is
    replaced, and the stream catches up from where it was once the server
    answers again; a silence that lasts `retry_window` is `WatchFailedError`.
    `health` tells the last error, reconnects and lag. `clock` and
    `tuning` are for tests (a `pglease.clock.FakeClock`, `hub.HubTuning`
    thresholds). A cursor that is not a position in this store's log is
    refused when the watcher starts, before it joins the stream:
    `CursorAheadError`, `HistoryDivergedError` (see `pglease.cursor_check`).

    The process hub never waits for a consumer: once `max_pending` events are
    queued for this watcher, it stops queueing and the watcher, when it gets
    there, reads the missed span from the log itself. Memory stays bounded and
    nothing is lost; a slow consumer just pays for its own reads.
    """

    def __init__(
        self,
        store: WatchedStore,
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
        tuning: _hub.HubTuning | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        super().__init__(
            store, after, types, resources, event_types, mode, interval, max_pending,
            retry_window, clock, tuning, stall_timeout,
        )  # fmt: skip
        self._reader = store.log_reader()
        self._mailbox = Mailbox(self.max_pending)
        self._subscription: Subscription | None = None
        # A blocking watcher starts at once: "now" means when it was made.
        self.start()

    @property
    def overflows(self) -> int:
        """How often this watcher fell `max_pending` events behind the stream
        and read the missed span from the log instead (nothing is lost)."""
        return self._mailbox.overflows

    @property
    def health(self) -> WatchHealth:
        """The last error, since when reads fail, reconnects and lag (a snapshot)."""
        return self._health(self._mailbox.queued_events)

    def start(self) -> Watcher:
        """Resolve ``"now"`` (or check the cursor) and join the hub; once only."""
        if self._state is not None:
            return self
        if self._closed:
            raise WatchClosedError("the watcher is closed")
        # "start" asks nothing; "now" and a cursor ask the log. Nothing to retry
        # yet: the caller learns at once (closed store, server away, privileges).
        start = (
            None if self._from_start else self._reader.start(self._start_cursor, self.stall_timeout)
        )
        self._state = self._start_state(start)
        subscription = self._subscription = subscribe(self._hub_key, self._mailbox, self._connect)
        self._hub = self._seen_hub = subscription.hub
        return self

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching; a waiting `get` or iteration returns (a blocking
        watcher may be closed from any thread)."""
        if not self._closed:
            self._closed = True
            self._mailbox.close()
            if self._subscription is not None:
                self._subscription.leave()
                self._subscription = None
                self._hub = None

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        # Fast path: an event already at hand (most calls under load).
        state = self._state
        if state is not None and state.pending and not self._closed:
            event = state.pending.popleft()
            state.last = event
            return event
        try:
            got = self.get()
        except WatchClosedError:
            raise StopIteration from None
        assert got is not None
        return got

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after `timeout` seconds (None: wait forever)."""
        if self._state is None:
            self.start()
        state, mailbox = self._state, self._mailbox
        assert state is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise WatchClosedError("the watcher is closed")
            event = state.next_event()
            if event is not None:
                return event
            if state.failed is not None:
                raise state.failed
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if state.catching_up:
                # A failed read's retry delay is kept across calls, so that it
                # never makes this call outlive its timeout.
                pause = self._retry_at - time.monotonic()
                if pause > 0:
                    pause = pause if left is None else min(pause, left)
                    time.sleep(pause)
                    continue
                try:
                    page = self._reader.read_log(self._page_op(state))
                except LogReadError as exc:
                    # The server is away (restart), or worse: retry (the
                    # position is unchanged) or raise, as `_read_failed` says.
                    self._retry_at = time.monotonic() + self._read_failed(state, exc)
                    continue
                if self._trouble.failing_since is not None:
                    self._trouble.healed()
                state.on_page(page)
                continue
            try:
                left = _SLICE if left is None else min(left, _SLICE)
                item = mailbox.get(left)
            except queue.Empty:
                continue
            self._on_item(state, item, mailbox)

    def get_batch(self, timeout: float | None = None, max_events: int = 10_000) -> list[Event]:
        """Every event already at hand (at least one), or [] after `timeout`.

        For high-rate consumers: one call per hub batch instead of one per event.
        """
        check_max_events(max_events)
        state = self._state
        if state is not None and state.pending and not self._closed:
            return state.take(max_events)
        first = self.get(timeout)
        if first is None:
            return []
        assert self._state is not None
        return [first, *self._state.take(max_events - 1)]


def watch(
    store: WatchedStore,
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
    tuning: _hub.HubTuning | None = None,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
) -> Watcher:
    """A watcher on `store` (see `AsyncWatcher`)."""
    return Watcher(
        store, after=after, types=types, resources=resources, event_types=event_types,
        mode=mode, interval=interval, max_pending=max_pending, retry_window=retry_window,
        clock=clock, tuning=tuning, stall_timeout=stall_timeout,
    )  # fmt: skip
