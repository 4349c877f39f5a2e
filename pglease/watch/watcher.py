"""`Watcher` (blocking iterator) and `AsyncWatcher` (async iterator): the same
state machine (`_core.WatchState`) driven over a sync or an asyncio connection.

Errors of the watcher's own catch-up reads follow the hub's rule: retried
with backoff (and logged) while they may heal, raised as `WatchFailedError`
when they cannot or when they persisted for `retry_window` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, ClassVar, Protocol

import psycopg
from psycopg_pool import PoolClosed

from .. import cursor_check
from ..clock import SYSTEM_CLOCK, Clock
from ..cursors import Cursor, Position, parse_cursor
from ..errors import ValidationError, WatchClosedError
from ..types import Event
from ..validation import describe
from . import hub as _hub
from ._core import (
    DEFAULT_RETRY_WINDOW,
    PAGE,
    Batch,
    Failure,
    Filters,
    Message,
    Mode,
    Start,
    Trouble,
    WatchHealth,
    WatchQueries,
    WatchState,
    check_interval,
    check_mode,
    check_retry_window,
    make_health,
    parse_page,
    read_args,
)
from .mailbox import (
    DEFAULT_MAX_PENDING,
    OVERFLOW,
    AsyncMailbox,
    Item,
    SyncMailbox,
    check_max_pending,
)

#: Fallback poll in listen mode (a bound on latency if a wake-up is lost).
DEFAULT_FALLBACK_INTERVAL = 1.0
#: Poll period in poll mode.
DEFAULT_POLL_INTERVAL = 0.05
_SLICE = 0.25


class SyncStore(Protocol):
    dsn: str
    schema: str

    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...


class AsyncStore(Protocol):
    dsn: str
    schema: str

    def connection(self) -> AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]: ...


def _after(after: str | None) -> tuple[Cursor | None, bool]:
    """(cursor, from_start); cursor None means "now" (resolved by a query)."""
    if after is None or after == "now":
        return None, False
    if after == "start":
        return parse_cursor("start"), True
    if not isinstance(after, str):
        raise ValidationError(f"after must be a cursor, 'now' or 'start', got {describe(after)}")
    return parse_cursor(after), False


class _Base:
    def __init__(
        self,
        store: SyncStore | AsyncStore,
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
    ) -> None:
        pooler = bool(getattr(store, "pooler", False))
        self.mode: Mode = check_mode(("poll" if pooler else "listen") if mode is None else mode)
        if pooler and self.mode == "listen":
            # A transaction pooler hands the LISTEN's server connection to other
            # clients: notifications would go missing or reach nobody.
            raise ValidationError(
                "mode='listen' cannot work in pooler mode (a transaction pooler keeps no"
                " session for LISTEN): use mode='poll', the default there"
            )
        self.retry_window = check_retry_window(retry_window)
        self._clock: Clock = SYSTEM_CLOCK if clock is None else clock
        self._options = _hub.HubOptions(
            self.retry_window,
            self._clock,
            _hub.DEFAULT_TUNING if tuning is None else tuning,
            pooler,
        )
        self.max_pending = check_max_pending(max_pending)
        default = DEFAULT_FALLBACK_INTERVAL if self.mode == "listen" else DEFAULT_POLL_INTERVAL
        self.interval = check_interval(default if interval is None else interval, "interval")
        self._filters = Filters.build(types, resources, event_types)
        self._start_cursor, self._from_start = _after(after)
        self._queries = WatchQueries(store.schema)
        self._dsn = store.dsn
        self._schema = store.schema
        self._state: WatchState | None = None
        self._hub: _hub.Hub | None = None
        #: The hub last joined, kept after close for `health`.
        self._seen_hub: _hub.Hub | None = None
        self._sub = 0
        self._closed = False
        self._trouble = Trouble(self._clock, self.retry_window, "pglease watcher catch-up read")

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

    def _read_failed(self, state: WatchState, exc: psycopg.Error) -> float:
        """A catch-up read failed: the delay before retrying, or raise when it is time."""
        error = self._trouble.record(exc)
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

    def _subscribe(self, deliver: _hub.Deliver) -> None:
        self._hub, self._sub = _hub.acquire(
            self._dsn, self._schema, self.mode, self.interval, deliver, options=self._options
        )
        self._seen_hub = self._hub

    def _start_query(self) -> tuple[bytes, list[Any]] | None:
        """The query that resolves "now" or checks the cursor (None for "start")."""
        queries = cursor_check.pg_queries(self._schema)
        if self._start_cursor is None:
            return queries.now, []
        if self._from_start:
            return None
        return queries.check, cursor_check.pg_check_args(self._start_cursor)

    def _start_state(self, row: Any) -> WatchState:
        """The state at the start position, once `_start_query` answered `row`.

        Run before joining the hub, so a cursor from another log is refused
        (`CursorAheadError`, `HistoryDivergedError`) before anything is read; an
        expired one fails on the first read, as before.
        """
        if self._start_cursor is None:
            position, check = cursor_check.pg_now(row)
        else:
            if row is not None:
                cursor_check.pg_verify(self._start_cursor, row, refuse_expired=False)
            position, check = self._start_cursor.position, self._start_cursor.check
        return WatchState(position, self._from_start, self._filters, check)

    def _unsubscribe(self) -> None:
        if self._hub is not None:
            _hub.release(self._hub, self._sub)
            self._hub = None

    def _page_args(self, state: WatchState) -> list[Any]:
        assert state.join is not None
        return read_args(state.position, state.join, PAGE)

    @staticmethod
    def _on_item(state: WatchState, item: Item, mailbox: SyncMailbox | AsyncMailbox) -> None:
        if item is OVERFLOW:
            state.rejoin(mailbox.rejoin())
        elif item is not None:
            state.on_message(item)  # type: ignore[arg-type]


class Watcher(_Base):
    """Stream committed events, in log order, from `after` on.

    `after` is a cursor from a previous event (or `watcher.cursor`), ``"now"``
    (the default: only events committed from now on) or ``"start"`` (the
    oldest retained event). `types`, `resources` and `event_types` narrow what
    is yielded. `mode="poll"` never LISTENs (PgBouncer transaction pooling; the
    default, and the only mode, for a store in pooler mode); `interval` is then
    the poll period (50 ms default), in listen mode the fallback poll.

    Iterate it, or call `get(timeout)` / `get_batch(timeout)`. Raises
    `CursorExpiredError` when the cursor is older than the prune horizon, and
    `WatchFailedError` (its ``__cause__`` the database error) when reads fail
    with an error that cannot heal (privileges revoked, schema dropped) or
    keep failing for `retry_window` seconds (default 30); transient errors
    meanwhile are retried and logged on the ``pglease.watch`` logger.
    `health` tells the last error, reconnects and lag. `clock` and `tuning`
    are for tests (a `pglease.clock.FakeClock`, `hub.HubTuning` thresholds).
    A cursor that is not a position in this store's log is refused when the
    watcher is created, before it joins the stream: `CursorAheadError`,
    `HistoryDivergedError` (see `pglease.cursor_check`).

    The process hub never waits for a consumer: once `max_pending` events are
    queued for this watcher, it stops queueing and the watcher, when it gets
    there, reads the missed span from the log itself. Memory stays bounded and
    nothing is lost; a slow consumer just pays for its own reads.
    """

    def __init__(
        self,
        store: SyncStore,
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
    ) -> None:
        super().__init__(
            store, after, types, resources, event_types, mode, interval, max_pending,
            retry_window, clock, tuning,
        )  # fmt: skip
        self._store = store
        self._mailbox = SyncMailbox(self.max_pending)
        row = None
        if (start := self._start_query()) is not None:
            with store.connection() as conn:
                row = conn.execute(*start).fetchone()
        self._state = self._start_state(row)
        self._subscribe(self._mailbox.deliver)

    @property
    def overflows(self) -> int:
        """How often this watcher fell `max_pending` events behind the stream
        and read the missed span from the log instead (nothing is lost)."""
        return self._mailbox.overflows

    @property
    def health(self) -> WatchHealth:
        """The last error, since when reads fail, reconnects and lag (a snapshot)."""
        return self._health(self._mailbox.queued_events)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching; a blocked `get`/iteration returns. Safe from any thread."""
        if not self._closed:
            self._closed = True
            self._mailbox.close()
            self._unsubscribe()

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
        state = self._state
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
                try:
                    with self._store.connection() as conn:
                        rows = conn.execute(self._queries.read, self._page_args(state)).fetchall()
                except PoolClosed:
                    raise WatchClosedError("the store was closed") from None
                except psycopg.Error as exc:
                    # The server is away (restart), or worse: retry (the
                    # position is unchanged) or raise, as `_read_failed` says.
                    time.sleep(self._read_failed(state, exc))
                    continue
                if self._trouble.failing_since is not None:
                    self._trouble.healed()
                state.on_page(parse_page(rows, PAGE))
                continue
            try:
                item = self._mailbox.get(_SLICE if left is None else min(left, _SLICE))
            except queue.Empty:
                continue
            self._on_item(state, item, self._mailbox)

    def get_batch(self, timeout: float | None = None, max_events: int = 10_000) -> list[Event]:
        """Every event already at hand (at least one), or [] after `timeout`.

        For high-rate consumers: one call per hub batch instead of one per event.
        """
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ValidationError("max_events must be an int >= 1")
        state = self._state
        if state is not None and state.pending and not self._closed:
            return state.take(max_events)
        first = self.get(timeout)
        if first is None:
            return []
        assert self._state is not None
        return [first, *self._state.take(max_events - 1)]


class AsyncWatcher(_Base):
    """The asyncio twin of `Watcher`: ``async for event in AsyncWatcher(store)``.

    Shares the process hub with sync watchers (the hub reads in a thread and
    hands batches to the event loop). Close it with `aclose()` or use it as an
    async context manager.
    """

    def __init__(
        self,
        store: AsyncStore,
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
    ) -> None:
        super().__init__(
            store, after, types, resources, event_types, mode, interval, max_pending,
            retry_window, clock, tuning,
        )  # fmt: skip
        self._store = store
        self._mailbox: AsyncMailbox | None = None
        self._fanout: _LoopFanout | None = None
        self._member = 0

    @property
    def overflows(self) -> int:
        """How often this watcher fell `max_pending` events behind the stream
        and read the missed span from the log instead (nothing is lost)."""
        return self._mailbox.overflows if self._mailbox is not None else 0

    @property
    def health(self) -> WatchHealth:
        """The last error, since when reads fail, reconnects and lag (a snapshot)."""
        return self._health(self._mailbox.queued_events if self._mailbox is not None else 0)

    async def start(self) -> AsyncWatcher:
        """Resolve ``"now"`` and join the hub (done by the first `get` otherwise)."""
        if self._state is not None:
            return self
        if self._closed:
            raise WatchClosedError("the watcher is closed")
        row = None
        if (start := self._start_query()) is not None:
            async with self._store.connection() as conn:
                row = await (await conn.execute(*start)).fetchone()
        self._state = self._start_state(row)
        mailbox = self._mailbox = AsyncMailbox(self.max_pending)
        key = (self._dsn, self._schema, self.mode, self.interval, self._options)
        self._fanout = _LoopFanout.get(asyncio.get_running_loop(), key)
        self._member = self._fanout.join(mailbox)
        self._hub = self._seen_hub = self._fanout.hub
        return self

    async def __aenter__(self) -> AsyncWatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop watching; a pending `get` returns."""
        if not self._closed:
            self._closed = True
            if self._mailbox is not None:
                self._mailbox.close()
            if self._fanout is not None:
                self._fanout.leave(self._member)
                self._fanout = None
                self._hub = None

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        # Fast path: an event already at hand (most calls under load).
        state = self._state
        if state is not None and state.pending and not self._closed:
            event = state.pending.popleft()
            state.last = event
            return event
        try:
            got = await self.get()
        except WatchClosedError:
            raise StopAsyncIteration from None
        assert got is not None
        return got

    async def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after `timeout` seconds (None: wait forever)."""
        await self.start()
        state, mailbox = self._state, self._mailbox
        assert state is not None and mailbox is not None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._closed:
                raise WatchClosedError("the watcher is closed")
            event = state.next_event()
            if event is not None:
                return event
            if state.failed is not None:
                raise state.failed
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            if state.catching_up:
                try:
                    async with self._store.connection() as conn:
                        cur = await conn.execute(self._queries.read, self._page_args(state))
                        rows = await cur.fetchall()
                except PoolClosed:
                    raise WatchClosedError("the store was closed") from None
                except psycopg.Error as exc:
                    await asyncio.sleep(self._read_failed(state, exc))
                    continue
                if self._trouble.failing_since is not None:
                    self._trouble.healed()
                state.on_page(parse_page(rows, PAGE))
                continue
            try:
                item = await mailbox.get(left)
            except TimeoutError:
                return None
            self._on_item(state, item, mailbox)

    async def get_batch(
        self, timeout: float | None = None, max_events: int = 10_000
    ) -> list[Event]:
        """Every event already at hand (at least one), or [] after `timeout`."""
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ValidationError("max_events must be an int >= 1")
        state = self._state
        if state is not None and state.pending and not self._closed:
            return state.take(max_events)
        first = await self.get(timeout)
        if first is None:
            return []
        assert self._state is not None
        return [first, *self._state.take(max_events - 1)]


class _LoopFanout:
    """The async watchers of one event loop on one hub.

    One hub subscription per loop: the hub thread makes one cross-thread call
    per batch, and the loop hands the batch to every member queue, instead of
    one wake-up per watcher. Used only from the loop's own thread, so messages
    reach members in hub order and a member joining late starts at the last
    tip the loop processed.
    """

    _all: ClassVar[dict[tuple[Any, ...], _LoopFanout]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[Any, ...]) -> None:
        self.loop = loop
        self.key = key
        self.members: dict[int, AsyncMailbox] = {}
        self.tip: Position | None = None
        self.failure: Failure | None = None
        self._next = 0
        dsn, schema, mode, interval, options = key
        self.hub, self.sub = _hub.acquire(
            dsn, schema, mode, interval, self._deliver, self.members.__len__, options
        )

    @classmethod
    def get(cls, loop: asyncio.AbstractEventLoop, key: tuple[Any, ...]) -> _LoopFanout:
        fanout = cls._all.get((id(loop), *key))
        # A fan-out whose hub gave up gets nothing more: new watchers need a new hub.
        if fanout is None or fanout.loop is not loop or fanout.hub.failure is not None:
            fanout = cls._all[(id(loop), *key)] = cls(loop, key)
        return fanout

    def _deliver(self, message: Message) -> None:
        # Hub thread. RuntimeError: the loop is closed, nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Start | Batch):
            self.tip = message.tip
        elif isinstance(message, Failure):
            self.failure = message
        for mailbox in self.members.values():
            mailbox.deliver(message)

    def join(self, mailbox: AsyncMailbox) -> int:
        member = self._next
        self._next += 1
        self.members[member] = mailbox
        if self.failure is not None:
            mailbox.deliver(self.failure)
        elif self.tip is not None:
            mailbox.deliver(Start(self.tip))
        return member

    def leave(self, member: int) -> None:
        self.members.pop(member, None)
        if not self.members:
            _hub.release(self.hub, self.sub)
            if self._all.get((id(self.loop), *self.key)) is self:
                del self._all[(id(self.loop), *self.key)]


def watch(
    store: SyncStore,
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
) -> Watcher:
    """A `Watcher` on `store` (see there)."""
    return Watcher(
        store, after=after, types=types, resources=resources, event_types=event_types,
        mode=mode, interval=interval, max_pending=max_pending, retry_window=retry_window,
        clock=clock, tuning=tuning,
    )  # fmt: skip


def watch_async(
    store: AsyncStore,
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
) -> AsyncWatcher:
    """An `AsyncWatcher` on `store` (see there); iterate it with ``async for``."""
    return AsyncWatcher(
        store, after=after, types=types, resources=resources, event_types=event_types,
        mode=mode, interval=interval, max_pending=max_pending, retry_window=retry_window,
        clock=clock, tuning=tuning,
    )  # fmt: skip
