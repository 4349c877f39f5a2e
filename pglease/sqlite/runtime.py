"""The runtime driver protocol (`pglease.driver`) on one SQLite file.

Every operation that changes a lease runs in one ``BEGIN IMMEDIATE``
transaction, as the store's own claim does: holding the file's write lock is
the row lock of the PostgreSQL functions, so a check and the write it allows
cannot be separated by another writer, in this process or another. Expiry is
judged by the store clock (`clock_us`) read after the lock was taken, the
role `clock_timestamp()` plays on PostgreSQL, and reported as
`ClaimAttempt.judged_at` so waiters compute their delays on that clock.

* claim: `claim_locked`, the store's claim;
* fair claim: ``claim_fair`` of sql/functions/30_fleet.sql in Python, on the
  ``lease_waiters`` table of migration 0002;
* heartbeat: ``heartbeat`` likewise; with one writer per file no row is ever
  locked by someone else, so no lease is reported 'busy' (a beat that waits
  for the write lock past ``busy_timeout`` fails as a whole and the keeper
  retries it). The keeper's cut-off (`abort`) interrupts a running statement
  but not a wait for the write lock (sqlite3_interrupt does not end a busy
  wait): that wait is bounded by ``busy_timeout`` alone, and the keeper's
  watchdog closes trust windows on time meanwhile, as on PostgreSQL;
* changes: the store's polling watcher (`pglease.sqlite.watch`), which reads
  the file itself, so releases by other processes wake waiters too;
* reap and prune: `pglease.sqlite.maintenance`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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
from ..driver.ops import EnsureOp
from ..driver.protocol import HeartbeatStatus
from ..errors import LockTimeoutError
from ..ids import token_hash
from ..types import Claim, Owner
from . import maintenance
from ._db import clock_us, from_us, opt_from_us, ttl_us
from ._ops import _Lease, claim_locked, lock_lease

if TYPE_CHECKING:
    from .async_store import AsyncSqliteStore
    from .store import SqliteStore
    from .watch import AsyncSqliteWatcher, SqliteWatcher


def _refused(lease: _Lease, t: int, position: int, head: int | None) -> ClaimAttempt:
    holder = (
        Owner(lease.owner_type, lease.owner_id)
        if lease.owner_type is not None and lease.owner_id is not None
        else None
    )
    expires = lease.expires_at if lease.owner_id is not None else None
    return ClaimAttempt(
        False,
        lease.generation,
        opt_from_us(expires),
        lease.revision,
        holder,
        position,
        opt_from_us(head),
        from_us(t),
    )


def _enqueue(conn: sqlite3.Connection, request: ClaimRequest, t: int) -> tuple[int, int | None]:
    """Refresh (or create) the waiter's entry and drop dead ones; return its
    position (live waiters ahead) and when the head's entry runs out."""
    rid, waiter = request.resource_id, request.waiter
    assert waiter is not None and request.waiter_ttl is not None
    until = t + ttl_us(request.waiter_ttl)
    conn.execute(
        "DELETE FROM lease_waiters WHERE resource_id = ? AND expires_at <= ? AND waiter_id <> ?",
        (rid, t, waiter),
    )
    row = conn.execute(
        "UPDATE lease_waiters SET expires_at = ? WHERE waiter_id = ? AND resource_id = ?"
        " RETURNING seq",
        (until, waiter, rid),
    ).fetchone()
    if row is None:
        row = conn.execute(
            "INSERT INTO lease_waiters (waiter_id, resource_id, owner_type, owner_id,"
            " enqueued_at, expires_at) VALUES (?, ?, ?, ?, ?, ?) RETURNING seq",
            (waiter, rid, request.owner.type, request.owner.id, t, until),
        ).fetchone()
    assert row is not None
    ahead = conn.execute(
        "SELECT count(*) FROM lease_waiters WHERE resource_id = ? AND seq < ?", (rid, row[0])
    ).fetchone()
    head = conn.execute(
        "SELECT expires_at FROM lease_waiters WHERE resource_id = ? ORDER BY seq LIMIT 1", (rid,)
    ).fetchone()
    return int(ahead[0]), None if head is None else int(head[0])


def attempt_claim(store: SqliteStore, request: ClaimRequest) -> ClaimAttempt | None:
    """One claim attempt (fair: through the queue) in one write transaction;
    None when the write lock stayed taken past the store's busy_timeout."""
    owner = request.owner
    try:
        with store._db.write() as conn:
            lease = lock_lease(conn, request.resource_id)
            t = clock_us(None)  # after the lock wait, as the store's claim
            position, head = (0, None) if not request.fair else _enqueue(conn, request, t)
            if position > 0:
                return _refused(lease, t, position, head)
            taken = claim_locked(
                conn, lease, owner.type, owner.id, token_hash(request.token), request.ttl, t
            )
            if taken is None:
                return _refused(lease, t, 0, head)
            if request.fair:
                conn.execute("DELETE FROM lease_waiters WHERE waiter_id = ?", (request.waiter,))
    except LockTimeoutError:  # StoreBusyError: nothing changed, acquire retries
        return None
    generation, expires, revision = taken
    return ClaimAttempt(True, generation, from_us(expires), revision, owner, 0, None, from_us(t))


def leave_queue(store: SqliteStore, request: LeaveQueue) -> None:
    """Delete a fair waiter's queue entry."""
    with store._db.write() as conn:
        conn.execute(
            "DELETE FROM lease_waiters WHERE waiter_id = ? AND resource_id = ?",
            (request.waiter, request.resource_id),
        )


def _judge(row: Sequence[Any] | None, claim: Claim, t: int) -> HeartbeatStatus:
    if row is None:
        return "unknown"
    generation, owner_type, owner_id, token_sha, expires_at = row
    if (
        owner_id is None
        or owner_type != claim.owner.type
        or owner_id != claim.owner.id
        or generation != claim.generation
        or token_sha != token_hash(claim.token)
    ):
        return "lost"
    return "expired" if expires_at <= t else "renewed"


class SqliteHeartbeatChannel:
    """A keeper's line to the file: each beat is one write transaction."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._inflight: sqlite3.Connection | None = None
        #: The file answered once since the last `close`: `connect` is free then
        #: (the asyncio keeper calls it before every beat).
        self._checked = False

    def connect(self, timeout: float | None = None) -> None:
        # A local file: its busy_timeout bounds the check, not `timeout`.
        if self._checked:
            return
        # A closed store, a bad file or one without the runtime's tables fails here.
        with self._store._db.connection() as conn:
            conn.execute("SELECT 1 FROM lease_waiters LIMIT 0")
        self._checked = True

    def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        results: list[HeartbeatResult] = []
        with self._store._db.write() as conn:
            with self._lock:
                self._inflight = conn
            try:
                t = clock_us(None)  # after the write lock, like PostgreSQL's v_now
                # Resource-id order, the PostgreSQL beat's lock order.
                for item in sorted(batch, key=lambda i: i.claim.resource_id):
                    claim = item.claim
                    row = conn.execute(
                        "SELECT generation, owner_type, owner_id, token_sha256, expires_at"
                        " FROM leases WHERE resource_id = ?",
                        (claim.resource_id,),
                    ).fetchone()
                    status = _judge(row, claim, t)
                    expires = None
                    if status == "renewed":
                        expires = t + ttl_us(item.ttl)
                        conn.execute(
                            "UPDATE leases SET heartbeat_at = ?, expires_at = ?"
                            " WHERE resource_id = ?",
                            (t, expires, claim.resource_id),
                        )
                    results.append(
                        HeartbeatResult(
                            claim.resource_id,
                            status,
                            opt_from_us(expires),
                            None if row is None else int(row[0]),
                        )
                    )
            finally:
                with self._lock:
                    self._inflight = None
        return results

    def release(self, claim: Claim) -> None:
        self._store.release(claim)

    def abort(self) -> None:
        # Under the lock: the connection cannot be handed back to the pool (and
        # to another caller) while it is interrupted.
        with self._lock:
            if self._inflight is not None:
                self._inflight.interrupt()  # its statement fails; the beat rolls back

    def close(self) -> None:
        self._checked = False


class SqliteRuntime:
    """The runtime driver of a `SqliteStore`."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store

    # A local file has no silent network path: the store's busy_timeout bounds
    # every wait, so the runtime's `timeout` adds nothing here.

    def ensure_resource(self, op: EnsureOp, timeout: float | None = None) -> str:
        return self._store.ensure_resource(op.resource_type, op.key)

    def attempt_claim(
        self, request: ClaimRequest, timeout: float | None = None
    ) -> ClaimAttempt | None:
        return attempt_claim(self._store, request)

    def leave_queue(self, request: LeaveQueue, timeout: float | None = None) -> None:
        leave_queue(self._store, request)

    def heartbeat_channel(self, connect_timeout: float) -> SqliteHeartbeatChannel:
        return SqliteHeartbeatChannel(self._store)

    def changes(self, resource_id: str, event_types: Sequence[str]) -> SqliteWatcher:
        return self._store.watch(after="now", resources=resource_id, event_types=event_types)

    def reap(self, request: ReapRequest) -> ReapReport:
        return maintenance.reap(self._store._db, request)

    def prune(self, request: PruneRequest) -> PruneReport:
        return maintenance.prune(self._store._db, request)


class AsyncSqliteHeartbeatChannel:
    """The asyncio twin: each call runs the blocking line in a worker thread."""

    def __init__(self, store: AsyncSqliteStore) -> None:
        self._store = store
        self._line: SqliteHeartbeatChannel | None = None

    def _sync(self) -> SqliteHeartbeatChannel:
        if self._line is None:
            self._line = SqliteHeartbeatChannel(self._store.sync_store)
        return self._line

    async def connect(self, timeout: float | None = None) -> None:
        line = self._sync()
        if not line._checked:
            await asyncio.to_thread(line.connect)

    async def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        return await asyncio.to_thread(self._sync().heartbeat, batch)

    async def release(self, claim: Claim) -> None:
        await self._store.release(claim)

    def abort(self) -> None:
        if self._line is not None:
            self._line.abort()

    async def close(self) -> None:
        if self._line is not None:
            self._line.close()


class AsyncSqliteRuntime:
    """The runtime driver of an `AsyncSqliteStore` (blocking work in worker threads)."""

    def __init__(self, store: AsyncSqliteStore) -> None:
        self._store = store

    async def ensure_resource(self, op: EnsureOp, timeout: float | None = None) -> str:
        return await self._store.ensure_resource(op.resource_type, op.key)

    async def attempt_claim(
        self, request: ClaimRequest, timeout: float | None = None
    ) -> ClaimAttempt | None:
        return await asyncio.to_thread(attempt_claim, self._store.sync_store, request)

    async def leave_queue(self, request: LeaveQueue, timeout: float | None = None) -> None:
        await asyncio.to_thread(leave_queue, self._store.sync_store, request)

    def heartbeat_channel(self, connect_timeout: float) -> AsyncSqliteHeartbeatChannel:
        return AsyncSqliteHeartbeatChannel(self._store)

    async def changes(self, resource_id: str, event_types: Sequence[str]) -> AsyncSqliteWatcher:
        watcher = self._store.watch(after="now", resources=resource_id, event_types=event_types)
        return await watcher.start()

    async def reap(self, request: ReapRequest) -> ReapReport:
        return await asyncio.to_thread(maintenance.reap, self._store.sync_store._db, request)

    async def prune(self, request: PruneRequest) -> PruneReport:
        return await asyncio.to_thread(maintenance.prune, self._store.sync_store._db, request)


if TYPE_CHECKING:
    # mypy checks here that both drivers implement the protocol.
    def _sync_driver(driver: SqliteRuntime) -> RuntimeDriver:
        return driver

    def _async_driver(driver: AsyncSqliteRuntime) -> AsyncRuntimeDriver:
        return driver

    def _sync_maintenance(driver: SqliteRuntime) -> MaintenanceDriver:
        return driver

    def _async_maintenance(driver: AsyncSqliteRuntime) -> AsyncMaintenanceDriver:
        return driver
