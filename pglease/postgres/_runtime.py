# Generated from pglease/postgres/_runtime_async.py by tools/async_to_sync.py: do not edit.
"""The runtime drivers of the PostgreSQL stores, asyncio source of `_runtime.py`
(see `pglease.postgres.runtime` for what they do and how keeper lines are set up)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import psycopg

from ..driver import (
    ClaimAttempt,
    ClaimRequest,
    HeartbeatItem,
    HeartbeatResult,
    LeaveQueue,
    PruneReport,
    PruneRequest,
    ReapReport,
    ReapRequest,
)
from ..errors import LeaseLostError, LockTimeoutError
from ..types import Claim
from . import _core, maintenance
from ._runtime_core import (
    SESSION_SETUP,
    FleetQueries,
    _abort,
    _attempt,
    _attempt_error,
    _batch_args,
    _busy,
    _claim_query,
    _connect_error,
    _connect_kwargs,
    _limits,
    _raise,
    _release_args,
    _results,
    log,
)


class PgHeartbeatChannel:
    """A keeper's dedicated connection (see `pglease.postgres.runtime`)."""

    def __init__(self, dsn: str, schema: str, pooler: bool, connect_timeout: float) -> None:
        self._dsn = dsn
        self._schema = schema
        self._pooler = pooler
        self._connect_timeout = connect_timeout
        self._q = FleetQueries(schema)
        self._conn: psycopg.Connection[Any] | None = None
        # One opening at a time: `connect` runs in the holder's thread (task),
        # beats in the keeper's; `abort` (the watchdog's) never takes it.
        self._lock = threading.Lock()

    def connect(self) -> None:
        self._connection()

    def _connection(self) -> psycopg.Connection[Any]:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = None
                try:
                    kwargs = _connect_kwargs(self._connect_timeout, self._schema, self._pooler)
                    conn = psycopg.connect(self._dsn, **kwargs)
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
            cur = conn.execute(self._q.heartbeat, _batch_args(batch))
            rows = cur.fetchall()
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
        with self._lock:  # not while another caller is opening one
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class PgRuntime:
    """The runtime driver of `AsyncPostgresStore` (or of anything with ``dsn``
    and ``schema``, for a keeper alone)."""

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
        watcher = self._store.watch(after="now", resources=resource_id, event_types=event_types)
        return watcher

    def reap(self, request: ReapRequest) -> ReapReport:
        return maintenance.reap(self._store, request)

    def prune(self, request: PruneRequest) -> PruneReport:
        return maintenance.prune(self._store, request)
