"""`AsyncPostgresStore`: the asyncio twin of `PostgresStore` (same names and semantics)."""

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
from ..errors import (
    DatabaseUnavailableError,
    PgleaseError,
    StoreClosedError,
    UnknownResourceError,
)
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
from ._reuse import alive, discard

if TYPE_CHECKING:
    from ..clock import Clock
    from ..fleet import AsyncElection, AsyncHeldLease, Leader
    from ..watch import AsyncWatcher
    from ..watch.hub import HubTuning

T = TypeVar("T")
AsyncApply = Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]


class AsyncPostgresStore:
    """Asyncio lease store. Open with ``await AsyncPostgresStore.open(dsn)``
    or ``async with AsyncPostgresStore(dsn) as store``.

    Same options, time limits and errors as `PostgresStore`."""

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

    @property
    def limits(self) -> _core.Limits:
        """The store's statement, lock and pool time limits (as its errors name them)."""
        return self._limits

    @classmethod
    async def open(cls, dsn: str | None = None, **kwargs: Any) -> AsyncPostgresStore:
        store = cls(dsn, **kwargs)
        await store._open()
        return store

    async def _open(self) -> None:
        if self._pool is not None:
            return
        # Starting the embedded server blocks for about a second: keep the loop free.
        dsn = await asyncio.to_thread(resolve_dsn, self._dsn)
        self.dsn = dsn
        kwargs = _core.connect_kwargs(self.schema, self.pooler)
        # Migrations run without the time limits: they wait for each other on purpose.
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

    async def _take(self) -> psycopg.AsyncConnection[Any]:
        """A live connection (see `_reuse.alive`); pool errors as PgleaseErrors."""
        pool = self.pool
        # Every dead one is dropped, so the pool runs out of them; the bound only
        # stops a server that kills each new connection at once.
        for _ in range(2 * self._max_size + 2):
            try:
                conn = await pool.getconn()
            except psycopg.Error as exc:
                raise self._error(exc) from exc
            if alive(conn):
                return conn
            discard(conn)
            await pool.putconn(conn)
        raise DatabaseUnavailableError(
            "connection to PostgreSQL failed: every connection tried had been closed by the server"
        )

    async def _read(
        self, fn: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], bounded: bool = True
    ) -> T:
        """Run a read (or an idempotent write) once more on a fresh connection when
        the connection breaks under it: running it twice is harmless.

        In pooler mode `fn` runs in a transaction that starts with the limits as
        SET LOCAL (pipelined with it), as in `PostgresStore._read`."""
        for attempt in (1, 2):
            conn = await self._take()
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
                await self.pool.putconn(conn)
        raise AssertionError("unreachable")

    async def _write(
        self, name: bytes, args: list[Any], unknown: Callable[[psycopg.Error], PgleaseError]
    ) -> list[bytes]:
        """One fast-path write. Retried once only when it certainly never ran; a
        connection lost after it was sent raises `unknown(exc)` (outcome unknown)."""
        for attempt in (1, 2):
            conn = await self._take()
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
                await self.pool.putconn(conn)
        raise AssertionError("unreachable")

    async def __aenter__(self) -> AsyncPostgresStore:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    @property
    def pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        if self._pool is None:
            raise StoreClosedError("the store is not open (use `await AsyncPostgresStore.open()`)")
        return self._pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """Borrow a live autocommit connection from the store's pool.

        This is the driver's own connection: errors of the SQL run on it, and of
        checking it out (psycopg_pool's PoolTimeout, PoolClosed), are psycopg's.
        """
        pool = self.pool
        for _ in range(2 * self._max_size + 2):
            conn = await pool.getconn()
            if alive(conn):
                break
            discard(conn)
            await pool.putconn(conn)
        else:
            raise psycopg.OperationalError("every connection tried had been closed by the server")
        try:
            yield conn
        finally:
            await pool.putconn(conn)

    async def _one(self, query: bytes, args: list[Any]) -> tuple[Any, ...]:
        async def read(conn: psycopg.AsyncConnection[Any]) -> Any:
            return await (await conn.execute(query, args)).fetchone()

        row = await self._read(read)
        assert row is not None
        return tuple(row)

    async def migrate(self) -> list[str]:
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
        row = await self._one(self._q.ensure, list(_core.ensure_args(resource_type, key)))
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
        """See `PostgresStore.mutate`: `apply` runs once; what it raises, its SQL's
        own errors too, propagates unchanged; what pglease causes is mapped."""
        args = _core.mutate_args(permit, event_type, payload, actor, now)
        conn = await self._take()
        phase = _core.BEGIN
        try:
            async with conn.transaction():
                if self._local_limits is not None:
                    await conn.execute(self._local_limits)
                row = await (await conn.execute(self._q.mutate_begin, args)).fetchone()
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
            await self.pool.putconn(conn)
        return MutationResult(permit.resource_id, row[0], row[1], value)

    async def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        check_resource_id(resource_id)
        args: list[Any] = [_core.check_now(now), resource_id]

        async def read(conn: psycopg.AsyncConnection[Any]) -> Any:
            return await (await conn.execute(self._q.get, args)).fetchone()

        row = await self._read(read)
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

        async def read(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            return await (await conn.execute(query, args)).fetchall()

        return [_core.parse_resource(r) for r in await self._read(read)]

    async def events(
        self, resource_id: str, after_revision: int = 0, limit: int = 1000
    ) -> list[Event]:
        args = _core.events_of_args(resource_id, after_revision, limit)

        async def read(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            rows = await (await conn.execute(self._q.events_of, args)).fetchall()
            if not rows:
                cur = await conn.execute(self._q.resource_exists, [resource_id])
                if await cur.fetchone() is None:
                    raise UnknownResourceError(f"unknown resource {resource_id}")
            return rows

        return [_core.parse_event(r) for r in await self._read(read)]

    async def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        read = cursor_check.pg_events_after(self.schema, cursor, limit)

        async def fetch(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            return await (await conn.execute(read.query, read.args)).fetchall()

        return read.events(await self._read(fetch))

    # --- fleet runtime (see pglease.fleet) -------------------------------------------

    def hold(
        self, resource_type: str, key: str, owner: Owner, ttl: float, **options: Any
    ) -> AbstractAsyncContextManager[AsyncHeldLease]:
        """``async with store.hold(...) as lease:`` see `pglease.fleet.hold_async`."""
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
        """Wait for the lease and claim it; see `pglease.fleet.acquire_async`."""
        from ..fleet import acquire_async

        return await acquire_async(self, resource_type, key, owner, ttl, timeout, **options)

    async def elect(self, name: str, candidate: Owner, **options: Any) -> AsyncElection:
        """Campaign for leadership of `name`; see `pglease.fleet.elect_async`."""
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
        See `pglease.watch.AsyncWatcher`."""
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

