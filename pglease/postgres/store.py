"""`PostgresStore`: the lease store on PostgreSQL, blocking API."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from .. import cursor_check
from ..dsn import resolve_dsn
from ..errors import UnknownResourceError
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
from ._fastpath import CLAIM, RELEASE, RENEW, FastPath, from_micros
from ._reuse import ConnectionStack

if TYPE_CHECKING:
    from ..clock import Clock
    from ..fleet import Election, HeldLease, Leader
    from ..watch import Watcher
    from ..watch.hub import HubTuning

T = TypeVar("T")
Apply = Callable[[psycopg.Connection[Any]], T]


class PostgresStore:
    """Leases, revisions and the event log in one PostgreSQL schema.

    Connections come from a psycopg-pool in autocommit mode and are reused
    LIFO; claim, renew and release are one prepared-statement round trip each.
    Close the store (or use it as a context manager) to close the pool.
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
    ) -> None:
        self.schema = check_schema_name(schema)
        connect_timeout = check_positive_seconds(connect_timeout, "connect_timeout")
        self.dsn = resolve_dsn(dsn)
        self._q = Queries(schema)
        self._fast = FastPath(schema)
        # One direct connection first: a bad DSN or a down server fails fast with
        # one clear error instead of a pool retrying in the background.
        try:
            with psycopg.connect(
                self.dsn, autocommit=True, connect_timeout=math.ceil(connect_timeout)
            ) as conn:
                if auto_migrate:
                    migrate(conn, self.schema)
                else:
                    _core.require_migrated(migration_state(conn, self.schema))
        except psycopg.OperationalError as exc:
            raise _core.unavailable(exc) from exc
        self._pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            self.dsn,
            min_size=min_size,
            max_size=max_size,
            kwargs={"autocommit": True},
            open=False,
            name=f"pglease-{schema}",
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
        except BaseException:
            self._pool.close()  # stop its worker threads; the caller gets the error
            raise
        self._conns = ConnectionStack(self._pool)

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conns.drain()
        self._pool.close()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """Borrow an autocommit connection from the store's pool."""
        with self._conns.borrow() as conn:
            yield conn

    def _one(self, query: bytes, args: list[Any]) -> tuple[Any, ...]:
        with self._conns.borrow() as conn:
            try:
                row = conn.execute(query, args).fetchone()
            except psycopg.Error as exc:
                raise _core.translate(exc) or exc from None
        assert row is not None
        return tuple(row)

    def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""
        with self._conns.borrow() as conn:
            return [m.label for m in migrate(conn, self.schema)]

    def ensure_resource(self, resource_type: str, key: str) -> str:
        """Create the resource if needed and return its deterministic id (no event)."""
        return str(self._one(self._q.ensure, list(_core.ensure_args(resource_type, key)))[0])

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
        conn = self._conns.take()
        try:
            claimed, generation, expires_at, revision = self._fast.call(conn, CLAIM, args)
        finally:
            self._conns.give_back(conn)
        if claimed != b"t":
            return None
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
        conn = self._conns.take()
        try:
            expires_at, revision = self._fast.call(conn, RENEW, args)
        finally:
            self._conns.give_back(conn)
        return replace(claim, expires_at=from_micros(expires_at), revision=int(revision))

    def release(
        self, claim: Claim, expected_revision: int | None = None, *, now: datetime | None = None
    ) -> int:
        """Give up a current lease (expired or not); return the new revision."""
        args = _core.release_args(claim, expected_revision, now)
        conn = self._conns.take()
        try:
            (revision,) = self._fast.call(conn, RELEASE, args)
        finally:
            self._conns.give_back(conn)
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
        rolls everything back: no revision bump, no event, no payload.
        """
        args = _core.mutate_args(permit, event_type, payload, actor, now)
        with self._conns.borrow() as conn:
            try:
                with conn.transaction():
                    try:
                        row = conn.execute(self._q.mutate_begin, args).fetchone()
                    except psycopg.Error as exc:
                        raise _core.translate(exc) or exc from None
                    assert row is not None
                    value = apply(conn) if apply is not None else None
            except psycopg.Error as exc:
                # At COMMIT: the fence refuses a lease that expired meanwhile.
                mapped = _core.translate(exc)
                if mapped is None:
                    raise
                raise mapped from None
        return MutationResult(permit.resource_id, row[0], row[1], value)

    def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        """The resource with its lease state, judged by the database clock (or `now`)."""
        check_resource_id(resource_id)
        with self._conns.borrow() as conn:
            try:
                row = conn.execute(self._q.get, [_core.check_now(now), resource_id]).fetchone()
            except psycopg.Error as exc:
                raise _core.translate(exc) or exc from None
        if row is None:
            raise UnknownResourceError(f"unknown resource {resource_id}")
        return _core.parse_resource(row)

    def list_resources(
        self, resource_type: str | None = None, *, now: datetime | None = None
    ) -> list[ResourceState]:
        now = _core.check_now(now)
        if resource_type is not None:
            check_resource_type(resource_type)
        with self._conns.borrow() as conn:
            try:
                if resource_type is None:
                    rows = conn.execute(self._q.list_all, [now]).fetchall()
                else:
                    rows = conn.execute(self._q.list_type, [now, resource_type]).fetchall()
            except psycopg.Error as exc:
                raise _core.translate(exc) or exc from None
        return [_core.parse_resource(r) for r in rows]

    def events(self, resource_id: str, after_revision: int = 0, limit: int = 1000) -> list[Event]:
        """A resource's events in revision order, after `after_revision`."""
        args = _core.events_of_args(resource_id, after_revision, limit)
        with self._conns.borrow() as conn:
            rows = conn.execute(self._q.events_of, args).fetchall()
            if not rows and not conn.execute(self._q.resource_exists, [resource_id]).fetchone():
                raise UnknownResourceError(f"unknown resource {resource_id}")
        return [_core.parse_event(r) for r in rows]

    def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        """Committed events after `cursor` (None or "start": from the beginning).

        Pass the last event's `cursor` to get the next page; no event is ever
        skipped, even when transactions commit out of id order.
        """
        # The cursor is checked against this log in the same statement (cursor_check).
        read = cursor_check.pg_events_after(self.schema, cursor, limit)
        with self._conns.borrow() as conn:
            rows = conn.execute(read.query, read.args).fetchall()
        return read.events(rows)

    # --- fleet runtime (see pglease.fleet) -------------------------------------------

    def hold(
        self, resource_type: str, key: str, owner: Owner, ttl: float, **options: Any
    ) -> AbstractContextManager[HeldLease]:
        """``with store.hold(type, key, owner, ttl) as lease:`` see `pglease.fleet.hold`."""
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
        """Wait for the lease and claim it; see `pglease.fleet.acquire`."""
        from ..fleet import acquire

        return acquire(self, resource_type, key, owner, ttl, timeout, **options)

    def elect(self, name: str, candidate: Owner, **options: Any) -> Election:
        """Campaign for leadership of `name`; see `pglease.fleet.elect`."""
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
        mode: str = "listen",
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
        See `pglease.watch.Watcher`."""
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
