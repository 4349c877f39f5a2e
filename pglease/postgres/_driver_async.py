"""The PostgreSQL store driver (`pglease.driver.store`), written once.

`AsyncPgDriver` is the asyncio source and `PgDriver` in
`pglease/postgres/_driver.py` its generated blocking twin. Below the one
lease store (`pglease.store`): the psycopg-pool, the LIFO connection stack
(`_reuse_async`), the prepared-statement fast path for claim, renew and
release (`_fastpath`), pooler mode, the time limits, and the one place where
psycopg's errors become `PgleaseError`s (`_core`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool

from .. import cursor_check
from ..driver import ops
from ..dsn import resolve_dsn
from ..errors import (
    BatchOutcomeUnknownError,
    LeaseLostError,
    PgleaseError,
    StoreClosedError,
    UnknownResourceError,
)
from ..ids import resource_id
from ..migrations import migrate_async, migration_state_async
from ..types import Claim, Event, MutationResult, Owner, ResourceState
from . import _core, _outcomes
from ._fastpath import (
    CLAIM,
    RELEASE,
    RENEW,
    AsyncFastPath,
    NotSentError,
    StalledError,
    Values,
    claim_values,
    from_micros,
    release_values,
    renew_values,
)
from ._queries import Queries
from ._reuse_async import (
    AsyncConnectionStack,
    AsyncStoreConnection,
    AsyncStorePool,
    discard,
    set_deadline,
)

T = TypeVar("T")
AsyncConn = psycopg.AsyncConnection[Any]
#: Why a renew gave up before the client deadline (`Claim.trusted_until`).
_TRUST_CLOSED = "the claim's local trust window closed"
#: Using an asyncio store before it is opened, or after it is closed (a blocking
#: store is open from its constructor on, and reports PoolClosed once closed).
_NOT_OPEN = "the store is not open (use `await AsyncPostgresStore.open()`)"


class AsyncPgDriver:
    """The store driver on one PostgreSQL schema: a psycopg-pool in autocommit
    mode whose connections are reused LIFO; claim, renew and release are one
    prepared-statement round trip each (unnamed statements in pooler mode).
    The arguments are `AsyncPostgresStore`'s."""

    def __init__(
        self,
        dsn: str | None,
        schema: str,
        pooler: bool,
        connect_timeout: float,
        limits: _core.Limits,
        *,
        min_size: int,
        auto_migrate: bool,
    ) -> None:
        """Arguments checked by the store: `pooler` is the mode in force, `limits`
        carry the pool's `max_size`."""
        self.schema = schema
        self.pooler = pooler
        self._limits = limits
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
        self._max_size = limits.max_size
        self._auto_migrate = auto_migrate
        self._connect_timeout = connect_timeout
        self._pool: AsyncConnectionPool[AsyncConn] | None = None
        self._conns: AsyncConnectionStack | None = None

    @property
    def limits(self) -> _core.Limits:
        """The store's statement, lock and pool time limits (as its errors name them)."""
        return self._limits

    async def open(self) -> None:
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
        pool: AsyncConnectionPool[AsyncConn] = AsyncStorePool(
            dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            # Bounded like every other connect: an attempt on a silent path
            # fails (and callers learn it, `AsyncStorePool.failing`) instead
            # of holding a pool worker for libpq's default.
            kwargs={**kwargs, "connect_timeout": math.ceil(self._connect_timeout)},
            # Every wait on a store connection ends at the client deadline.
            connection_class=AsyncStoreConnection,
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
        self._conns = AsyncConnectionStack(pool, self._probe)

    async def _probe(self, timeout: float | None = None) -> None:
        """Connect once, directly, within connect_timeout (`AsyncConnectionStack`
        runs this instead of waiting for a pool that fails to connect): the
        refused or timed-out connection's OperationalError, else nothing.
        `timeout`: the caller's time left, when shorter (libpq waits 2 s at least)."""
        limit = self._connect_timeout if timeout is None else min(timeout, self._connect_timeout)
        # async-only: begin
        try:
            async with asyncio.timeout(limit):
                conn = await psycopg.AsyncConnection.connect(
                    self.dsn,
                    connect_timeout=max(1, math.ceil(limit)),
                    **_core.connect_kwargs(self.schema, self.pooler),
                )
        except TimeoutError:
            raise psycopg.errors.ConnectionTimeout("connection timeout expired") from None
        # async-only: end
        # sync: conn = psycopg.Connection.connect(
        # sync:     self.dsn,
        # sync:     connect_timeout=max(1, math.ceil(limit)),
        # sync:     **_core.connect_kwargs(self.schema, self.pooler),
        # sync: )
        await conn.close()

    async def _configure(self, conn: AsyncConn) -> None:
        """The pool calls this on connect: the client deadline (which bounds what
        follows too), the time limits, then the fast path's prepared statements
        (neither in pooler mode, where session state would land on a random
        server)."""
        set_deadline(conn, self._limits.client_deadline)
        await self._set_limits(conn)
        await self._fast.prepare_on_connect_async(conn)

    async def _set_limits(self, conn: AsyncConn) -> None:
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

    async def _take(self, conns: AsyncConnectionStack, fast: bool = False) -> AsyncConn:
        """A live connection (`fast`: for `_write`); the pool's errors as PgleaseErrors
        (nothing was sent)."""
        try:
            return await conns.take(fast)
        except psycopg.Error as exc:
            raise self._error(exc) from exc

    async def _read(
        self,
        fn: Callable[[AsyncConn], Awaitable[T]],
        bounded: bool = True,
        stalled: Callable[[psycopg.Error], PgleaseError] | None = None,
    ) -> T:
        """Run a read (or an idempotent write) once more on a fresh connection when
        the connection breaks under it: running it twice is harmless.

        A connection that got no answer by the client deadline
        (`StalledError`) is closed and the call is not retried: the path is
        likely silent still. `stalled` words that error (the default: a read,
        nothing changed); `bounded=False` lifts the deadline for this call.

        In pooler mode `fn` runs in a transaction that starts with the limits as
        SET LOCAL (pipelined with it: BEGIN, the SETs and the first statement
        go in one round trip), since no session SET bounds it there."""
        conns = self._stack
        for attempt in (1, 2):
            conn = await self._take(conns)
            if not bounded:
                set_deadline(conn, None)
            try:
                if bounded and self._local_config is not None:
                    async with conn.pipeline(), conn.transaction():
                        await conn.execute(self._local_config)
                        return await fn(conn)
                return await fn(conn)
            except psycopg.Error as exc:
                if isinstance(exc, StalledError):  # a silent path: no retry
                    error = (stalled or self._stalled)(exc)
                    raise error from exc
                broken = conn.broken
                if broken and attempt == 1:
                    continue
                if broken:
                    raise _core.lost(exc, self.dsn) from exc
                error = self._error(exc)
                raise error from _core.cause_of(error, exc)
            finally:
                if not bounded:
                    set_deadline(conn, self._limits.client_deadline)
                await conns.give_back(conn)
        raise AssertionError("unreachable")

    def _stalled(self, exc: psycopg.Error) -> PgleaseError:
        return _core.stalled(exc, self.dsn)

    async def _write(
        self, name: bytes, values: Values, op: _Op, unknown: _Unknown[_Op]
    ) -> pq.abc.PGresult:
        """One fast-path write of `op`. Retried once only when it certainly never ran;
        a connection lost after it was sent raises ``unknown(op, dsn)(exc)`` (the
        outcome unknown; built only then, the hot path allocates no closure)."""
        conns = self._conns
        if conns is None:
            raise StoreClosedError(_NOT_OPEN)
        # A renew waits no longer than its claim is trusted (the answer of one
        # still on its way then comes too late to keep the lease trusted).
        until = op.claim.trusted_until if isinstance(op, ops.RenewOp) else None
        if until is not None and until <= time.monotonic():
            until = None  # already closed: the renew's own answer is what counts
        for attempt in (1, 2):
            conn = await self._take(conns, fast=True)
            try:
                return await self._fast.call_async(conn, name, values, until, _TRUST_CLOSED)
            except NotSentError as exc:
                # Not retried after a stall: the next connection's path is likely
                # as silent, and the caller learns within one deadline.
                if conn.broken and attempt == 1 and not isinstance(exc.cause, StalledError):
                    continue
                error = self._error(exc.cause)
                raise error from _core.cause_of(error, exc.cause)
            except psycopg.Error as exc:
                if conn.broken:
                    raise unknown(op, self.dsn)(exc) from exc
                error = self._error(exc)
                raise error from _core.cause_of(error, exc)
            finally:
                await conns.give_back(conn)
        raise AssertionError("unreachable")

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
    def pool(self) -> AsyncConnectionPool[AsyncConn]:
        """The psycopg-pool (StoreClosedError when the store is not open)."""
        if self._pool is None:
            raise StoreClosedError(_NOT_OPEN)
        return self._pool

    # async-only: end

    @asynccontextmanager
    async def connection(self, timeout: float | None = None) -> AsyncIterator[AsyncConn]:
        """Borrow a live autocommit connection from the store's pool (waiting at
        most `timeout` for one, when shorter than pool_timeout: the runtime's).

        This is the driver's own connection: errors of the SQL run on it, and of
        checking it out (psycopg_pool's PoolTimeout, PoolClosed), are psycopg's.
        """
        async with self._stack.borrow(timeout) as conn:
            yield conn

    async def _row(
        self,
        query: bytes,
        args: list[Any],
        stalled: Callable[[psycopg.Error], PgleaseError] | None = None,
    ) -> Any:
        """The first row of one read statement, or None (see `_read`)."""

        async def read(conn: AsyncConn) -> Any:
            cursor = await conn.execute(query, args)
            return await cursor.fetchone()

        return await self._read(read, stalled=stalled)

    async def _rows(self, query: bytes, args: list[Any]) -> list[Any]:
        """Every row of one read statement (see `_read`)."""

        async def read(conn: AsyncConn) -> list[Any]:
            cursor = await conn.execute(query, args)
            return await cursor.fetchall()

        return await self._read(read)

    async def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""

        async def run(conn: AsyncConn) -> list[str]:
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

    async def ensure_resource(self, op: ops.EnsureOp) -> str:
        def unknown(exc: psycopg.Error) -> PgleaseError:
            rid = resource_id(op.resource_type, op.key)
            return _core.outcome_unknown(
                exc,
                "ensure_resource",
                rid,
                "call ensure_resource again (it is idempotent)",
                self.dsn,
            )

        row = await self._row(self._q.ensure, [op.resource_type, op.key], unknown)
        assert row is not None  # the statement always returns the id
        return str(row[0])

    async def claim(self, op: ops.ClaimOp) -> Claim | None:
        result = await self._write(CLAIM, claim_values(op), op, _claim_unknown)
        if result.get_value(0, 0) != b"t":
            return None
        return Claim(
            op.resource_id,
            op.owner,
            op.token,
            int(result.get_value(0, 1) or b""),
            from_micros(result.get_value(0, 2) or b""),
            int(result.get_value(0, 3) or b""),
            op.trusted_until,
        )

    async def renew(self, op: ops.RenewOp) -> Claim:
        result = await self._write(RENEW, renew_values(op), op, _renew_unknown)
        expires_at, revision = result.get_value(0, 0), result.get_value(0, 1)
        return replace(
            op.claim,
            expires_at=from_micros(expires_at or b""),
            revision=int(revision or b""),
            trusted_until=op.trusted_until,
        )

    async def release(self, op: ops.ReleaseOp) -> int:
        result = await self._write(RELEASE, release_values(op), op, _release_unknown)
        return int(result.get_value(0, 0) or b"")

    async def _batch(
        self,
        query: bytes,
        args: list[Any],
        unknown: Callable[[psycopg.Error], PgleaseError],
    ) -> list[Any]:
        """Every row of one batch statement (autocommit: one round trip, one commit).

        Never retried: once sent, a batch may have committed. A connection that
        breaks (or stalls past the client deadline, `AsyncStoreConnection`) after
        that raises `unknown(exc)`. In pooler mode the limits go ahead of it as
        SET LOCAL in its transaction, pipelined (as `_read` does)."""
        conns = self._stack
        conn = await self._take(conns)
        try:
            if self._local_config is not None:
                async with conn.pipeline(), conn.transaction():
                    await conn.execute(self._local_config)
                    cursor = await conn.execute(query, args)
                    rows = await cursor.fetchall()
            else:
                cursor = await conn.execute(query, args)
                rows = await cursor.fetchall()
        except psycopg.Error as exc:
            if conn.broken:
                raise unknown(exc) from exc
            error = self._error(exc)
            raise error from _core.cause_of(error, exc)
        finally:
            await conns.give_back(conn)
        # The function answers in resource-id order; the caller's order is `ord`.
        rows.sort(key=lambda row: row[0])
        return rows

    def _batch_unknown(
        self,
        operation: str,
        rids: tuple[str, ...],
        owner: Owner | None,
        tokens: tuple[str, ...] | None,
    ) -> Callable[[psycopg.Error], PgleaseError]:
        def unknown(exc: psycopg.Error) -> PgleaseError:
            check = (
                "all of its items committed or none did (one transaction); read get() of"
                f" {rids[0]!r}"
                + (f" (or any of the {len(rids)} resources)" if len(rids) > 1 else "")
                + " to learn which"
            )
            message = _core.outcome_unknown(exc, operation, rids[0], check, self.dsn)
            return BatchOutcomeUnknownError(
                str(message), operation=operation, resource_ids=rids, owner=owner, tokens=tokens
            )

        return unknown

    async def claim_many(self, op: ops.ClaimManyOp) -> list[Claim | None]:
        owner = op.owner
        args = [list(op.resource_ids), owner.type, owner.id, list(op.token_sha256s), op.ttl, op.now]
        unknown = self._batch_unknown("claim_many", op.resource_ids, owner, op.tokens)
        rows = await self._batch(self._q.claim_many, args, unknown)
        trusted_until = op.trusted_until
        out: list[Claim | None] = []
        for (ordinal, claimed, generation, expires_at, revision), rid, token in zip(
            rows, op.resource_ids, op.tokens, strict=True
        ):
            assert ordinal == len(out) + 1
            out.append(
                Claim(rid, owner, token, generation, expires_at, revision, trusted_until)
                if claimed
                else None
            )
        return out

    @staticmethod
    def _lease_arrays(claims: tuple[Claim, ...], token_sha256s: tuple[bytes, ...]) -> list[Any]:
        return [
            [c.resource_id for c in claims],
            [c.owner.type for c in claims],
            [c.owner.id for c in claims],
            [c.generation for c in claims],
            list(token_sha256s),
        ]

    async def renew_many(self, op: ops.RenewManyOp) -> list[Claim | LeaseLostError]:
        args = [*self._lease_arrays(op.claims, op.token_sha256s), op.ttl, op.now]
        rids = tuple(c.resource_id for c in op.claims)
        rows = await self._batch(
            self._q.renew_many, args, self._batch_unknown("renew_many", rids, None, None)
        )
        trusted_until = op.trusted_until
        out: list[Claim | LeaseLostError] = []
        for (_, expires_at, revision, code, message), claim in zip(rows, op.claims, strict=True):
            if code is None:
                out.append(
                    replace(
                        claim, expires_at=expires_at, revision=revision, trusted_until=trusted_until
                    )
                )
            else:
                out.append(_core.lease_error(code, message))
        return out

    async def release_many(self, op: ops.ReleaseManyOp) -> list[int | LeaseLostError]:
        args = [*self._lease_arrays(op.claims, op.token_sha256s), op.now]
        rids = tuple(c.resource_id for c in op.claims)
        rows = await self._batch(
            self._q.release_many, args, self._batch_unknown("release_many", rids, None, None)
        )
        return [
            int(revision) if code is None else _core.lease_error(code, message)
            for (_, revision, code, message), _claim in zip(rows, op.claims, strict=True)
        ]

    async def mutate(
        self, op: ops.MutateOp, apply: Callable[[AsyncConn], Awaitable[Any]] | None
    ) -> MutationResult:
        """`AsyncPostgresStore.mutate`: the permit check, `apply(conn)` and the event
        in one transaction; psycopg errors of `apply`'s own SQL propagate unchanged."""
        permit, lease, actor = op.permit, op.permit.lease, op.actor
        args = [
            permit.resource_id,
            permit.expected_revision,
            op.event_type,
            lease.owner.type if lease else None,
            lease.owner.id if lease else None,
            lease.generation if lease else None,
            op.lease_token_sha256,
            actor.type if actor else None,
            actor.id if actor else None,
            op.payload_text,
            op.now,
        ]
        conns = self._stack
        conn = await self._take(conns)
        phase = _outcomes.BEGIN
        # A fenced transaction is bounded by its lease on the server
        # (_bound_by_lease): the seconds its lease had left when mutate_begin's
        # result arrived, and when that was by this host's monotonic clock.
        fence: _outcomes.Fence | None = None
        try:
            async with conn.transaction():
                if self._local_limits is not None:
                    await conn.execute(self._local_limits)
                cursor = await conn.execute(self._q.mutate_begin, args)
                row = await cursor.fetchone()
                assert row is not None
                fence = _outcomes.Fence.of(row[2], time.monotonic())
                phase = _outcomes.APPLY
                value = await apply(conn) if apply is not None else None
                phase = _outcomes.COMMIT  # leaving the block sends COMMIT
                if fence is not None:
                    fence = fence.at_commit(time.monotonic())
        except psycopg.Error as exc:
            error = _outcomes.mutate_error(
                exc,
                conn.broken,
                phase,
                permit,
                op.event_type,
                self._limits,
                self.dsn,
                fence.overran(time.monotonic()) if fence is not None else False,
            )
            if error is None:
                raise
            raise error from _core.cause_of(error, exc)
        finally:
            await conns.give_back(conn)
        return MutationResult(permit.resource_id, row[0], row[1], value)

    async def get(self, op: ops.GetOp) -> ResourceState:
        row = await self._row(self._q.get, [op.now, op.resource_id])
        if row is None:
            raise UnknownResourceError(f"unknown resource {op.resource_id}")
        return _core.parse_resource(row)

    async def list_resources(self, op: ops.ListOp) -> list[ResourceState]:
        args: list[Any]
        if op.resource_type is None:
            query, args = self._q.list_all, [op.now]
        else:
            query, args = self._q.list_type, [op.now, op.resource_type]
        return [_core.parse_resource(r) for r in await self._rows(query, args)]

    async def events(self, op: ops.EventsOp) -> list[Event]:
        args = [op.resource_id, op.after_revision, op.limit]

        async def read(conn: AsyncConn) -> list[Any]:
            cursor = await conn.execute(self._q.events_of, args)
            rows = await cursor.fetchall()
            if not rows:
                cursor = await conn.execute(self._q.resource_exists, [op.resource_id])
                if await cursor.fetchone() is None:
                    raise UnknownResourceError(f"unknown resource {op.resource_id}")
            return rows

        return [_core.parse_event(r) for r in await self._read(read)]

    async def read_log(self, op: ops.ReadLogOp) -> list[Event]:
        """No event is ever skipped, even when transactions commit out of id order:
        the cursor is checked against this log in the same statement (cursor_check)."""
        read = cursor_check.pg_read_after(self.schema, op.cursor, op.limit)
        return read.events(await self._rows(read.query, read.args))


_Op = TypeVar("_Op", ops.ClaimOp, ops.RenewOp, ops.ReleaseOp)
#: Builds the outcome-unknown error of a write whose connection broke after sending.
_Unknown = Callable[[_Op, str | None], Callable[[psycopg.Error], PgleaseError]]


def _claim_unknown(op: ops.ClaimOp, dsn: str | None) -> Callable[[psycopg.Error], PgleaseError]:
    return _outcomes.claim_unknown(op.resource_id, op.owner, op.token, op.ttl, dsn)


def _renew_unknown(op: ops.RenewOp, dsn: str | None) -> Callable[[psycopg.Error], PgleaseError]:
    return _outcomes.renew_unknown(op.claim, dsn)


def _release_unknown(op: ops.ReleaseOp, dsn: str | None) -> Callable[[psycopg.Error], PgleaseError]:
    return _outcomes.release_unknown(op.claim, dsn)
