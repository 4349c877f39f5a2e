"""The runtime driver protocol (`pglease.driver`) on PostgreSQL, sync and asyncio.

The statements are the fleet functions of migration 0005 (`heartbeat`,
`claim_fair`, `leave_queue`) and the core `claim`/`release`, called exactly as
the runtime called them before it went through the protocol: one round trip
per attempt, psycopg's automatic preparation on a direct store, pooler mode's
transaction-local limits (`_core.pooler_local_limits`) behind PgBouncer.

Keeper lines: a keeper's heartbeats run on a dedicated connection, never a
pooled one, so application work that exhausts the pool cannot starve them.
The session is set up with plain ``SET`` statements after connecting, never
libpq startup ``options`` (PgBouncer refuses those), and is named
``pglease-keeper-<schema>`` in ``pg_stat_activity``. In pooler mode there is
no session setup and psycopg prepares nothing. `abort` shuts the socket down
(see `_abort`), so a statement stuck on a dead connection fails at once.

The same drivers implement log maintenance (`pglease.driver.maintenance`):
the reaper and prune, in `pglease.postgres.maintenance`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import psycopg

from ..driver import (
    AsyncMaintenanceDriver,
    AsyncRuntimeDriver,
    ClaimAttempt,
    ClaimRequest,
    HeartbeatItem,
    HeartbeatResult,
    LeaveQueue,
    MaintenanceDriver,
    PruneReport,
    PruneRequest,
    ReapReport,
    ReapRequest,
    RuntimeDriver,
)
from ..errors import DatabaseUnavailableError, LeaseLostError, LockTimeoutError, PgleaseError
from ..ids import token_hash
from ..types import Claim, Owner
from . import _core, _outcomes, maintenance
from ._sqltext import for_schema

log = logging.getLogger("pglease.runtime")

#: Server-side bound on one beat (the statement never waits for locks anyway).
STATEMENT_TIMEOUT_MS = 10_000
_CONNECT_FAILED = "pglease keeper: cannot connect to PostgreSQL for heartbeats"

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


class FleetQueries:
    """The fleet statements of one schema."""

    def __init__(self, schema: str) -> None:
        q = for_schema(schema)
        self.heartbeat = q(
            "SELECT resource_id, status, expires_at, current_generation FROM {s}.heartbeat("
            "%s::text[], %s::bigint[], %s::bytea[], %s::text[], %s::text[], %s::float8[])"
        )
        # clock_timestamp() after the call: the database time the answer was
        # judged at, so a waiter can turn `expires_at` into a local delay without
        # comparing its own wall clock with the server's.
        self.claim = q(
            "SELECT c.claimed, c.generation, c.expires_at, c.revision, c.holder_type,"
            " c.holder_id, 0, NULL::timestamptz, clock_timestamp()"
            " FROM {s}.claim(%s, %s, %s, %s, %s::float8, NULL::bigint, NULL::timestamptz) c"
        )
        self.claim_fair = q(
            "SELECT c.claimed, c.generation, c.expires_at, c.revision, c.holder_type,"
            " c.holder_id, c.position, c.head_expires_at, clock_timestamp()"
            " FROM {s}.claim_fair(%s, %s, %s, %s, %s::float8, %s, %s::float8) c"
        )
        self.leave_queue = q("SELECT {s}.leave_queue(%s)")
        self.queue_length = q(
            "SELECT count(*) FROM {s}.lease_waiters WHERE resource_id = %s"
            " AND expires_at > clock_timestamp()"
        )
        self.release = q(
            "SELECT * FROM {s}.release(%s, %s, %s, %s::bigint, %s, NULL::bigint, NULL::timestamptz)"
        )


def heartbeat_args(claims: Sequence[Claim], ttls: Sequence[float]) -> list[Any]:
    """Column arrays for `heartbeat`, sorted by resource id (one lock order everywhere)."""
    order = sorted(range(len(claims)), key=lambda i: claims[i].resource_id)
    return [
        [claims[i].resource_id for i in order],
        [claims[i].generation for i in order],
        [token_hash(claims[i].token) for i in order],
        [claims[i].owner.type for i in order],
        [claims[i].owner.id for i in order],
        [float(ttls[i]) for i in order],
    ]


def _batch_args(batch: Sequence[HeartbeatItem]) -> list[Any]:
    return heartbeat_args([item.claim for item in batch], [item.ttl for item in batch])


def _results(rows: Sequence[Sequence[Any]]) -> list[HeartbeatResult]:
    # Each row is (resource_id, status, expires_at, current_generation).
    return [HeartbeatResult(*row) for row in rows]


def _release_args(claim: Claim) -> list[Any]:
    return [
        claim.resource_id,
        claim.owner.type,
        claim.owner.id,
        claim.generation,
        token_hash(claim.token),
    ]


def _claim_query(q: FleetQueries, request: ClaimRequest) -> tuple[bytes, list[Any]]:
    base = [
        request.resource_id,
        request.owner.type,
        request.owner.id,
        token_hash(request.token),
        request.ttl,
    ]
    if request.waiter is not None:
        return q.claim_fair, [*base, request.waiter, request.waiter_ttl]
    return q.claim, base


def _attempt(row: Sequence[Any]) -> ClaimAttempt:
    claimed, generation, expires_at, revision, htype, hid, position, head_exp, db_now = row
    holder = Owner(htype, hid) if hid is not None and htype is not None else None
    judged: datetime = db_now
    return ClaimAttempt(
        bool(claimed), generation, expires_at, revision, holder, position or 0, head_exp, judged
    )


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
        # half-open proxy) is caught by the keeper's beat limit instead.
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


def _abort(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Make a statement blocked on `conn` fail now (from another thread, or a loop
    callback while the keeper task awaits it).

    Shuts the socket down through a duplicate descriptor: the blocked wait
    returns with end-of-file and psycopg raises OperationalError there, so the
    connection is dropped and replaced by the channel's next call. The
    descriptor itself is not closed here (it could be reused under the blocked
    thread's feet), and nothing here waits for the network.

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


def _limits(store: object) -> _core.Limits | None:
    """The store's time limits, to word its errors (None for a bare dsn/schema)."""
    limits = getattr(store, "limits", None)
    return limits if isinstance(limits, _core.Limits) else None


def _busy(exc: psycopg.Error) -> bool:
    """The claim waited out the store's lock_timeout on the lease row: nothing changed."""
    return isinstance(exc, psycopg.errors.LockNotAvailable)


def _attempt_error(
    exc: psycopg.Error, broken: bool, store: Any, request: ClaimRequest
) -> PgleaseError:
    """A claim attempt's driver error as a PgleaseError (`broken`: the connection died)."""
    if broken:
        unknown = _outcomes.claim_unknown(
            request.resource_id, request.owner, request.token, request.ttl, store.dsn
        )
        return unknown(exc)
    return _core.driver_error(exc, _limits(store), store.dsn)


def _raise(error: PgleaseError, exc: psycopg.Error) -> NoReturn:
    raise error from _core.cause_of(error, exc)


# --------------------------------------------------------------------------- sync


class PgHeartbeatChannel:
    """A keeper's dedicated connection (see the module docstring)."""

    def __init__(self, dsn: str, schema: str, pooler: bool, connect_timeout: float) -> None:
        self._dsn = dsn
        self._schema = schema
        self._pooler = pooler
        self._connect_timeout = connect_timeout
        self._q = FleetQueries(schema)
        self._conn: psycopg.Connection[Any] | None = None
        # Only the keeper's beater thread runs statements; `connect` runs in
        # the holder's thread and `abort` in the watchdog's.
        self._lock = threading.Lock()

    def connect(self) -> None:
        self._connection()

    def _connection(self) -> psycopg.Connection[Any]:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = None
                try:
                    conn = psycopg.connect(
                        self._dsn,
                        **_connect_kwargs(self._connect_timeout, self._schema, self._pooler),
                    )
                except psycopg.Error as exc:
                    _raise(_connect_error(exc, self._dsn), exc)
                try:
                    if not self._pooler:
                        conn.execute(SESSION_SETUP)
                except psycopg.Error as exc:
                    conn.close()
                    _raise(_connect_error(exc, self._dsn), exc)
                self._conn = conn
            return self._conn

    def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        conn = self._connection()
        try:
            rows = conn.execute(self._q.heartbeat, _batch_args(batch)).fetchall()
        except psycopg.Error as exc:
            self.close()
            _raise(_core.driver_error(exc, None, self._dsn), exc)
        return _results(rows)

    def release(self, claim: Claim) -> None:
        conn = self._connection()
        try:
            conn.execute(self._q.release, _release_args(claim)).fetchall()
        except psycopg.Error as exc:
            error = _core.driver_error(exc, None, self._dsn)
            if not isinstance(error, LeaseLostError):
                self.close()
            _raise(error, exc)

    def abort(self) -> None:
        conn = self._conn
        if conn is not None:
            _abort(conn)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class PgRuntime:
    """The runtime driver of a `PostgresStore` (or of anything with ``dsn`` and
    ``schema``, for a keeper alone)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._q = FleetQueries(store.schema)

    def attempt_claim(self, request: ClaimRequest) -> ClaimAttempt | None:
        store = self._store
        query, args = _claim_query(self._q, request)
        try:
            with store.connection() as conn:
                try:
                    if (bound := _core.pooler_local_limits(store)) is None:
                        row = conn.execute(query, args).fetchone()
                    else:
                        # BEGIN, the limits and the claim in one round trip, then COMMIT.
                        with conn.pipeline(), conn.transaction():
                            conn.execute(bound)
                            row = conn.execute(query, args).fetchone()
                except psycopg.Error as exc:
                    if _busy(exc):
                        log.debug("acquire %s: lease row locked, retrying", request.resource_id)
                        return None
                    _raise(_attempt_error(exc, conn.broken, store, request), exc)
        except psycopg.Error as exc:  # checking a connection out: nothing was sent
            _raise(_core.driver_error(exc, _limits(store), store.dsn), exc)
        except LockTimeoutError:  # a store that words 55P03 itself
            return None
        assert row is not None
        return _attempt(row)

    def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        """One heartbeat through the store's pool, for a lease its owner keeps alive
        itself (a session's writer lease): like the keeper's, it extends only the
        expiry, bumps no revision and writes no event."""
        store = self._store
        args = _batch_args(batch)
        try:
            with store.connection() as conn:
                if (bound := _core.pooler_local_limits(store)) is None:
                    rows = conn.execute(self._q.heartbeat, args).fetchall()
                else:
                    with conn.pipeline(), conn.transaction():
                        conn.execute(bound)
                        rows = conn.execute(self._q.heartbeat, args).fetchall()
        except psycopg.Error as exc:
            _raise(_core.driver_error(exc, _limits(store), store.dsn), exc)
        return _results(rows)

    def leave_queue(self, request: LeaveQueue) -> None:
        store = self._store
        try:
            with store.connection() as conn:
                conn.execute(self._q.leave_queue, [request.waiter])
        except psycopg.Error as exc:
            _raise(_core.driver_error(exc, _limits(store), store.dsn), exc)

    def heartbeat_channel(self, connect_timeout: float) -> PgHeartbeatChannel:
        store = self._store
        pooler = bool(getattr(store, "pooler", False))
        return PgHeartbeatChannel(store.dsn, store.schema, pooler, connect_timeout)

    def changes(self, resource_id: str, event_types: Sequence[str]) -> Any:
        # The store's watcher: LISTEN/NOTIFY wake-ups on the process's hub.
        return self._store.watch(after="now", resources=resource_id, event_types=event_types)

    def reap(self, request: ReapRequest) -> ReapReport:
        return maintenance.reap(self._store, request)

    def prune(self, request: PruneRequest) -> PruneReport:
        return maintenance.prune(self._store, request)


# --------------------------------------------------------------------------- asyncio


class AsyncPgHeartbeatChannel:
    """The asyncio twin of `PgHeartbeatChannel`."""

    def __init__(self, dsn: str, schema: str, pooler: bool, connect_timeout: float) -> None:
        self._dsn = dsn
        self._schema = schema
        self._pooler = pooler
        self._connect_timeout = connect_timeout
        self._q = FleetQueries(schema)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # `connect` (the holder's task) and the keeper task must not both open one.
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        await self._connection()

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        async with self._lock:
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
                    _raise(_connect_error(exc, self._dsn), exc)
                except TimeoutError as exc:
                    raise DatabaseUnavailableError(
                        f"{_CONNECT_FAILED}: no answer within {self._connect_timeout:g} s"
                    ) from exc
                try:
                    if not self._pooler:
                        await conn.execute(SESSION_SETUP)
                except psycopg.Error as exc:
                    await conn.close()
                    _raise(_connect_error(exc, self._dsn), exc)
                self._conn = conn
            return self._conn

    async def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        conn = await self._connection()
        try:
            cur = await conn.execute(self._q.heartbeat, _batch_args(batch))
            rows = await cur.fetchall()
        except psycopg.Error as exc:
            await self.close()
            _raise(_core.driver_error(exc, None, self._dsn), exc)
        return _results(rows)

    async def release(self, claim: Claim) -> None:
        conn = await self._connection()
        try:
            await (await conn.execute(self._q.release, _release_args(claim))).fetchall()
        except psycopg.Error as exc:
            error = _core.driver_error(exc, None, self._dsn)
            if not isinstance(error, LeaseLostError):
                await self.close()
            _raise(error, exc)

    def abort(self) -> None:
        conn = self._conn
        if conn is not None:
            _abort(conn)

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 1.0)


class AsyncPgRuntime:
    """The runtime driver of an `AsyncPostgresStore`."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._q = FleetQueries(store.schema)

    async def attempt_claim(self, request: ClaimRequest) -> ClaimAttempt | None:
        store = self._store
        query, args = _claim_query(self._q, request)
        try:
            async with store.connection() as conn:
                try:
                    if (bound := _core.pooler_local_limits(store)) is None:
                        row = await (await conn.execute(query, args)).fetchone()
                    else:
                        async with conn.pipeline(), conn.transaction():
                            await conn.execute(bound)
                            row = await (await conn.execute(query, args)).fetchone()
                except psycopg.Error as exc:
                    if _busy(exc):
                        log.debug("acquire %s: lease row locked, retrying", request.resource_id)
                        return None
                    _raise(_attempt_error(exc, conn.broken, store, request), exc)
        except psycopg.Error as exc:
            _raise(_core.driver_error(exc, _limits(store), store.dsn), exc)
        except LockTimeoutError:
            return None
        assert row is not None
        return _attempt(row)

    async def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        """Asyncio twin of `PgRuntime.heartbeat`."""
        store = self._store
        args = _batch_args(batch)
        try:
            async with store.connection() as conn:
                if (bound := _core.pooler_local_limits(store)) is None:
                    rows = await (await conn.execute(self._q.heartbeat, args)).fetchall()
                else:
                    async with conn.pipeline(), conn.transaction():
                        await conn.execute(bound)
                        rows = await (await conn.execute(self._q.heartbeat, args)).fetchall()
        except psycopg.Error as exc:
            _raise(_core.driver_error(exc, _limits(store), store.dsn), exc)
        return _results(rows)

    async def leave_queue(self, request: LeaveQueue) -> None:
        store = self._store
        try:
            async with store.connection() as conn:
                await conn.execute(self._q.leave_queue, [request.waiter])
        except psycopg.Error as exc:
            _raise(_core.driver_error(exc, _limits(store), store.dsn), exc)

    def heartbeat_channel(self, connect_timeout: float) -> AsyncPgHeartbeatChannel:
        store = self._store
        pooler = bool(getattr(store, "pooler", False))
        return AsyncPgHeartbeatChannel(store.dsn, store.schema, pooler, connect_timeout)

    async def changes(self, resource_id: str, event_types: Sequence[str]) -> Any:
        watcher = self._store.watch(after="now", resources=resource_id, event_types=event_types)
        return await watcher.start()

    async def reap(self, request: ReapRequest) -> ReapReport:
        return await maintenance.reap_async(self._store, request)

    async def prune(self, request: PruneRequest) -> PruneReport:
        return await maintenance.prune_async(self._store, request)


if TYPE_CHECKING:
    # mypy checks here that both drivers implement the protocol.
    def _sync_driver(driver: PgRuntime) -> RuntimeDriver:
        return driver

    def _async_driver(driver: AsyncPgRuntime) -> AsyncRuntimeDriver:
        return driver

    def _sync_maintenance(driver: PgRuntime) -> MaintenanceDriver:
        return driver

    def _async_maintenance(driver: AsyncPgRuntime) -> AsyncMaintenanceDriver:
        return driver
