"""The lease store on PostgreSQL, written once: `AsyncPostgresStore` (asyncio).

This file is the hand-written source; `pglease/postgres/store.py`, the blocking
`PostgresStore` with the same names and semantics, is generated from it by
`tools/async_to_sync.py`. The flavours differ in how they open: the blocking
store connects in its constructor, the asyncio one in ``await
AsyncPostgresStore.open(dsn)`` or ``async with AsyncPostgresStore(dsn)``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool

from .. import _instrument, cursor_check
from ..dsn import resolve_dsn
from ..errors import PgleaseError, StoreClosedError, UnknownResourceError
from ..migrations import migrate_async, migration_state_async
from ..types import Claim, Event, MutationResult, Owner, Permit, ResourceState
from ..validation import (
    check_positive_seconds,
    check_resource_id,
    check_resource_type,
    check_schema_name,
)
from . import _core
from ._core import DEFAULT_SCHEMA, Queries
from ._fastpath import CLAIM, RELEASE, RENEW, AsyncFastPath, NotSentError, from_micros
from ._reuse_async import AsyncConnectionStack, discard

if TYPE_CHECKING:
    from ..clock import Clock
    from ..fleet import AsyncElection, AsyncHeldLease, Leader
    from ..watch import AsyncWatcher
    from ..watch.hub import HubTuning

T = TypeVar("T")
AsyncApply = Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]
#: Using an asyncio store before it is opened, or after it is closed (a blocking
#: store is open from its constructor on, and reports PoolClosed once closed).
_NOT_OPEN = "the store is not open (use `await AsyncPostgresStore.open()`)"


class AsyncPostgresStore:
    """Leases, revisions and the event log in one PostgreSQL schema.

    `PostgresStore` opens in its constructor; `AsyncPostgresStore` with
    ``await AsyncPostgresStore.open(dsn)`` or ``async with AsyncPostgresStore(dsn)``.
    Connections come from a psycopg-pool in autocommit mode and are reused
    LIFO; claim, renew and release are one prepared-statement round trip each.
    Close the store (or use it as a context manager) to close the pool.

    Every wait is bounded: `statement_timeout` and `lock_timeout` (seconds, or
    None to leave the server's setting) are set on each connection, and
    `pool_timeout` bounds the wait for a free connection. No driver error
    escapes the lease API: see README "Errors".

    `pooler=True` (or ``PGLEASE_POOLER=transaction``) is for a transaction-pooling
    pooler such as PgBouncer: no prepared statements, no session SETs (the limits
    become SET LOCAL in `mutate`), watchers poll. README "Deployment: PgBouncer".
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = DEFAULT_SCHEMA,
        min_size: int = 1,
        max_size: int = 16,
        auto_migrate: bool = True,
        connect_timeout: float = 10.0,
        statement_timeout: float | None = 30.0,
        lock_timeout: float | None = 10.0,
        pool_timeout: float = 30.0,
        pooler: bool = False,
    ) -> None:
        self.schema = check_schema_name(schema)
        #: Pooler mode (``pooler=True`` or ``PGLEASE_POOLER=transaction``): safe
        #: behind a transaction-pooling pooler; README "Deployment: PgBouncer".
        self.pooler = _core.pooler_mode(pooler)
        connect_timeout = check_positive_seconds(connect_timeout, "connect_timeout")
        self._limits = _core.Limits.of(statement_timeout, lock_timeout, pool_timeout, max_size)
        self._dsn = dsn
        self._q = Queries(schema)
        #: Pooler mode: the limits as SET LOCAL, run first in each mutate transaction.
        self._local_limits = self._limits.local_settings if self.pooler else None
        #: Pooler mode: the same as one statement, pipelined ahead of each read.
        self._local_config = self._limits.local_config if self.pooler else None
        # Pooler mode sets nothing per session: the limits go per transaction
        # (mutate), and the fast path sends unnamed statements.
        self._fast = AsyncFastPath(
            schema,
            None if self.pooler else self._limits.settings,
            self._limits,
            pooler=self.pooler,
        )
        self._min_size = min_size
        self._max_size = max_size
        self._auto_migrate = auto_migrate
        self._connect_timeout = connect_timeout
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._conns: AsyncConnectionStack | None = None
        # sync: self._open()

    @property
    def limits(self) -> _core.Limits:
        """The store's statement, lock and pool time limits (as its errors name them)."""
        return self._limits

    # async-only: begin
    @classmethod
    async def open(cls, dsn: str | None = None, **kwargs: Any) -> AsyncPostgresStore:
        """An open store: the constructor's arguments, then `_open`."""
        store = cls(dsn, **kwargs)
        await store._open()
        return store

    # async-only: end
    async def _open(self) -> None:
        """Connect once, migrate (or check), then open the pool and the LIFO stack."""
        if self._pool is not None:
            return
        # Starting the embedded server blocks for about a second: keep a loop free.
        dsn = await asyncio.to_thread(resolve_dsn, self._dsn)  # sync: dsn = resolve_dsn(self._dsn)
        self.dsn = dsn
        kwargs = _core.connect_kwargs(self.schema, self.pooler)
        # One direct connection first: a bad DSN or a down server fails fast with
        # one clear error instead of a pool retrying in the background. Migrations
        # run without the time limits: they wait for each other on purpose.
        try:
            conn = await psycopg.AsyncConnection.connect(
                dsn, connect_timeout=math.ceil(self._connect_timeout), **kwargs
            )
        except psycopg.OperationalError as exc:
            raise _core.unavailable(exc, dsn=dsn) from exc
        try:
            async with conn:
                if self._auto_migrate:
                    await migrate_async(conn, self.schema)
                else:
                    _core.require_migrated(await migration_state_async(conn, self.schema))
        except psycopg.Error as exc:
            raise self._error(exc) from exc
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            kwargs=kwargs,
            configure=self._configure,
            timeout=self._limits.pool_timeout,
            open=False,
            name=f"pglease-{self.schema}",
        )
        try:
            with _core.PoolConnectErrors(pool.name) as connect_errors:
                await pool.open(wait=True, timeout=self._connect_timeout)
        except BaseException as exc:
            await pool.close()  # stop its workers; the caller gets the error
            if isinstance(exc, psycopg.Error):
                raise _core.pool_unavailable(exc, connect_errors.last, dsn) from exc
            raise
        self._pool = pool
        self._conns = AsyncConnectionStack(pool)

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The pool calls this on connect: the time limits, then the fast path's
        prepared statements (neither in pooler mode, where session state would
        land on a random server)."""
        await self._set_limits(conn)
        await self._fast.prepare_on_connect_async(conn)

    async def _set_limits(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Set the time limits for the session (not in pooler mode)."""
        if not self.pooler and (settings := self._limits.settings) is not None:
            await conn.execute(settings)

    def _error(self, exc: psycopg.Error) -> PgleaseError:
        return _core.driver_error(exc, self._limits, self.dsn)

    @property
    def _stack(self) -> AsyncConnectionStack:
        if self._conns is None:
            raise StoreClosedError(_NOT_OPEN)
        return self._conns

    async def _take(self, conns: AsyncConnectionStack) -> psycopg.AsyncConnection[Any]:
        """A live connection; the pool's errors as PgleaseErrors (nothing was sent)."""
        try:
            return await conns.take()
        except psycopg.Error as exc:
            raise self._error(exc) from exc

    async def _read(
        self, fn: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], bounded: bool = True
    ) -> T:
        """Run a read (or an idempotent write) once more on a fresh connection when
        the connection breaks under it: running it twice is harmless.

        In pooler mode `fn` runs in a transaction that starts with the limits as
        SET LOCAL (pipelined with it: BEGIN, the SETs and the first statement
        go in one round trip), since no session SET bounds it there."""
        conns = self._stack
        for attempt in (1, 2):
            conn = await self._take(conns)
            try:
                if bounded and self._local_config is not None:
                    async with conn.pipeline(), conn.transaction():
                        await conn.execute(self._local_config)
                        return await fn(conn)
                return await fn(conn)
            except psycopg.Error as exc:
                broken = conn.broken
                if broken and attempt == 1:
                    continue
                if broken:
                    raise _core.lost(exc, self.dsn) from exc
                error = self._error(exc)
                raise error from _core.cause_of(error, exc)
            finally:
                await conns.give_back(conn)
        raise AssertionError("unreachable")

    async def _write(
        self, name: bytes, args: list[Any], unknown: Callable[[psycopg.Error], PgleaseError]
    ) -> list[bytes]:
        """One fast-path write. Retried once only when it certainly never ran; a
        connection lost after it was sent raises `unknown(exc)` (outcome unknown)."""
        conns = self._stack
        for attempt in (1, 2):
            conn = await self._take(conns)
            try:
                return await self._fast.call_async(conn, name, args)
            except NotSentError as exc:
                if conn.broken and attempt == 1:
                    continue
                error = self._error(exc.cause)
                raise error from _core.cause_of(error, exc.cause)
            except psycopg.Error as exc:
                if conn.broken:
                    raise unknown(exc) from exc
                error = self._error(exc)
                raise error from _core.cause_of(error, exc)
            finally:
                await conns.give_back(conn)
        raise AssertionError("unreachable")

    async def __aenter__(self) -> AsyncPostgresStore:
        await self._open()  # sync: -
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the pool, with the connections kept for reuse; closing twice is harmless."""
        if self._pool is not None and self._conns is not None:
            pool, conns, self._pool = self._pool, self._conns, None
            # A blocking store keeps its stack: a call after close then gets the
            # pool's PoolClosed, which the lease API reports as StoreClosedError.
            self._conns = None  # sync: -
            await conns.drain()
            await pool.close()

    # async-only: begin
    @property
    def pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        """The store's psycopg-pool (StoreClosedError when the store is not open)."""
        if self._pool is None:
            raise StoreClosedError(_NOT_OPEN)
        return self._pool

    # async-only: end

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """Borrow a live autocommit connection from the store's pool.

        This is the driver's own connection: errors of the SQL run on it, and of
        checking it out (psycopg_pool's PoolTimeout, PoolClosed), are psycopg's.
        """
        async with self._stack.borrow() as conn:
            yield conn

    async def _row(self, query: bytes, args: list[Any]) -> Any:
        """The first row of one read statement, or None (see `_read`)."""

        async def read(conn: psycopg.AsyncConnection[Any]) -> Any:
            cursor = await conn.execute(query, args)
            return await cursor.fetchone()

        return await self._read(read)

    async def _rows(self, query: bytes, args: list[Any]) -> list[Any]:
        """Every row of one read statement (see `_read`)."""

        async def read(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            cursor = await conn.execute(query, args)
            return await cursor.fetchall()

        return await self._read(read)

    async def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""

        async def run(conn: psycopg.AsyncConnection[Any]) -> list[str]:
            if self.pooler:  # no session limits were set; none to lift or restore
                return [m.label for m in await migrate_async(conn, self.schema)]
            # Migrators queue on each other's lock and may run long: no limits.
            await conn.execute(b"SET statement_timeout = 0; SET lock_timeout = 0")
            try:
                return [m.label for m in await migrate_async(conn, self.schema)]
            finally:
                if conn.info.transaction_status == pq.TransactionStatus.IDLE:
                    await conn.execute(b"RESET statement_timeout; RESET lock_timeout")
                    await self._set_limits(conn)
                else:
                    discard(conn)  # never reuse it without its limits

        return await self._read(run, bounded=False)  # idempotent; migrators wait on purpose

    async def ensure_resource(self, resource_type: str, key: str) -> str:
        """Create the resource if needed and return its deterministic id (no event)."""
        row = await self._row(self._q.ensure, list(_core.ensure_args(resource_type, key)))
        assert row is not None  # the statement always returns the id
        return str(row[0])

    async def claim(
        self,
        resource_id: str,
        owner: Owner,
        ttl: float,
        expected_revision: int | None = None,
        *,
        now: datetime | None = None,
    ) -> Claim | None:
        """Take the lease, or return None while another holder's lease is unexpired."""
        token, args = _core.claim_args(resource_id, owner, ttl, expected_revision, now)
        unknown = _core.claim_unknown(resource_id, owner, token, ttl, self.dsn)
        try:
            claimed, generation, expires_at, revision = await self._write(CLAIM, args, unknown)
        except PgleaseError as exc:
            _instrument.recorder.claim(_instrument.claim_error(exc))
            raise
        if claimed != b"t":
            _instrument.recorder.claim("held")
            return None
        _instrument.recorder.claim("claimed")
        return Claim(
            resource_id, owner, token, int(generation), from_micros(expires_at), int(revision)
        )

    async def renew(
        self,
        claim: Claim,
        ttl: float,
        expected_revision: int | None = None,
        *,
        now: datetime | None = None,
    ) -> Claim:
        """Extend a current, unexpired lease; return the updated claim."""
        args = _core.renew_args(claim, ttl, expected_revision, now)
        unknown = _core.renew_unknown(claim, self.dsn)
        try:
            expires_at, revision = await self._write(RENEW, args, unknown)
        except PgleaseError as exc:
            _instrument.recorder.renewal("store", _instrument.lease_error(exc))
            raise
        _instrument.recorder.renewal("store", "renewed")
        return replace(claim, expires_at=from_micros(expires_at), revision=int(revision))

    async def release(
        self, claim: Claim, expected_revision: int | None = None, *, now: datetime | None = None
    ) -> int:
        """Give up a current lease (expired or not); return the new revision."""
        args = _core.release_args(claim, expected_revision, now)
        try:
            (revision,) = await self._write(RELEASE, args, _core.release_unknown(claim, self.dsn))
        except PgleaseError as exc:
            _instrument.recorder.release(_instrument.lease_error(exc))
            raise
        _instrument.recorder.release("released")
        return int(revision)

    async def mutate(
        self,
        permit: Permit,
        event_type: str,
        apply: AsyncApply[T] | None = None,
        payload: Any = None,
        *,
        actor: Owner | None = None,
        now: datetime | None = None,
    ) -> MutationResult:
        """Check the permit, run `apply(conn)` and append the event, all in one transaction.

        Any exception (a stale permit, a lost lease, or one raised by `apply`)
        rolls everything back: no revision bump, no event, no payload. What
        `apply` raises propagates unchanged, its SQL's own errors too (say a
        UniqueViolation); only what pglease causes is mapped: a lost connection,
        the store's time limits, pglease's SQLSTATEs. Never retried: `apply`
        runs once.
        """
        args = _core.mutate_args(permit, event_type, payload, actor, now)
        conns = self._stack
        conn = await self._take(conns)
        phase = _core.BEGIN
        try:
            async with conn.transaction():
                if self._local_limits is not None:
                    await conn.execute(self._local_limits)
                cursor = await conn.execute(self._q.mutate_begin, args)
                row = await cursor.fetchone()
                assert row is not None
                phase = _core.APPLY
                value = await apply(conn) if apply is not None else None
                phase = _core.COMMIT  # leaving the block sends COMMIT
        except psycopg.Error as exc:
            error = _core.mutate_error(
                exc, conn.broken, phase, permit, event_type, self._limits, self.dsn
            )
            if error is None:
                raise
            raise error from _core.cause_of(error, exc)
        finally:
            await conns.give_back(conn)
        return MutationResult(permit.resource_id, row[0], row[1], value)

    async def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        """The resource with its lease state, judged by the database clock (or `now`)."""
        check_resource_id(resource_id)
        row = await self._row(self._q.get, [_core.check_now(now), resource_id])
        if row is None:
            raise UnknownResourceError(f"unknown resource {resource_id}")
        return _core.parse_resource(row)

    async def list_resources(
        self, resource_type: str | None = None, *, now: datetime | None = None
    ) -> list[ResourceState]:
        now = _core.check_now(now)
        if resource_type is not None:
            check_resource_type(resource_type)
        args: list[Any]
        if resource_type is None:
            query, args = self._q.list_all, [now]
        else:
            query, args = self._q.list_type, [now, resource_type]
        return [_core.parse_resource(r) for r in await self._rows(query, args)]

    async def events(
        self, resource_id: str, after_revision: int = 0, limit: int = 1000
    ) -> list[Event]:
        """A resource's events in revision order, after `after_revision`."""
        args = _core.events_of_args(resource_id, after_revision, limit)

        async def read(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            cursor = await conn.execute(self._q.events_of, args)
            rows = await cursor.fetchall()
            if not rows:
                cursor = await conn.execute(self._q.resource_exists, [resource_id])
                if await cursor.fetchone() is None:
                    raise UnknownResourceError(f"unknown resource {resource_id}")
            return rows

        return [_core.parse_event(r) for r in await self._read(read)]

    async def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        """Committed events after `cursor` (None or "start": from the beginning).

        Pass the last event's `cursor` to get the next page; no event is ever
        skipped, even when transactions commit out of id order.
        """
        # The cursor is checked against this log in the same statement (cursor_check).
        read = cursor_check.pg_events_after(self.schema, cursor, limit)
        return read.events(await self._rows(read.query, read.args))

    # --- fleet runtime (see pglease.fleet) -------------------------------------------

    def hold(
        self, resource_type: str, key: str, owner: Owner, ttl: float, **options: Any
    ) -> AbstractAsyncContextManager[AsyncHeldLease]:
        """Hold a lease for a block: ``(async) with store.hold(type, key, owner, ttl) as
        lease:``; see `pglease.fleet.hold` (and `hold_async`)."""
        from ..fleet import hold_async

        return hold_async(self, resource_type, key, owner, ttl, **options)

    async def acquire(
        self,
        resource_type: str,
        key: str,
        owner: Owner,
        ttl: float,
        timeout: float | None = None,
        **options: Any,
    ) -> Claim:
        """Wait for the lease and claim it; see `pglease.fleet.acquire` (and `acquire_async`)."""
        from ..fleet import acquire_async

        return await acquire_async(self, resource_type, key, owner, ttl, timeout, **options)

    async def elect(self, name: str, candidate: Owner, **options: Any) -> AsyncElection:
        """Campaign for leadership of `name`; see `pglease.fleet.elect` (and `elect_async`)."""
        from ..fleet import elect_async

        return await elect_async(self, name, candidate, **options)

    async def leader(self, name: str) -> Leader | None:
        """The current leader of election `name` and its generation, if any."""
        from ..fleet import leader_async

        return await leader_async(self, name)

    def watch(
        self,
        *,
        after: str | None = "now",
        types: Iterable[str] | str | None = None,
        resources: Iterable[str] | str | None = None,
        event_types: Iterable[str] | str | None = None,
        mode: str | None = None,
        interval: float | None = None,
        max_pending: int = 10_000,
        retry_window: float = 30.0,
        clock: Clock | None = None,
        tuning: HubTuning | None = None,
    ) -> AsyncWatcher:
        """Stream committed events gap-free from `after` (a cursor, "now" or "start").

        A watcher more than `max_pending` events behind the stream reads the
        missed span from the log itself (bounded memory, nothing lost). Errors
        that cannot heal, or that last `retry_window` seconds, reach the consumer
        as `WatchFailedError`; `watcher.health` tells the last error and the lag.
        `mode` defaults to "listen", or "poll" in pooler mode (where "listen" is
        refused: a pooler does not keep a LISTEN's session).
        See `pglease.watch.Watcher` (and `AsyncWatcher`)."""
        from ..watch import watch_async

        return watch_async(
            self,
            after=after,
            types=types,
            resources=resources,
            event_types=event_types,
            mode=mode,
            interval=interval,
            max_pending=max_pending,
            retry_window=retry_window,
            clock=clock,
            tuning=tuning,
        )
