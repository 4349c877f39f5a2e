# Generated from pglease/postgres/async_store.py by tools/async_to_sync.py: do not edit.
"""The lease store on PostgreSQL, written once: `AsyncPostgresStore` (asyncio).

This file is the hand-written source; `pglease/postgres/store.py`, the blocking
`PostgresStore` with the same names and semantics, is generated from it by
`tools/async_to_sync.py`. The flavours differ in how they open: the blocking
store connects in its constructor, the asyncio one in ``await
AsyncPostgresStore.open(dsn)`` or ``async with AsyncPostgresStore(dsn)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool

from .. import _instrument, cursor_check
from ..dsn import resolve_dsn
from ..errors import PgleaseError, StoreClosedError, UnknownResourceError
from ..migrations import migrate, migration_state
from ..types import Claim, Event, MutationResult, Owner, Permit, ResourceState
from ..validation import (
    check_positive_seconds,
    check_resource_id,
    check_resource_type,
    check_schema_name,
)
from . import _core
from ._core import DEFAULT_SCHEMA, Queries
from ._fastpath import CLAIM, RELEASE, RENEW, FastPath, NotSentError, from_micros
from ._reuse import ConnectionStack, discard

if TYPE_CHECKING:
    from ..clock import Clock
    from ..fleet import Election, HeldLease, Leader
    from ..watch import Watcher
    from ..watch.hub import HubTuning

T = TypeVar("T")
Apply = Callable[[psycopg.Connection[Any]], T]
#: Using an asyncio store before it is opened, or after it is closed (a blocking
#: store is open from its constructor on, and reports PoolClosed once closed).
_NOT_OPEN = "the store is not open (use `await AsyncPostgresStore.open()`)"


class PostgresStore:
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
        self._fast = FastPath(
            schema,
            None if self.pooler else self._limits.settings,
            self._limits,
            pooler=self.pooler,
        )
        self._min_size = min_size
        self._max_size = max_size
        self._auto_migrate = auto_migrate
        self._connect_timeout = connect_timeout
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._conns: ConnectionStack | None = None
        self._open()

    @property
    def limits(self) -> _core.Limits:
        """The store's statement, lock and pool time limits (as its errors name them)."""
        return self._limits

    def _open(self) -> None:
        """Connect once, migrate (or check), then open the pool and the LIFO stack."""
        if self._pool is not None:
            return
        # Starting the embedded server blocks for about a second: keep a loop free.
        dsn = resolve_dsn(self._dsn)
        self.dsn = dsn
        kwargs = _core.connect_kwargs(self.schema, self.pooler)
        # One direct connection first: a bad DSN or a down server fails fast with
        # one clear error instead of a pool retrying in the background. Migrations
        # run without the time limits: they wait for each other on purpose.
        try:
            conn = psycopg.Connection.connect(
                dsn, connect_timeout=math.ceil(self._connect_timeout), **kwargs
            )
        except psycopg.OperationalError as exc:
            raise _core.unavailable(exc, dsn=dsn) from exc
        try:
            with conn:
                if self._auto_migrate:
                    migrate(conn, self.schema)
                else:
                    _core.require_migrated(migration_state(conn, self.schema))
        except psycopg.Error as exc:
            raise self._error(exc) from exc
        pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
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
                pool.open(wait=True, timeout=self._connect_timeout)
        except BaseException as exc:
            pool.close()  # stop its workers; the caller gets the error
            if isinstance(exc, psycopg.Error):
                raise _core.pool_unavailable(exc, connect_errors.last, dsn) from exc
            raise
        self._pool = pool
        self._conns = ConnectionStack(pool)

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """The pool calls this on connect: the time limits, then the fast path's
        prepared statements (neither in pooler mode, where session state would
        land on a random server)."""
        self._set_limits(conn)
        self._fast.prepare_on_connect(conn)

    def _set_limits(self, conn: psycopg.Connection[Any]) -> None:
        """Set the time limits for the session (not in pooler mode)."""
        if not self.pooler and (settings := self._limits.settings) is not None:
            conn.execute(settings)

    def _error(self, exc: psycopg.Error) -> PgleaseError:
        return _core.driver_error(exc, self._limits, self.dsn)

    @property
    def _stack(self) -> ConnectionStack:
        if self._conns is None:
            raise StoreClosedError(_NOT_OPEN)
        return self._conns

    def _take(self, conns: ConnectionStack) -> psycopg.Connection[Any]:
        """A live connection; the pool's errors as PgleaseErrors (nothing was sent)."""
        try:
            return conns.take()
        except psycopg.Error as exc:
            raise self._error(exc) from exc

    def _read(self, fn: Callable[[psycopg.Connection[Any]], T], bounded: bool = True) -> T:
        """Run a read (or an idempotent write) once more on a fresh connection when
        the connection breaks under it: running it twice is harmless.

        In pooler mode `fn` runs in a transaction that starts with the limits as
        SET LOCAL (pipelined with it: BEGIN, the SETs and the first statement
        go in one round trip), since no session SET bounds it there."""
        conns = self._stack
        for attempt in (1, 2):
            conn = self._take(conns)
            try:
                if bounded and self._local_config is not None:
                    with conn.pipeline(), conn.transaction():
                        conn.execute(self._local_config)
                        return fn(conn)
                return fn(conn)
            except psycopg.Error as exc:
                broken = conn.broken
                if broken and attempt == 1:
                    continue
                if broken:
                    raise _core.lost(exc, self.dsn) from exc
                error = self._error(exc)
                raise error from _core.cause_of(error, exc)
            finally:
                conns.give_back(conn)
        raise AssertionError("unreachable")

    def _write(
        self, name: bytes, args: list[Any], unknown: Callable[[psycopg.Error], PgleaseError]
    ) -> list[bytes]:
        """One fast-path write. Retried once only when it certainly never ran; a
        connection lost after it was sent raises `unknown(exc)` (outcome unknown)."""
        conns = self._stack
        for attempt in (1, 2):
            conn = self._take(conns)
            try:
                return self._fast.call(conn, name, args)
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
                conns.give_back(conn)
        raise AssertionError("unreachable")

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pool, with the connections kept for reuse; closing twice is harmless."""
        if self._pool is not None and self._conns is not None:
            pool, conns, self._pool = self._pool, self._conns, None
            # A blocking store keeps its stack: a call after close then gets the
            # pool's PoolClosed, which the lease API reports as StoreClosedError.
            conns.drain()
            pool.close()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Borrow a live autocommit connection from the store's pool.

        This is the driver's own connection: errors of the SQL run on it, and of
        checking it out (psycopg_pool's PoolTimeout, PoolClosed), are psycopg's.
        """
        with self._stack.borrow() as conn:
            yield conn

    def _row(self, query: bytes, args: list[Any]) -> Any:
        """The first row of one read statement, or None (see `_read`)."""

        def read(conn: psycopg.Connection[Any]) -> Any:
            cursor = conn.execute(query, args)
            return cursor.fetchone()

        return self._read(read)

    def _rows(self, query: bytes, args: list[Any]) -> list[Any]:
        """Every row of one read statement (see `_read`)."""

        def read(conn: psycopg.Connection[Any]) -> list[Any]:
            cursor = conn.execute(query, args)
            return cursor.fetchall()

        return self._read(read)

    def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""

        def run(conn: psycopg.Connection[Any]) -> list[str]:
            if self.pooler:  # no session limits were set; none to lift or restore
                return [m.label for m in migrate(conn, self.schema)]
            # Migrators queue on each other's lock and may run long: no limits.
            conn.execute(b"SET statement_timeout = 0; SET lock_timeout = 0")
            try:
                return [m.label for m in migrate(conn, self.schema)]
            finally:
                if conn.info.transaction_status == pq.TransactionStatus.IDLE:
                    conn.execute(b"RESET statement_timeout; RESET lock_timeout")
                    self._set_limits(conn)
                else:
                    discard(conn)  # never reuse it without its limits

        return self._read(run, bounded=False)  # idempotent; migrators wait on purpose

    def ensure_resource(self, resource_type: str, key: str) -> str:
        """Create the resource if needed and return its deterministic id (no event)."""
        row = self._row(self._q.ensure, list(_core.ensure_args(resource_type, key)))
        assert row is not None  # the statement always returns the id
        return str(row[0])

    def claim(
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
            claimed, generation, expires_at, revision = self._write(CLAIM, args, unknown)
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

    def renew(
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
            expires_at, revision = self._write(RENEW, args, unknown)
        except PgleaseError as exc:
            _instrument.recorder.renewal("store", _instrument.lease_error(exc))
            raise
        _instrument.recorder.renewal("store", "renewed")
        return replace(claim, expires_at=from_micros(expires_at), revision=int(revision))

    def release(
        self, claim: Claim, expected_revision: int | None = None, *, now: datetime | None = None
    ) -> int:
        """Give up a current lease (expired or not); return the new revision."""
        args = _core.release_args(claim, expected_revision, now)
        try:
            (revision,) = self._write(RELEASE, args, _core.release_unknown(claim, self.dsn))
        except PgleaseError as exc:
            _instrument.recorder.release(_instrument.lease_error(exc))
            raise
        _instrument.recorder.release("released")
        return int(revision)

    def mutate(
        self,
        permit: Permit,
        event_type: str,
        apply: Apply[T] | None = None,
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
        conn = self._take(conns)
        phase = _core.BEGIN
        try:
            with conn.transaction():
                if self._local_limits is not None:
                    conn.execute(self._local_limits)
                cursor = conn.execute(self._q.mutate_begin, args)
                row = cursor.fetchone()
                assert row is not None
                phase = _core.APPLY
                value = apply(conn) if apply is not None else None
                phase = _core.COMMIT  # leaving the block sends COMMIT
        except psycopg.Error as exc:
            error = _core.mutate_error(
                exc, conn.broken, phase, permit, event_type, self._limits, self.dsn
            )
            if error is None:
                raise
            raise error from _core.cause_of(error, exc)
        finally:
            conns.give_back(conn)
        return MutationResult(permit.resource_id, row[0], row[1], value)

    def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        """The resource with its lease state, judged by the database clock (or `now`)."""
        check_resource_id(resource_id)
        row = self._row(self._q.get, [_core.check_now(now), resource_id])
        if row is None:
            raise UnknownResourceError(f"unknown resource {resource_id}")
        return _core.parse_resource(row)

    def list_resources(
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
        return [_core.parse_resource(r) for r in self._rows(query, args)]

    def events(self, resource_id: str, after_revision: int = 0, limit: int = 1000) -> list[Event]:
        """A resource's events in revision order, after `after_revision`."""
        args = _core.events_of_args(resource_id, after_revision, limit)

        def read(conn: psycopg.Connection[Any]) -> list[Any]:
            cursor = conn.execute(self._q.events_of, args)
            rows = cursor.fetchall()
            if not rows:
                cursor = conn.execute(self._q.resource_exists, [resource_id])
                if cursor.fetchone() is None:
                    raise UnknownResourceError(f"unknown resource {resource_id}")
            return rows

        return [_core.parse_event(r) for r in self._read(read)]

    def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        """Committed events after `cursor` (None or "start": from the beginning).

        Pass the last event's `cursor` to get the next page; no event is ever
        skipped, even when transactions commit out of id order.
        """
        # The cursor is checked against this log in the same statement (cursor_check).
        read = cursor_check.pg_events_after(self.schema, cursor, limit)
        return read.events(self._rows(read.query, read.args))

    # --- fleet runtime (see pglease.fleet) -------------------------------------------

    def hold(
        self, resource_type: str, key: str, owner: Owner, ttl: float, **options: Any
    ) -> AbstractContextManager[HeldLease]:
        """Hold a lease for a block: ``(async) with store.hold(type, key, owner, ttl) as
        lease:``; see `pglease.fleet.hold` (and `hold_async`)."""
        from ..fleet import hold

        return hold(self, resource_type, key, owner, ttl, **options)

    def acquire(
        self,
        resource_type: str,
        key: str,
        owner: Owner,
        ttl: float,
        timeout: float | None = None,
        **options: Any,
    ) -> Claim:
        """Wait for the lease and claim it; see `pglease.fleet.acquire` (and `acquire_async`)."""
        from ..fleet import acquire

        return acquire(self, resource_type, key, owner, ttl, timeout, **options)

    def elect(self, name: str, candidate: Owner, **options: Any) -> Election:
        """Campaign for leadership of `name`; see `pglease.fleet.elect` (and `elect_async`)."""
        from ..fleet import elect

        return elect(self, name, candidate, **options)

    def leader(self, name: str) -> Leader | None:
        """The current leader of election `name` and its generation, if any."""
        from ..fleet import leader

        return leader(self, name)

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
    ) -> Watcher:
        """Stream committed events gap-free from `after` (a cursor, "now" or "start").

        A watcher more than `max_pending` events behind the stream reads the
        missed span from the log itself (bounded memory, nothing lost). Errors
        that cannot heal, or that last `retry_window` seconds, reach the consumer
        as `WatchFailedError`; `watcher.health` tells the last error and the lag.
        `mode` defaults to "listen", or "poll" in pooler mode (where "listen" is
        refused: a pooler does not keep a LISTEN's session).
        See `pglease.watch.Watcher` (and `AsyncWatcher`)."""
        from ..watch import watch

        return watch(
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
