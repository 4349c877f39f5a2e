"""The per-process hub: one reader thread (and, in listen mode, one LISTEN connection)
per (dsn, schema, mode), shared by every watcher of the process, sync or asyncio.

The hub keeps a tip position and reads the log after it whenever it is woken
(a NOTIFY, a re-poll, the fallback timer), then hands each batch to every
subscriber. See the package docstring for why no event can be stranded.

Liveness: every round trip on the hub's connection (the connect included) is
bounded by `stall_timeout`, and the hub reads at least every
min(interval, stall_timeout), also while it waits for NOTIFYs in listen mode:
a path that stops forwarding bytes keeps its socket open, and a connection
that only waits would never learn that it hears nothing. Silence is then an
error like a lost connection (see below), named as such in `health`.

Errors: a lost connection or a failed read is logged and retried with backoff
from the tip; an error that cannot heal (privileges, a missing schema), or
any error that persists for `retry_window` seconds, is sent to every
subscriber as a `WatchFailedError` and the hub stops (a new watcher starts a
new hub). Everything that decides by elapsed time reads the hub's `Clock`;
its waits are real, so a test can drive the decisions with a `FakeClock`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _instrument
from .._watch_common import DEFAULT_STALL_TIMEOUT
from .._watch_common import DEFAULT_TUNING as DEFAULT_TUNING
from .._watch_common import HubTuning as HubTuning
from ..clock import SYSTEM_CLOCK, Clock
from ..cursors import Cursor, Position, encode_cursor, fingerprint
from ..driver.listen import ChangeListener
from ..driver.listen_ops import ListenRequest, LogReadError, PageOp
from ..errors import CursorExpiredError, ForeignCursorError, WatchError, WatchFailedError
from ._core import (
    DEFAULT_RETRY_WINDOW,
    END,
    PAGE,
    Batch,
    Failure,
    Message,
    Mode,
    Start,
    Trouble,
    describe_error,
    log,
)
from .mailbox import CHAIN

Deliver = Callable[[Message], None]
#: How many consumers a subscription wakes per batch (a loop fan-out: its members).
Consumers = Callable[[], int]
#: Makes the hub's listener (a log reader's `listener`): unopened, blocking.
Connect = Callable[[ListenRequest], ChangeListener]
#: A wait for a wake-up lasts at most this long, so that a stop is noticed promptly.
_WAIT_SLICE = 0.2


def _one() -> int:
    return 1


class Hub:
    """Reads the log once for all subscribers of this process."""

    def __init__(
        self,
        connect: Connect,
        source: str,
        schema: str,
        mode: Mode,
        interval: float,
        key: tuple[Any, ...],
        *,
        tuning: HubTuning = DEFAULT_TUNING,
        clock: Clock = SYSTEM_CLOCK,
        retry_window: float = DEFAULT_RETRY_WINDOW,
        pooler: bool = False,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        if pooler and mode == "listen":
            raise ValueError("a hub in pooler mode cannot LISTEN")  # the watcher says why
        #: The backend's address (a DSN) the listener connects to.
        self.source = source
        #: Pooler mode: the listener never LISTENs and prepares nothing.
        self.pooler = pooler
        self._connect = connect
        self.schema = schema
        self.mode = mode
        #: listen mode: fallback poll when no NOTIFY arrives; poll mode: poll period.
        self.interval = interval
        #: How long a round trip may go unanswered before it is an error; the
        #: hub also reads at least this often (a liveness round trip).
        self.stall_timeout = stall_timeout
        self.key = key
        self.tuning = tuning
        self.clock = clock
        self._lock = threading.Lock()
        self._subscribers: dict[int, Deliver] = {}
        self._consumers: dict[int, Consumers] = {}
        self._next_id = 0
        self._tip: Position | None = None
        #: Fingerprint of the last event read (None before the first): what the
        #: hub checks its position by after a reconnect.
        self._anchor: str | None = None
        self._stop = threading.Event()
        #: The open listener (None between connections).
        self._listener: ChangeListener | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"pglease-watch-{schema}", daemon=True
        )
        self._started = False
        self.trouble = Trouble(clock, retry_window, f"pglease watch stream of schema {schema!r}")
        #: The error every subscriber got when the hub gave up (it has stopped).
        self.failure: WatchError | None = None
        #: Clock readings (monotonic, wall) of the last successful read.
        self.last_read: float | None = None
        self.last_read_wall: float | None = None
        #: Counters for tests and benchmarks.
        self.reads = 0
        self.connects = 0
        self.unlistens = 0
        #: The latest smoothed event rate (events/s on the hub's clock).
        self.rate = 0.0
        #: Listen mode: LISTENing now (False while polling under load).
        self.listening = False

    @property
    def backend_pid(self) -> int | None:
        """The backend's id of the hub's connection now (None between connections)."""
        listener = self._listener
        return None if listener is None else listener.session_id()

    @property
    def reconnects(self) -> int:
        """Connections opened after the first one (each after losing one)."""
        return max(0, self.connects - 1)

    # ---------------------------------------------------------------- subscribers

    def subscribe(self, deliver: Deliver, consumers: Consumers = _one) -> int:
        """Add a subscriber; its first message is `Start(tip)`, then batches after tip.

        `consumers` says how many consumers one delivery wakes (for read spacing).
        """
        with self._lock:
            sub_id = self._next_id
            self._next_id += 1
            self._subscribers[sub_id] = deliver
            self._consumers[sub_id] = consumers
            if self.failure is not None:
                # Joined in the instant the hub gave up: tell this one too.
                deliver(Failure(self.failure))
            elif self._tip is not None:
                deliver(Start(self._tip))
            if not self._started:
                self._started = True
                self._thread.start()
        return sub_id

    def unsubscribe(self, sub_id: int) -> bool:
        """Remove a subscriber; return True when it was the last one (hub stops)."""
        with self._lock:
            self._subscribers.pop(sub_id, None)
            self._consumers.pop(sub_id, None)
            if self._subscribers:
                return False
            self._stop.set()
        return True

    def join(self, timeout: float | None = None) -> None:
        if self._started:
            self._thread.join(timeout)

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._session()
                    return
                except LogReadError as exc:
                    # Lost the server (restart, failover, network) or a read
                    # failed: reconnect and catch up from the tip, which
                    # survives reconnects; unless retrying cannot help or has
                    # not helped for the whole retry window. The driver's own
                    # error is what health and the consumers' error report.
                    self._close_conn()
                    cause = exc.__cause__ if exc.__cause__ is not None else exc
                    error = self.trouble.record(cause, permanent=exc.permanent)
                    if error is not None:
                        self._fail(error)
                        return
                    self._stop.wait(self.trouble.delay())
                except BaseException as exc:  # a bug: tell the watchers, never hang them
                    log.exception("pglease watch stream of schema %r stopped", self.schema)
                    error = WatchFailedError(
                        f"the watch stream stopped on an unexpected error: {describe_error(exc)}"
                    )
                    error.__cause__ = exc
                    self._fail(error)
                    return
        finally:
            self._close_conn()

    def _fail(self, error: WatchFailedError) -> None:
        """Give up: every subscriber gets `error`; no new watcher joins this hub."""
        with self._lock:
            self.failure = error
            self._stop.set()
            for deliver in self._subscribers.values():
                deliver(Failure(error))

    def _close_conn(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _open(self) -> ChangeListener:
        """Open a listener: in listen mode it LISTENs before any read, so nothing
        committed after it returns can slip by (`ChangeListener.open`)."""
        listener = self._connect(
            ListenRequest(
                self.source, self.schema, self.mode == "listen", self.pooler, self.stall_timeout
            )
        )
        listener.open()  # a failed open leaves nothing open
        self.connects += 1
        if self.connects > 1:
            _instrument.recorder.hub_reconnect(self.mode)
        # Set once counted: whoever sees the connection sees it counted.
        self._listener = listener
        return listener

    def _session(self) -> None:
        conn = self._open()
        listening = self.listening = self.mode == "listen"
        if self._tip is not None and self._verify_tip(conn):
            return
        if self._tip is None:
            frontier = conn.frontier()
            with self._lock:
                self._tip = frontier
                for deliver in self._subscribers.values():
                    deliver(Start(self._tip))
        repoll = self.tuning.min_repoll
        # Smoothed events per read and seconds between reads: their ratio is the
        # recent event rate (a ratio of averages, so that two reads an instant
        # apart do not read as a burst).
        per_read = 0.0
        between = 1.0
        tuning, clock = self.tuning, self.clock
        smoothing = tuning.rate_smoothing
        last = clock.monotonic()
        while not self._stop.is_set():
            # The rate is measured on the hub's clock; the spacing wait is
            # real time (a fake clock decides, it does not block).
            started = clock.monotonic()
            real_started = time.monotonic()
            progressed, held_back, count = self._read_all(conn)
            per_read += smoothing * (count - per_read)
            between += smoothing * (started - last - between)
            last = started
            rate = per_read / max(between, 1e-6)
            self.rate = rate
            if rate > tuning.light_rate:
                with self._lock:
                    consumers = sum(of() for of in self._consumers.values())
                spacing = min(
                    tuning.max_read_spacing,
                    max(tuning.read_spacing, consumers * tuning.spacing_per_consumer),
                )
                spacing *= min(1.0, rate / tuning.full_rate)
                self._stop.wait(max(0.0, real_started + spacing - time.monotonic()))
            if self.mode == "listen":
                # Under sustained load the spaced reads find every event anyway,
                # while each NOTIFY still interrupts our server process; stop
                # listening until the load drops, then LISTEN and read again
                # (the same order as at connect, so nothing can slip by).
                if listening and rate > tuning.unlisten_rate:
                    conn.set_listening(False)
                    listening = self.listening = False
                    self.unlistens += 1
                elif not listening and rate < tuning.light_rate:
                    conn.set_listening(True)
                    listening = self.listening = True
                    continue
            if held_back:
                repoll = tuning.min_repoll if progressed else min(repoll * 2, tuning.max_repoll)
                timeout = repoll
            else:
                repoll = tuning.min_repoll
                # Stopped listening under load: the spacing wait above already
                # paced this read, so poll again at once, until the load drops.
                paused = self.mode == "listen" and not listening
                # At least every stall_timeout: waiting for a NOTIFY sends
                # nothing, so only a read can find out that the path is silent.
                timeout = tuning.min_repoll if paused else min(self.interval, self.stall_timeout)
            self._wait(conn, timeout, listening)

    def _wait(self, conn: ChangeListener, timeout: float, listening: bool) -> None:
        """Sleep until a notification (when listening), the timeout, or stop."""
        if not listening:
            self._stop.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while not self._stop.is_set():
            # Short slices so that stop() is noticed promptly (a wake-up that
            # came with the last read returns at once).
            left = deadline - time.monotonic()
            if conn.wait(min(max(left, 0.0), _WAIT_SLICE)) or left <= 0:
                return

    def _read_all(self, conn: ChangeListener) -> tuple[bool, bool, int]:
        """Read every readable event after the tip; return (progressed, held_back, count)."""
        progressed = False
        count = 0
        while True:
            assert self._tip is not None
            page = conn.read_log(PageOp(self._tip, END, PAGE))
            self._read_done()
            _instrument.recorder.hub_read(self.mode, page.events)
            if self._tip < page.horizon:
                # Pruned past what we read (we were away longer than the
                # retention): every subscriber missed events.
                self._broadcast(
                    Failure(
                        CursorExpiredError(
                            "the watch stream fell behind the prune horizon; events were deleted"
                        )
                    )
                )
                self._tip = page.frontier
                return False, False, 0
            tip = self._tip
            if page.events:
                tip = page.positions[-1]
                last = page.events[-1]
                self._anchor = fingerprint(last.resource_id, last.revision, last.created_at)
            if not page.full and page.frontier > tip:
                tip = page.frontier
            if tip != self._tip or page.events:
                progressed = True
                with self._lock:
                    self._tip = tip
                    batch = Batch(page.events, page.positions, tip)
                    CHAIN.hold()
                    try:
                        for deliver in self._subscribers.values():
                            deliver(batch)
                    finally:
                        CHAIN.unhold()
            count += len(page.events)
            if not page.full:
                return progressed, page.held_back, count

    def _read_done(self) -> None:
        """Count a successful read and end a run of errors."""
        self.reads += 1
        clock = self.clock
        self.last_read = clock.monotonic()
        self.last_read_wall = clock.time()
        if self.trouble.failing_since is not None:
            self.trouble.healed()

    def _verify_tip(self, conn: ChangeListener) -> bool:
        """After a reconnect: is the tip still a position in this server's log?

        Across an asynchronous failover the new primary may have lost events
        the hub already delivered, and hand their transaction ids out again:
        reading on from the tip would skip or repeat events silently. Refused,
        every subscriber gets the `ForeignCursorError` and the hub stops
        (returns True); the consumers resync.
        """
        assert self._tip is not None
        cursor = Cursor(self._tip, self._anchor, encode_cursor(self._tip, self._anchor))
        try:
            conn.check_position(cursor)
        except ForeignCursorError as exc:
            log.error("pglease watch stream of schema %r: %s", self.schema, exc)
            with self._lock:
                self.failure = exc
                self._stop.set()
                for deliver in self._subscribers.values():
                    deliver(Failure(exc))
            return True
        return False

    def _broadcast(self, message: Message) -> None:
        with self._lock:
            for deliver in self._subscribers.values():
                deliver(message)


_hubs: dict[tuple[Any, ...], Hub] = {}
_hubs_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class HubOptions:
    """What besides (dsn, schema, mode, interval) makes watchers share a hub."""

    retry_window: float = DEFAULT_RETRY_WINDOW
    clock: Clock = SYSTEM_CLOCK
    tuning: HubTuning = DEFAULT_TUNING
    #: Behind a transaction pooler: no prepared statements on the hub's connection.
    pooler: bool = False
    #: Seconds a round trip on the hub's connection may go unanswered.
    stall_timeout: float = DEFAULT_STALL_TIMEOUT


DEFAULT_OPTIONS = HubOptions()


def acquire(
    connect: Connect,
    source: str,
    schema: str,
    mode: Mode,
    interval: float,
    deliver: Deliver,
    consumers: Consumers = _one,
    options: HubOptions = DEFAULT_OPTIONS,
) -> tuple[Hub, int]:
    """Subscribe to this process's hub for (source, schema, mode, interval, options),
    starting it if needed; `connect` makes its listener."""
    # The pid: a forked child must not join its parent's hub (no thread there).
    key = (os.getpid(), source, schema, mode, interval, options)
    with _hubs_lock:
        hub = _hubs.get(key)
        if hub is None or hub._stop.is_set():
            hub = Hub(
                connect, source, schema, mode, interval, key,
                tuning=options.tuning, clock=options.clock, retry_window=options.retry_window,
                pooler=options.pooler, stall_timeout=options.stall_timeout,
            )  # fmt: skip
            _hubs[key] = hub
        return hub, hub.subscribe(deliver, consumers)


def release(hub: Hub, sub_id: int) -> None:
    with _hubs_lock:
        if hub.unsubscribe(sub_id) and _hubs.get(hub.key) is hub:
            del _hubs[hub.key]
