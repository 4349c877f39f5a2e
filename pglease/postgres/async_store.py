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
from psycopg_pool import AsyncConnectionPool

from .. import cursor_check
from ..dsn import resolve_dsn
from ..errors import PgleaseError, UnknownResourceError
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
from ._fastpath import CLAIM, RELEASE, RENEW, AsyncFastPath, from_micros

if TYPE_CHECKING:
    from ..clock import Clock
    from ..fleet import AsyncElection, AsyncHeldLease, Leader
    from ..watch import AsyncWatcher
    from ..watch.hub import HubTuning

T = TypeVar("T")
AsyncApply = Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]


class AsyncPostgresStore:
    """Asyncio lease store. Open with ``await AsyncPostgresStore.open(dsn)``
    or ``async with AsyncPostgresStore(dsn) as store``."""

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = DEFAULT_SCHEMA,
        min_size: int = 1,
        max_size: int = 16,
        auto_migrate: bool = True,
        connect_timeout: float = 10.0,
    ) -> None:
        self.schema = check_schema_name(schema)
        connect_timeout = check_positive_seconds(connect_timeout, "connect_timeout")
        self._dsn = dsn
        self._q = Queries(schema)
        self._fast = AsyncFastPath(schema)
        self._min_size = min_size
        self._max_size = max_size
        self._auto_migrate = auto_migrate
        self._connect_timeout = connect_timeout
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None

    @classmethod
    async def open(cls, dsn: str | None = None, **kwargs: Any) -> AsyncPostgresStore:
        store = cls(dsn, **kwargs)
        await store._open()
        return store

    async def _open(self) -> None:
        if self._pool is not None:
            return
        # Starting the embedded server blocks for about a second: keep the loop free.
        self.dsn = await asyncio.to_thread(resolve_dsn, self._dsn)
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, connect_timeout=math.ceil(self._connect_timeout)
            )
        except psycopg.OperationalError as exc:
            raise _core.unavailable(exc) from exc
        async with conn:
            if self._auto_migrate:
                await migrate_async(conn, self.schema)
            else:
                _core.require_migrated(await migration_state_async(conn, self.schema))
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            self.dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            kwargs={"autocommit": True},
            open=False,
            name=f"pglease-{self.schema}",
        )
        await pool.open(wait=True, timeout=self._connect_timeout)
        self._pool = pool

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
            raise PgleaseError("the store is not open (use `await AsyncPostgresStore.open()`)")
        return self._pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """Borrow an autocommit connection from the store's pool."""
        async with self.pool.connection() as conn:
            yield conn

    async def _one(self, query: bytes, args: list[Any]) -> tuple[Any, ...]:
        async with self.pool.connection() as conn:
            try:
                cur = await conn.execute(query, args)
                row = await cur.fetchone()
            except psycopg.Error as exc:
                raise _core.translate(exc) or exc from None
        assert row is not None
        return tuple(row)

    async def migrate(self) -> list[str]:
        async with self.pool.connection() as conn:
            return [m.label for m in await migrate_async(conn, self.schema)]

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
        async with self.pool.connection() as conn:
            row = await self._fast.call_async(conn, CLAIM, args)
        claimed, generation, expires_at, revision = row
        if claimed != b"t":
            return None
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
        async with self.pool.connection() as conn:
            expires_at, revision = await self._fast.call_async(conn, RENEW, args)
        return replace(claim, expires_at=from_micros(expires_at), revision=int(revision))

    async def release(
        self, claim: Claim, expected_revision: int | None = None, *, now: datetime | None = None
    ) -> int:
        """Give up a current lease (expired or not); return the new revision."""
        args = _core.release_args(claim, expected_revision, now)
        async with self.pool.connection() as conn:
            (revision,) = await self._fast.call_async(conn, RELEASE, args)
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
        args = _core.mutate_args(permit, event_type, payload, actor, now)
        async with self.pool.connection() as conn:
            try:
                async with conn.transaction():
                    try:
                        cur = await conn.execute(self._q.mutate_begin, args)
                        row = await cur.fetchone()
                    except psycopg.Error as exc:
                        raise _core.translate(exc) or exc from None
                    assert row is not None
                    value = await apply(conn) if apply is not None else None
            except psycopg.Error as exc:
                # At COMMIT: the fence refuses a lease that expired meanwhile.
                mapped = _core.translate(exc)
                if mapped is None:
                    raise
                raise mapped from None
        return MutationResult(permit.resource_id, row[0], row[1], value)

    async def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        check_resource_id(resource_id)
        async with self.pool.connection() as conn:
            try:
                cur = await conn.execute(self._q.get, [_core.check_now(now), resource_id])
            except psycopg.Error as exc:
                raise _core.translate(exc) or exc from None
            row = await cur.fetchone()
        if row is None:
            raise UnknownResourceError(f"unknown resource {resource_id}")
        return _core.parse_resource(row)

    async def list_resources(
        self, resource_type: str | None = None, *, now: datetime | None = None
    ) -> list[ResourceState]:
        now = _core.check_now(now)
        if resource_type is not None:
            check_resource_type(resource_type)
        async with self.pool.connection() as conn:
            try:
                if resource_type is None:
                    cur = await conn.execute(self._q.list_all, [now])
                else:
                    cur = await conn.execute(self._q.list_type, [now, resource_type])
            except psycopg.Error as exc:
                raise _core.translate(exc) or exc from None
            rows = await cur.fetchall()
        return [_core.parse_resource(r) for r in rows]

    async def events(
        self, resource_id: str, after_revision: int = 0, limit: int = 1000
    ) -> list[Event]:
        args = _core.events_of_args(resource_id, after_revision, limit)
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(self._q.events_of, args)).fetchall()
            if not rows:
                cur = await conn.execute(self._q.resource_exists, [resource_id])
                if await cur.fetchone() is None:
                    raise UnknownResourceError(f"unknown resource {resource_id}")
        return [_core.parse_event(r) for r in rows]

    async def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        read = cursor_check.pg_events_after(self.schema, cursor, limit)
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(read.query, read.args)).fetchall()
        return read.events(rows)

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
        mode: str = "listen",
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
