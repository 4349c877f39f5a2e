"""The runtime drivers of the PostgreSQL stores, asyncio source of `_runtime.py`
(see `pglease.postgres.runtime` for what they do and how keeper lines are set up)."""

from __future__ import annotations

import asyncio
import contextlib
import time
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
from ..driver.ops import EnsureOp
from ..errors import DatabaseUnavailableError, LeaseLostError, LockTimeoutError
from ..types import Claim
from . import _core, maintenance
from ._runtime_core import (
    _CONNECT_FAILED,
    SESSION_SETUP,
    FleetQueries,
    _abort,
    _attempt,
    _attempt_error,
    _batch_args,
    _busy,
    _checkout_error,
    _claim_query,
    _connect_error,
    _connect_kwargs,
    _limit,
    _limits,
    _no_answer,
    _raise,
    _release_args,
    _rest,
    _results,
    _stalled,
    _until,
    log,
)
from ._stall import arm_async

# sync: import threading


#: The least a keeper line's setup round trip is given after a slow connect
#: (seconds): an answer on its way still counts, a silent path is cut at once.
_SETUP_FLOOR = 0.05


def _still_connecting(limit: float) -> DatabaseUnavailableError:
    return DatabaseUnavailableError(
        f"{_CONNECT_FAILED}: another attempt to connect was still running after {limit:g} s"
    )


class AsyncPgHeartbeatChannel:
    """A keeper's dedicated connection (see `pglease.postgres.runtime`)."""

    def __init__(self, dsn: str, schema: str, pooler: bool, connect_timeout: float) -> None:
        self._dsn = dsn
        self._schema = schema
        self._pooler = pooler
        self._connect_timeout = connect_timeout
        self._q = FleetQueries(schema)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # One opening at a time: `connect` runs in the holder's thread (task),
        # beats in the keeper's; `abort` (the watchdog's) never takes it.
        self._lock = asyncio.Lock()  # sync: self._lock = threading.Lock()
        #: Failed connects so far, and the last one's error (callers that waited
        #: for that attempt take its answer: see `_connection`).
        self._failures = 0
        self._failure = ""

    def _failed(self, exc: BaseException) -> None:
        self._failures += 1
        self._failure = str(exc) or type(exc).__name__

    async def connect(self, timeout: float | None = None) -> None:
        await self._connection(timeout)

    async def _connection(self, timeout: float | None = None) -> psycopg.AsyncConnection[Any]:
        """The open connection, else a new one within the connect timeout
        (`timeout`, when given, shortens it, and the wait for another caller's
        connect in progress: an acquire's time left)."""
        limit = self._connect_timeout if timeout is None else min(timeout, self._connect_timeout)
        wait = -1.0 if timeout is None else limit  # -1: for as long as it takes
        began = time.monotonic()
        failures = self._failures
        # async-only: begin
        try:
            async with asyncio.timeout(None if wait < 0 else wait):
                await self._lock.acquire()
        except TimeoutError:
            raise _still_connecting(limit) from None
        # async-only: end
        # sync: if not self._lock.acquire(timeout=wait): raise _still_connecting(limit)
        try:
            if timeout is not None and (self._conn is None or self._conn.closed):
                # A caller's limit covers the wait for the lock too: what is left
                # of it bounds the connect.
                if self._failures != failures:
                    # The attempt waited for just failed: another now would
                    # double the caller's wait for the same answer.
                    raise DatabaseUnavailableError(
                        f"{_CONNECT_FAILED}: another attempt to connect failed meanwhile"
                        f" ({self._failure})"
                    )
                left = limit - (time.monotonic() - began)
                if left <= 0:
                    raise _still_connecting(limit)
                limit = left
            return await self._open(limit, timeout is not None)
        finally:
            self._lock.release()

    async def _open(self, limit: float, exact: bool) -> psycopg.AsyncConnection[Any]:
        """The open connection, else a new one within `limit` (lock held);
        `exact`: the limit is a caller's, not the line's own connect_timeout."""
        if self._conn is None or self._conn.closed:
            self._conn = None
            began = time.monotonic()
            try:
                kwargs = _connect_kwargs(limit, self._schema, self._pooler)
                # async-only: begin
                # A client-side bound too: psycopg's connect_timeout is per attempt.
                async with asyncio.timeout(limit if exact else limit + 1):
                    conn = await psycopg.AsyncConnection.connect(self._dsn, **kwargs)
                # async-only: end
                # sync: conn = psycopg.connect(self._dsn, **kwargs)
            except psycopg.Error as exc:
                self._failed(exc)
                _raise(_connect_error(exc, self._dsn), exc)
            # async-only: begin
            except TimeoutError as exc:
                self._failed(exc)
                raise DatabaseUnavailableError(
                    f"{_CONNECT_FAILED}: no answer within {limit:g} s"
                ) from exc
            # async-only: end
            # The setup is a round trip too: bounded by what the connect left of
            # the limit (a caller's limit is for both together).
            rest = (limit if exact else limit + 1) - (time.monotonic() - began)
            deadline = arm_async(conn, max(rest, _SETUP_FLOOR))
            try:
                if not self._pooler:
                    await conn.execute(SESSION_SETUP)
            except psycopg.Error as exc:
                fired = deadline is not None and deadline.fired
                if deadline is not None:
                    deadline.cancel()  # before the socket goes with the connection
                await conn.close()
                self._failed(exc)
                _raise(_connect_error(_no_answer(exc, limit) if fired else exc, self._dsn), exc)
            finally:
                if deadline is not None:
                    deadline.cancel()
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
        async with self._lock:  # not while another caller is opening one
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 1.0)  # sync: conn.close()


def _borrow(store: Any, timeout: float | None) -> Any:
    """A connection of the store's pool for one runtime call, waiting at most
    `timeout` (when shorter than pool_timeout) for the pool: an acquire's time
    left bounds the checkout too. A PoolTimeout then says nothing was sent."""
    return store._driver.connection(timeout)


class AsyncPgRuntime:
    """The runtime driver of `AsyncPostgresStore` (or of anything with ``dsn``
    and ``schema``, for a keeper alone)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._q = FleetQueries(store.schema)

    async def ensure_resource(self, op: EnsureOp, timeout: float | None = None) -> str:
        store = self._store
        args = [op.resource_type, op.key]
        limit = _limit(store, timeout)
        until = _until(limit)  # the checkouts and round trips together
        for attempt in (1, 2):
            try:
                async with _borrow(store, _rest(until, limit)) as conn:
                    deadline = arm_async(conn, _rest(until, limit))
                    try:
                        if (bound := _core.pooler_local_limits(store)) is None:
                            row = await (await conn.execute(self._q.ensure, args)).fetchone()
                        else:
                            async with conn.pipeline(), conn.transaction():
                                await conn.execute(bound)
                                row = await (await conn.execute(self._q.ensure, args)).fetchone()
                    except psycopg.Error as exc:
                        if deadline is not None and deadline.fired:  # a silent path: no retry
                            _raise(_stalled(exc, deadline.seconds, store.dsn), exc)
                        if conn.broken and attempt == 1:
                            continue  # idempotent: once more on a fresh connection
                        _raise(_core.driver_error(exc, _limits(store), store.dsn), exc)
                    finally:
                        if deadline is not None:
                            deadline.cancel()  # before the connection (and its socket) goes
            except psycopg.Error as exc:  # checking a connection out: nothing was sent
                _raise(_checkout_error(exc, store, limit), exc)
            assert row is not None  # the statement always returns the id
            return str(row[0])
        raise AssertionError("unreachable")

    async def attempt_claim(
        self, request: ClaimRequest, timeout: float | None = None
    ) -> ClaimAttempt | None:
        store = self._store
        query, args = _claim_query(self._q, request)
        limit = _limit(store, timeout)
        until = _until(limit)  # the checkout and the round trip together
        try:
            async with _borrow(store, limit) as conn:
                # No answer by the limit: the socket is shut down (`_stall`), and
                # the claim's outcome is unknown (it may have committed). A
                # checkout that used the whole limit sends nothing.
                deadline = arm_async(conn, _rest(until, limit))
                try:
                    if (bound := _core.pooler_local_limits(store)) is None:
                        row = await (await conn.execute(query, args)).fetchone()
                    else:
                        # BEGIN, the limits and the claim in one round trip, then COMMIT.
                        async with conn.pipeline(), conn.transaction():
                            await conn.execute(bound)
                            row = await (await conn.execute(query, args)).fetchone()
                except psycopg.Error as exc:
                    if deadline is not None and deadline.fired:
                        unanswered = _no_answer(exc, deadline.seconds)
                        _raise(_attempt_error(unanswered, True, store, request), exc)
                    if _busy(exc):
                        log.debug("acquire %s: lease row locked, retrying", request.resource_id)
                        return None
                    _raise(_attempt_error(exc, conn.broken, store, request), exc)
                finally:
                    if deadline is not None:
                        deadline.cancel()  # before the connection (and its socket) goes
        except psycopg.Error as exc:  # checking a connection out: nothing was sent
            _raise(_checkout_error(exc, store, limit), exc)
        except LockTimeoutError:  # a store that words 55P03 itself
            return None
        assert row is not None
        return _attempt(row)

    async def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        """One heartbeat through the store's pool, for a lease its owner keeps alive
        itself (a session's writer lease): like the keeper's, it extends only the
        expiry, bumps no revision and writes no event."""
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

    async def leave_queue(self, request: LeaveQueue, timeout: float | None = None) -> None:
        store = self._store
        limit = _limit(store, timeout)
        until = _until(limit)  # the checkout and the round trip together
        try:
            async with _borrow(store, limit) as conn:
                deadline = arm_async(conn, _rest(until, limit))
                try:
                    await conn.execute(self._q.leave_queue, [request.waiter])
                except psycopg.Error as exc:
                    if deadline is not None and deadline.fired:
                        _raise(_stalled(exc, deadline.seconds, store.dsn), exc)
                    raise
                finally:
                    if deadline is not None:
                        deadline.cancel()
        except psycopg.Error as exc:
            _raise(_checkout_error(exc, store, limit), exc)

    def heartbeat_channel(self, connect_timeout: float) -> AsyncPgHeartbeatChannel:
        store = self._store
        pooler = bool(getattr(store, "pooler", False))
        return AsyncPgHeartbeatChannel(store.dsn, store.schema, pooler, connect_timeout)

    async def changes(self, resource_id: str, event_types: Sequence[str]) -> Any:
        # The store's watcher: LISTEN/NOTIFY wake-ups on the process's hub.
        watcher = self._store.watch(after="now", resources=resource_id, event_types=event_types)
        return await watcher.start()  # sync: return watcher

    async def reap(self, request: ReapRequest) -> ReapReport:
        return await maintenance.reap_async(self._store, request)

    async def prune(self, request: PruneRequest) -> PruneReport:
        return await maintenance.prune_async(self._store, request)
