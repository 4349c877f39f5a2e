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

from ..errors import LeaseLostError, PgleaseError
from ..ids import token_hash
from ..types import Claim
from ._keeper_core import TRUST_CLOSED, KeeperCore, KeeperStats
from ._sql import FleetQueries
from ._timing import Timing
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


def _connect_kwargs(connect_timeout: float) -> dict[str, Any]:
    return {
        "autocommit": True,
        "connect_timeout": max(1, math.ceil(connect_timeout)),
        # plan_cache_mode: psycopg prepares a statement after five runs, and a
        # generic plan cannot see the heartbeat arrays' lengths. A keeper beats
        # a few leases at a time and then, once due times coalesce, thousands:
        # measured on the 2-core box, a 10,000-lease beat after seven 1-lease
        # beats took 4.4-11.6 s with the generic plan (past statement_timeout)
        # and 260-330 ms with a custom one. Planning costs well under 1 ms.
        "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"
        " -c plan_cache_mode=force_custom_plan",
        "application_name": "pglease-keeper",
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


@dataclass
class _InFlight:
    """A statement running on the sync keeper's connection, and when to give up on it."""

    conn: psycopg.Connection[Any]
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
    per store object (that is, per host process). Close it to stop renewing
    (held leases then run out; they are not released).
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[Any, Keeper]] = weakref.WeakKeyDictionary()
    _shared_lock = threading.Lock()

    def __init__(self, store: StoreInfo, *, connect_timeout: float = 5.0) -> None:
        self._dsn = store.dsn
        self._q = FleetQueries(store.schema)
        self._release_q = _release_sql(store.schema)
        self._connect_timeout = connect_timeout
        self._core: KeeperCore[HeldLease] = KeeperCore()
        self._cond = threading.Condition()
        self._closed = False
        self._conn: psycopg.Connection[Any] | None = None
        self._inflight: _InFlight | None = None
        self._beater = threading.Thread(target=self._run, name="pglease-keeper", daemon=True)
        self._watchdog = threading.Thread(
            target=self._watch, name="pglease-keeper-watchdog", daemon=True
        )
        self._beater.start()
        self._watchdog.start()

    @classmethod
    def for_store(cls, store: StoreInfo) -> Keeper:
        """The shared keeper of `store` (created on first use)."""
        with cls._shared_lock:
            keeper = cls._shared.get(store)
            if keeper is None or keeper._closed:
                keeper = cls(store)
                cls._shared[store] = keeper
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
        for thread in (self._beater, self._watchdog):
            if thread is not threading.current_thread():
                thread.join(timeout=15)
        with contextlib.suppress(Exception):
            if self._conn is not None:
                self._conn.close()

    def add(self, claim: Claim, timing: Timing, requested_at: float) -> HeldLease:
        """Keep `claim` alive; `requested_at` is the monotonic time its claim request started."""
        lease = HeldLease(claim, timing, requested_at)
        with self._cond:
            if self._closed:
                raise PgleaseError("the keeper is closed")
            old = self._core.add(lease)
            self._cond.notify_all()
        if old is not None:
            old._lose("a newer generation of the same resource was claimed on this host")
        return lease

    def remove(self, lease: HeldLease) -> None:
        """Stop renewing `lease` (before releasing it)."""
        with self._cond:
            self._core.remove(lease)

    # --- threads -------------------------------------------------------------------

    def _watch(self) -> None:
        """Close trust windows on time, and cut off a statement stuck on a dead
        connection; no database I/O here, so nothing can block it."""
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                lost = self._core.sweep(now)
                inflight = self._inflight
                if inflight is not None and not inflight.aborted and inflight.until <= now:
                    inflight.aborted = True
                    self._core.stats.aborted += 1
                    log.warning(
                        "keeper statement outlasted its limit (dead connection?); reconnecting"
                    )
                    _abort(inflight.conn)
                deadline = self._core.next_deadline()
                if inflight is not None and not inflight.aborted:
                    deadline = inflight.until if deadline is None else min(deadline, inflight.until)
                if lost:
                    self._cond.notify_all()  # the beater releases them
                else:
                    self._cond.wait(
                        None if deadline is None else max(0.0, deadline - time.monotonic())
                    )
            for lease in lost:
                lease._lose(TRUST_CLOSED)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                # Lost leases are never renewed again. Whichever thread sweeps a
                # lease first must signal its loss: the watchdog will not see it.
                lost = self._core.sweep(now)
                to_release, self._core.to_release = self._core.to_release, []
                batch = self._core.due_batch(now)
                if not batch and not to_release:
                    due = self._core.next_due()
                    self._cond.wait(None if due is None else max(0.0, due - now))
                    continue
            for lease in lost:
                lease._lose(TRUST_CLOSED)
            for lease in to_release:
                self._release_quietly(lease.claim)
            if batch:
                self._beat(batch)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._dsn, **_connect_kwargs(self._connect_timeout))
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

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
        started = time.monotonic()
        try:
            rows = self._execute(
                self._q.heartbeat, self._core.args(batch), self._core.beat_limit(batch, started)
            )
        except (psycopg.Error, OSError) as exc:
            self._drop_connection()
            with self._cond:
                self._core.on_error(batch, exc)
            return
        with self._cond:
            gone = self._core.on_rows(batch, rows, started)
        for lease, reason in gone:
            lease._lose(reason)

    def _release_quietly(self, claim: Claim) -> None:
        """Best effort: a lease lost by the local clock may still be current in the database."""
        try:
            self._execute(self._release_q, _release_args(claim), RELEASE_LIMIT)
        except psycopg.Error as exc:
            if exc.diag.sqlstate not in ("PGL03", "PGL04"):
                self._drop_connection()
        except OSError:
            self._drop_connection()


class AsyncKeeper:
    """The asyncio twin of `Keeper`: one task per event loop and store.

    Use `AsyncKeeper.for_store(store)` (inside a running loop) or create one
    and `await keeper.aclose()` when done.
    """

    _shared: ClassVar[
        weakref.WeakKeyDictionary[Any, dict[asyncio.AbstractEventLoop, AsyncKeeper]]
    ] = weakref.WeakKeyDictionary()

    def __init__(self, store: StoreInfo, *, connect_timeout: float = 5.0) -> None:
        self._dsn = store.dsn
        self._q = FleetQueries(store.schema)
        self._release_q = _release_sql(store.schema)
        self._connect_timeout = connect_timeout
        self._core: KeeperCore[AsyncHeldLease] = KeeperCore()
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._closed = False
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task = self._loop.create_task(self._run(), name="pglease-keeper")

    @classmethod
    def for_store(cls, store: StoreInfo) -> AsyncKeeper:
        """The shared keeper of `store` on the running loop (created on first use)."""
        loop = asyncio.get_running_loop()
        per_loop = cls._shared.setdefault(store, {})
        keeper = per_loop.get(loop)
        if keeper is None or keeper._closed or keeper._task.done():
            keeper = cls(store)
            per_loop[loop] = keeper
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
        self._changed.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None

    def add(self, claim: Claim, timing: Timing, requested_at: float) -> AsyncHeldLease:
        """Keep `claim` alive; `requested_at` is the monotonic time its claim request started."""
        if self._closed:
            raise PgleaseError("the keeper is closed")
        lease = AsyncHeldLease(claim, timing, requested_at, self._loop)
        old = self._core.add(lease)
        # The timer closes the trust window; wake the task so it drops the lease.
        lease.on_lost(lambda _e: self._changed.set())
        self._changed.set()
        if old is not None:
            old._lose("a newer generation of the same resource was claimed on this host")
        return lease

    def remove(self, lease: AsyncHeldLease) -> None:
        """Stop renewing `lease` (before releasing it)."""
        self._core.remove(lease)

    async def _run(self) -> None:
        while not self._closed:
            now = time.monotonic()
            for lease in self._core.sweep(now):  # signal it whoever noticed first
                lease._lose(TRUST_CLOSED)
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
            try:
                async with asyncio.timeout(
                    None if due is None else max(0.0, due - time.monotonic())
                ):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self._dsn, **_connect_kwargs(self._connect_timeout)
            )
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
        started = time.monotonic()
        # A client-side bound too: a beat hung on a dead connection is abandoned
        # and retried on a new one before the trust windows close.
        limit = self._core.beat_limit(batch, started)
        try:
            async with asyncio.timeout(limit + self._connect_timeout):
                conn = await self._connection()
            rows = await self._execute(conn, self._q.heartbeat, self._core.args(batch), limit)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            await self._drop_connection()
            self._core.on_error(batch, exc)
            return
        for lease, reason in self._core.on_rows(batch, rows, started):
            lease._lose(reason)

    async def _release_quietly(self, claim: Claim) -> None:
        try:
            async with asyncio.timeout(RELEASE_LIMIT + self._connect_timeout):
                conn = await self._connection()
            await self._execute(conn, self._release_q, _release_args(claim), RELEASE_LIMIT)
        except psycopg.Error as exc:
            if exc.diag.sqlstate not in ("PGL03", "PGL04"):
                await self._drop_connection()
        except (OSError, TimeoutError):
            await self._drop_connection()


__all__ = ["AsyncKeeper", "Keeper", "LeaseLostError", "StoreInfo"]
