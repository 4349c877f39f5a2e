"""Keepers: one per host (per store), renewing every lease it holds in one round
trip per beat, from a dedicated thread (`Keeper`) or asyncio task (`AsyncKeeper`).

A beat calls the `heartbeat` SQL function (migration 0005) with all due leases
at once. A heartbeat extends `expires_at` only: no revision bump, no event, so
holders' cached revisions stay valid (see sql/0005_fleet.sql). Each keeper uses
its own connection, never a pooled one: application work that exhausts the
pool cannot starve the heartbeat.

Loss is signalled three ways, the moment it is known: the lease's `lost` event,
its `on_lost` callbacks, and `check()` raising `LeaseLostError`. It is known
when a beat reports the lease gone (generation or token changed, released,
expired: immediate, no retry), or when the local trust window closes without a
successful renewal. The sync keeper's watchdog thread does no I/O, so a beat
stuck on a dead connection cannot delay that; the async twin arms one loop
timer per lease, and `check()` consults the clock itself in any case.

Dead connections: a beat may take at most half the time left until its first
trust window closes (`KeeperCore.beat_limit`); then its socket is shut down
(by the watchdog thread, or a loop timer in the async twin), the statement
fails, and the beat is retried on a new connection, in time to keep the lease.
That covers a peer that acknowledges bytes but never answers (a frozen server,
a half-open proxy), which neither `statement_timeout` (server side) nor TCP
keepalives notice; keepalives and ``tcp_user_timeout`` are set as well, so a
dead TCP peer is noticed between beats too.

Connection: a keeper opens its connection when a lease is about to be held
(`connect`, which `hold`, `hold_async`, elections and `pglease hold` call
before claiming), so a host that cannot get one fails at once with a
`PgleaseError` instead of claiming a lease it cannot renew. The session is
set up with plain ``SET`` statements after connecting, never libpq startup
``options`` (PgBouncer refuses those), and is named ``pglease-keeper-<schema>``
in ``pg_stat_activity``. In pooler mode (the store's ``pooler=True``) there
is no session setup at all and psycopg prepares nothing: the beat limit's
client-side cut-off is the only bound on a statement. Afterwards a broken
connection is replaced at the next beat; its errors never reach the holder, only
the loss they may cause.

Clock: due times, lateness, trust windows and the beat limit's size read the
keeper's `pglease.clock.Clock` (``clock=``, the system clock by default).
Waits stay real: under any other clock (a test's `FakeClock`) the threads (the
task) wake at least every `FAKE_CLOCK_TICK` to re-read it, so advancing a fake
clock takes effect within that, and the cut-off of a stuck statement stays a
real-time bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import psycopg

from .. import _instrument
from ..clock import SYSTEM_CLOCK, Clock
from ..errors import DatabaseUnavailableError, LeaseLostError, PgleaseError
from ..ids import token_hash
from ..postgres import _core
from ..types import Claim
from ._keeper_core import TRUST_CLOSED, KeeperCore, KeeperStats
from ._sql import FleetQueries
from ._timing import Timing, real_wait
from .lease import AsyncHeldLease, HeldLease

log = logging.getLogger("pglease.fleet")

#: Server-side bound on one beat (the statement never waits for locks anyway).
STATEMENT_TIMEOUT_MS = 10_000
#: A best-effort release on the keeper's connection is abandoned after this.
RELEASE_LIMIT = 5.0


class StoreInfo(Protocol):
    """What a keeper needs from a store: where the database is."""

    dsn: str
    schema: str


def _release_sql(schema: str) -> bytes:
    from psycopg import sql

    return (
        sql.SQL(
            "SELECT * FROM {s}.release(%s, %s, %s, %s::bigint, %s, NULL::bigint, NULL::timestamptz)"
        )
        .format(s=sql.Identifier(schema))
        .as_string(None)
        .encode()
    )


def _release_args(claim: Claim) -> list[Any]:
    return [
        claim.resource_id,
        claim.owner.type,
        claim.owner.id,
        claim.generation,
        token_hash(claim.token),
    ]


#: Run once on every new keeper connection. Plain SETs, not libpq startup
#: `options`: PgBouncer refuses startup parameters it does not know.
#:
#: plan_cache_mode: psycopg prepares a statement after five runs, and a
#: generic plan cannot see the heartbeat arrays' lengths. A keeper beats a few
#: leases at a time and then, once due times coalesce, thousands: measured on
#: the 2-core box, a 10,000-lease beat after seven 1-lease beats took
#: 4.4-11.6 s with the generic plan (past statement_timeout) and 260-330 ms
#: with a custom one. Planning costs well under 1 ms.
SESSION_SETUP = (
    f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}; SET plan_cache_mode = force_custom_plan"
).encode()
_CONNECT_FAILED = "pglease keeper: cannot connect to PostgreSQL for heartbeats"


def application_name(schema: str) -> str:
    """How a keeper's backend is named in pg_stat_activity (63 bytes at most)."""
    return f"pglease-keeper-{schema}"[:63]


def _connect_kwargs(connect_timeout: float, schema: str, pooler: bool = False) -> dict[str, Any]:
    """The keeper connection's options. In pooler mode psycopg prepares nothing
    (`prepare_threshold=None`); unnamed statements are planned for their own
    arguments, so plan_cache_mode needs no SET either."""
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(1, math.ceil(connect_timeout)),
        "application_name": application_name(schema),
        # TCP only (libpq ignores them on a Unix socket): notice a dead peer
        # while idle between beats (keepalives) and while a request stays
        # unacknowledged (tcp_user_timeout), instead of the kernel's ~15 min.
        # A peer that acknowledges but never answers (a frozen server, a
        # half-open proxy) is caught by the beat limit instead (see `_abort`).
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": STATEMENT_TIMEOUT_MS,
    }
    if pooler:
        kwargs["prepare_threshold"] = None
    return kwargs


def _connect_error(exc: psycopg.Error, dsn: str) -> PgleaseError:
    """A failed connect or session setup, as the holder sees it."""
    if isinstance(exc, psycopg.OperationalError):
        # Refused, unreachable, auth, "too many connections" (53300): no connection.
        return _core.unavailable(exc, _CONNECT_FAILED, dsn)
    return _core.driver_error(exc, None, dsn)


@dataclass
class _InFlight:
    """A statement running on the sync keeper's connection, and when to give up on it."""

    conn: psycopg.Connection[Any]
    #: Real `time.monotonic()` instant: a bound on a real wait, whatever the clock.
    until: float
    aborted: bool = False


def _abort(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Make a statement blocked on `conn` fail now (from another thread, or a loop
    callback while the keeper task awaits it).

    Shuts the socket down through a duplicate descriptor: the blocked wait
    returns with end-of-file and psycopg raises OperationalError there, so the
    connection is dropped and replaced by the keeper's own code. The descriptor
    itself is not closed here (it could be reused under the blocked thread's
    feet), and nothing here waits for the network.

    Not task cancellation: psycopg answers a cancelled query by sending a cancel
    request and waiting (up to 5 s, twice) for the server to confirm, which on
    a dead connection outlasts the trust window.
    """
    with contextlib.suppress(OSError, psycopg.Error):
        dup = socket.socket(fileno=os.dup(conn.pgconn.socket))
        try:
            dup.shutdown(socket.SHUT_RDWR)
        finally:
            dup.close()


class Keeper:
    """Renews every lease added to it, in one round trip per beat, on its own thread.

    Normally you do not create one: `hold` uses `Keeper.for_store(store)`, one
    per store object (that is, per host process) and clock. Close it to stop
    renewing (held leases then run out; they are not released). `clock`
    decides due times and trust windows (see the module docstring).
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[Any, dict[Clock, Keeper]]] = (
        weakref.WeakKeyDictionary()
    )
    _shared_lock = threading.Lock()

    def __init__(
        self, store: StoreInfo, *, connect_timeout: float = 5.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._dsn = store.dsn
        self._schema = store.schema
        #: Pooler mode: no session SETs and no prepared statements; a beat's
        #: time is bounded by the client-side cut-off (`beat_limit`) alone.
        self._pooler = bool(getattr(store, "pooler", False))
        self._q = FleetQueries(store.schema)
        self._release_q = _release_sql(store.schema)
        self._connect_timeout = connect_timeout
        self.clock = clock
        self._core: KeeperCore[HeldLease] = KeeperCore(clock)
        self._cond = threading.Condition()
        self._closed = False
        # Guards opening and dropping `_conn`: `connect` runs in the holder's
        # thread, everything else on the beater thread.
        self._conn_lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._inflight: _InFlight | None = None
        self._beater = threading.Thread(target=self._run, name="pglease-keeper", daemon=True)
        self._watchdog = threading.Thread(
            target=self._watch, name="pglease-keeper-watchdog", daemon=True
        )
        self._beater.start()
        self._watchdog.start()

    @classmethod
    def for_store(cls, store: StoreInfo, clock: Clock = SYSTEM_CLOCK) -> Keeper:
        """The shared keeper of `store` on `clock` (created on first use)."""
        with cls._shared_lock:
            per_clock = cls._shared.setdefault(store, {})
            keeper = per_clock.get(clock)
            if keeper is None or keeper._closed:
                keeper = per_clock[clock] = cls(store, clock=clock)
            return keeper

    @property
    def stats(self) -> KeeperStats:
        return self._core.stats

    def __len__(self) -> int:
        with self._cond:
            return len(self._core.leases)

    def __enter__(self) -> Keeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop both threads and close the connection (leases are not released)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        _instrument.untrack_keeper(self._core.tracked)
        for thread in (self._beater, self._watchdog):
            if thread is not threading.current_thread():
                thread.join(timeout=15)
        self._drop_connection()

    def connect(self) -> None:
        """Open the keeper's connection now unless it has a live one.

        `hold` calls this before claiming: a host that cannot get a connection
        (server down, no free connection slot, bad credentials) fails at once
        with `DatabaseUnavailableError` (a `PgleaseError`) instead of holding a
        lease it cannot renew. No round trip when a connection is open.
        """
        if self._closed:
            raise PgleaseError("the keeper is closed")
        self._connection()

    def add(self, claim: Claim, timing: Timing, requested_at: float) -> HeldLease:
        """Keep `claim` alive; `requested_at` is the instant (on the keeper's clock)
        its claim request started. No I/O: call `connect` first to learn early
        that the keeper cannot reach the database."""
        lease = HeldLease(claim, timing, requested_at, self.clock)
        with self._cond:
            if self._closed:
                raise PgleaseError("the keeper is closed")
            old = self._core.add(lease)
            self._cond.notify_all()
        if old is not None:
            old._lose(
                "a newer generation of the same resource was claimed on this host",
                cause="superseded",
            )
        return lease

    def remove(self, lease: HeldLease) -> None:
        """Stop renewing `lease` (before releasing it)."""
        with self._cond:
            self._core.remove(lease)

    # --- threads -------------------------------------------------------------------

    def _watch(self) -> None:
        """Close trust windows on time, and cut off a statement stuck on a dead
        connection; no database I/O here, so nothing can block it."""
        clock = self.clock
        while True:
            with self._cond:
                if self._closed:
                    return
                lost = self._core.sweep(clock.monotonic())
                inflight = self._inflight
                real_now = time.monotonic()
                if inflight is not None and not inflight.aborted and inflight.until <= real_now:
                    inflight.aborted = True
                    self._core.stats.aborted += 1
                    log.warning(
                        "keeper statement outlasted its limit (dead connection?); reconnecting"
                    )
                    _abort(inflight.conn)
                deadline = self._core.next_deadline()
                wait = real_wait(clock, None if deadline is None else deadline - clock.monotonic())
                if inflight is not None and not inflight.aborted:
                    cut_off = max(0.0, inflight.until - time.monotonic())
                    wait = cut_off if wait is None else min(wait, cut_off)
                if lost:
                    self._cond.notify_all()  # the beater releases them
                else:
                    self._cond.wait(wait)
            for lease in lost:
                lease._lose(TRUST_CLOSED, cause="trust_window")

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self.clock.monotonic()
                # Lost leases are never renewed again. Whichever thread sweeps a
                # lease first must signal its loss: the watchdog will not see it.
                lost = self._core.sweep(now)
                to_release, self._core.to_release = self._core.to_release, []
                batch = self._core.due_batch(now)
                if not batch and not to_release:
                    due = self._core.next_due()
                    self._cond.wait(real_wait(self.clock, None if due is None else due - now))
                    continue
            for lease in lost:
                lease._lose(TRUST_CLOSED, cause="trust_window")
            for lease in to_release:
                self._release_quietly(lease.claim)
            if batch:
                self._beat(batch)

    def _connection(self) -> psycopg.Connection[Any]:
        """The live connection, opened if needed (PgleaseError if it cannot be)."""
        with self._conn_lock:
            if self._conn is None or self._conn.closed:
                self._conn = None
                try:
                    conn = psycopg.connect(
                        self._dsn,
                        **_connect_kwargs(self._connect_timeout, self._schema, self._pooler),
                    )
                except psycopg.Error as exc:
                    raise _connect_error(exc, self._dsn) from exc
                try:
                    if not self._pooler:
                        conn.execute(SESSION_SETUP)
                except psycopg.Error as exc:
                    conn.close()
                    raise _connect_error(exc, self._dsn) from exc
                self._conn = conn
            return self._conn

    def _drop_connection(self) -> None:
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _execute(self, query: bytes, args: list[Any], limit: float) -> list[Any]:
        """Run one statement on the keeper's connection; the watchdog aborts it
        after `limit` seconds (psycopg's blocking calls have no client timeout)."""
        conn = self._connection()
        with self._cond:
            self._inflight = _InFlight(conn, time.monotonic() + limit)
            self._cond.notify_all()  # the watchdog re-arms for the limit
        try:
            return conn.execute(query, args).fetchall()
        finally:
            with self._cond:
                self._inflight = None

    def _beat(self, batch: list[HeldLease]) -> None:
        started = self.clock.monotonic()
        real_start = time.monotonic()
        try:
            rows = self._execute(
                self._q.heartbeat, self._core.args(batch), self._core.beat_limit(batch, started)
            )
        except (psycopg.Error, PgleaseError, OSError) as exc:
            self._drop_connection()
            with self._cond:
                self._core.on_error(batch, exc)
            return
        with self._cond:
            gone = self._core.on_rows(batch, rows, started, time.monotonic() - real_start)
        for lease, reason, cause in gone:
            lease._lose(reason, cause=cause)

    def _release_quietly(self, claim: Claim) -> None:
        """Best effort: a lease lost by the local clock may still be current in the database."""
        try:
            self._execute(self._release_q, _release_args(claim), RELEASE_LIMIT)
        except psycopg.Error as exc:
            if exc.diag.sqlstate not in ("PGL03", "PGL04"):
                self._drop_connection()
        except (PgleaseError, OSError):
            self._drop_connection()


class AsyncKeeper:
    """The asyncio twin of `Keeper`: one task per event loop and store.

    Use `AsyncKeeper.for_store(store)` (inside a running loop) or create one
    and `await keeper.aclose()` when done.
    """

    _shared: ClassVar[
        weakref.WeakKeyDictionary[Any, dict[tuple[asyncio.AbstractEventLoop, Clock], AsyncKeeper]]
    ] = weakref.WeakKeyDictionary()

    def __init__(
        self, store: StoreInfo, *, connect_timeout: float = 5.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._dsn = store.dsn
        self._schema = store.schema
        #: Pooler mode: no session SETs and no prepared statements; a beat's
        #: time is bounded by the client-side cut-off (`beat_limit`) alone.
        self._pooler = bool(getattr(store, "pooler", False))
        self._q = FleetQueries(store.schema)
        self._release_q = _release_sql(store.schema)
        self._connect_timeout = connect_timeout
        self.clock = clock
        self._core: KeeperCore[AsyncHeldLease] = KeeperCore(clock)
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._closed = False
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # `connect` (the holder's task) and the keeper task must not both open one.
        self._conn_lock = asyncio.Lock()
        self._task = self._loop.create_task(self._run(), name="pglease-keeper")

    @classmethod
    def for_store(cls, store: StoreInfo, clock: Clock = SYSTEM_CLOCK) -> AsyncKeeper:
        """The shared keeper of `store` on the running loop and `clock` (created on first use)."""
        loop = asyncio.get_running_loop()
        per_loop = cls._shared.setdefault(store, {})
        keeper = per_loop.get((loop, clock))
        if keeper is None or keeper._closed or keeper._task.done():
            keeper = per_loop[(loop, clock)] = cls(store, clock=clock)
        return keeper

    @property
    def stats(self) -> KeeperStats:
        return self._core.stats

    def __len__(self) -> int:
        return len(self._core.leases)

    async def __aenter__(self) -> AsyncKeeper:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the task and close the connection (leases are not released)."""
        self._closed = True
        _instrument.untrack_keeper(self._core.tracked)
        self._changed.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None

    async def connect(self) -> None:
        """Open the keeper's connection now unless it has a live one; see `Keeper.connect`."""
        if self._closed:
            raise PgleaseError("the keeper is closed")
        await self._connection()

    def add(self, claim: Claim, timing: Timing, requested_at: float) -> AsyncHeldLease:
        """Keep `claim` alive; `requested_at` is the instant (on the keeper's clock)
        its claim request started. No I/O (see `connect`)."""
        if self._closed:
            raise PgleaseError("the keeper is closed")
        lease = AsyncHeldLease(claim, timing, requested_at, self._loop, self.clock)
        old = self._core.add(lease)
        # The timer closes the trust window; wake the task so it drops the lease.
        lease.on_lost(lambda _e: self._changed.set())
        self._changed.set()
        if old is not None:
            old._lose(
                "a newer generation of the same resource was claimed on this host",
                cause="superseded",
            )
        return lease

    def remove(self, lease: AsyncHeldLease) -> None:
        """Stop renewing `lease` (before releasing it)."""
        self._core.remove(lease)

    async def _run(self) -> None:
        clock = self.clock
        while not self._closed:
            now = clock.monotonic()
            for lease in self._core.sweep(now):  # signal it whoever noticed first
                lease._lose(TRUST_CLOSED, cause="trust_window")
            to_release, self._core.to_release = self._core.to_release, []
            for lease in to_release:
                await self._release_quietly(lease.claim)
            batch = self._core.due_batch(now)
            if batch:
                await self._beat(batch)
                continue
            due = self._core.next_due()
            self._changed.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
            # cancellation that races with the event being set.
            wait = real_wait(clock, None if due is None else due - clock.monotonic())
            try:
                async with asyncio.timeout(wait):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        """The live connection, opened if needed (PgleaseError if it cannot be)."""
        async with self._conn_lock:
            if self._conn is None or self._conn.closed:
                self._conn = None
                try:
                    # A client-side bound too: psycopg's connect_timeout is per attempt.
                    async with asyncio.timeout(self._connect_timeout + 1):
                        conn = await psycopg.AsyncConnection.connect(
                            self._dsn,
                            **_connect_kwargs(self._connect_timeout, self._schema, self._pooler),
                        )
                except psycopg.Error as exc:
                    raise _connect_error(exc, self._dsn) from exc
                except TimeoutError as exc:
                    raise DatabaseUnavailableError(
                        f"{_CONNECT_FAILED}: no answer within {self._connect_timeout:g} s"
                    ) from exc
                try:
                    if not self._pooler:
                        await conn.execute(SESSION_SETUP)
                except psycopg.Error as exc:
                    await conn.close()
                    raise _connect_error(exc, self._dsn) from exc
                self._conn = conn
            return self._conn

    async def _execute(
        self, conn: psycopg.AsyncConnection[Any], query: bytes, args: list[Any], limit: float
    ) -> list[Any]:
        """Run one statement; after `limit` seconds its socket is shut down (see `_abort`)."""

        def stuck() -> None:
            self._core.stats.aborted += 1
            log.warning("keeper statement outlasted its limit (dead connection?); reconnecting")
            _abort(conn)

        timer = self._loop.call_later(limit, stuck)
        try:
            cur = await conn.execute(query, args)
            return await cur.fetchall()
        finally:
            timer.cancel()

    async def _drop_connection(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 1.0)

    async def _beat(self, batch: list[AsyncHeldLease]) -> None:
        started = self.clock.monotonic()
        real_start = time.monotonic()
        # A client-side bound too: a beat hung on a dead connection is abandoned
        # and retried on a new one before the trust windows close.
        limit = self._core.beat_limit(batch, started)
        try:
            async with asyncio.timeout(limit + self._connect_timeout):
                conn = await self._connection()
            rows = await self._execute(conn, self._q.heartbeat, self._core.args(batch), limit)
        except (psycopg.Error, PgleaseError, OSError, TimeoutError) as exc:
            await self._drop_connection()
            self._core.on_error(batch, exc)
            return
        round_trip = time.monotonic() - real_start
        for lease, reason, cause in self._core.on_rows(batch, rows, started, round_trip):
            lease._lose(reason, cause=cause)

    async def _release_quietly(self, claim: Claim) -> None:
        try:
            async with asyncio.timeout(RELEASE_LIMIT + self._connect_timeout):
                conn = await self._connection()
            await self._execute(conn, self._release_q, _release_args(claim), RELEASE_LIMIT)
        except psycopg.Error as exc:
            if exc.diag.sqlstate not in ("PGL03", "PGL04"):
                await self._drop_connection()
        except (PgleaseError, OSError, TimeoutError):
            await self._drop_connection()


__all__ = ["AsyncKeeper", "Keeper", "LeaseLostError", "StoreInfo"]
