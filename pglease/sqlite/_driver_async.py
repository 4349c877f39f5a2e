"""The SQLite store driver (`pglease.driver.store`), written once.

`AsyncSqliteDriver` is the asyncio source and `SqliteDriver` in
`pglease/sqlite/_driver.py` its generated blocking twin. The sqlite3 work
itself is the plain blocking functions of `_ops`; each operation reaches
them through one hop, ``await to_thread(op, ...)`` (`pglease._compat_async`),
which runs them in a worker thread here (the event loop stays free while a
call waits for the file's write lock) and is a direct call in the twin.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any, Self

from .._compat_async import to_thread
from ..driver import ops
from ..errors import LeaseLostError, StoreClosedError
from ..types import Claim, Event, MutationResult, ResourceState
from . import _ops
from ._db import Database, check_busy_timeout, check_path

_NOT_OPEN = "the store is not open (use `await AsyncSqliteStore.open()`)"


class AsyncSqliteDriver:
    """The store driver on one SQLite file (WAL mode): a small pool of autocommit
    connections (`_db.Database`), every write one ``BEGIN IMMEDIATE ... COMMIT``.
    The arguments are `AsyncSqliteStore`'s."""

    def __init__(self, path: object, busy_timeout: object, auto_migrate: bool) -> None:
        self.path = check_path(path)
        self.busy_timeout = check_busy_timeout(busy_timeout)
        self._auto_migrate = auto_migrate
        self._db: Database | None = None

    @classmethod
    def sharing(cls, db: Database) -> Self:
        """A driver over a `Database` another driver opened (and closes)."""
        driver = cls(db.path, db.busy_timeout, auto_migrate=False)
        driver._db = db
        return driver

    @property
    def db(self) -> Database:
        """The open file's connections (StoreClosedError before `open`)."""
        if self._db is None:
            raise StoreClosedError(_NOT_OPEN)
        return self._db

    async def open(self) -> None:
        if self._db is None:
            self._db = await to_thread(
                _ops.open_database, self.path, self.busy_timeout, self._auto_migrate
            )

    async def close(self) -> None:
        """Close every pooled connection; connections in use close when returned."""
        if self._db is not None:
            db = self._db
            # A blocking store keeps its Database: a call after close then gets
            # its StoreClosedError ("the store is closed").
            self._db = None  # sync: -
            await to_thread(db.close)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[sqlite3.Connection]:
        """An autocommit connection whose statements' errors stay sqlite3's; its
        calls block, keep them short on an event loop."""
        with self.db.raw_connection() as conn:
            yield conn

    async def migrate(self) -> list[str]:
        return await to_thread(_ops.migrate, self.db)

    async def ensure_resource(self, op: ops.EnsureOp) -> str:
        return await to_thread(_ops.ensure_resource, self.db, op)

    async def claim(self, op: ops.ClaimOp) -> Claim | None:
        return await to_thread(_ops.claim, self.db, op)

    async def renew(self, op: ops.RenewOp) -> Claim:
        return await to_thread(_ops.renew, self.db, op)

    async def release(self, op: ops.ReleaseOp) -> int:
        return await to_thread(_ops.release, self.db, op)

    async def claim_many(self, op: ops.ClaimManyOp) -> list[Claim | None]:
        return await to_thread(_ops.claim_many, self.db, op)

    async def renew_many(self, op: ops.RenewManyOp) -> list[Claim | LeaseLostError]:
        return await to_thread(_ops.renew_many, self.db, op)

    async def release_many(self, op: ops.ReleaseManyOp) -> list[int | LeaseLostError]:
        return await to_thread(_ops.release_many, self.db, op)

    async def mutate(
        self, op: ops.MutateOp, apply: Callable[[sqlite3.Connection], Awaitable[Any]] | None
    ) -> MutationResult:
        """One write transaction (`_ops.mutate`). Under asyncio it runs in a worker
        thread and `apply` on the event loop, with the same connection, while
        the thread waits (`_bridged`)."""
        db = self.db
        # async-only: begin
        if apply is not None:
            return await _bridged(db, op, apply)
        # async-only: end
        return await to_thread(_ops.mutate, db, op, apply)

    async def get(self, op: ops.GetOp) -> ResourceState:
        return await to_thread(_ops.get, self.db, op)

    async def list_resources(self, op: ops.ListOp) -> list[ResourceState]:
        return await to_thread(_ops.list_resources, self.db, op)

    async def events(self, op: ops.EventsOp) -> list[Event]:
        return await to_thread(_ops.events, self.db, op)

    async def read_log(self, op: ops.ReadLogOp) -> list[Event]:
        return await to_thread(_ops.read_log, self.db, op)

    # --- a watcher's reads (pglease.sqlite.watch) ---------------------------------------

    async def now_cursor(self) -> str:
        return await to_thread(_ops.now_cursor, self.db)

    async def check_cursor(self, cursor: str) -> None:
        await to_thread(_ops.check_cursor, self.db, cursor)

    async def events_after_id(self, event_id: int, limit: int) -> list[Event]:
        return await to_thread(_ops.events_after_id, self.db, event_id, limit)


# async-only: begin
async def _bridged(
    db: Database, op: ops.MutateOp, apply: Callable[[sqlite3.Connection], Awaitable[Any]]
) -> MutationResult:
    """Run the mutation in a worker thread with `apply` on this event loop.

    The thread waits while `apply` runs, so its SQL commits atomically with the
    revision bump and the event. Cancelling the call before `apply` has finished
    rolls the transaction back; once COMMIT has started it completes and the
    caller just does not see the result.
    """
    loop = asyncio.get_running_loop()
    cancelled = threading.Event()
    running: list[Future[Any]] = []

    async def call(conn: sqlite3.Connection) -> Any:
        return await apply(conn)

    def bridge(conn: sqlite3.Connection) -> Any:
        if cancelled.is_set():
            raise asyncio.CancelledError
        future = asyncio.run_coroutine_threadsafe(call(conn), loop)
        running.append(future)
        # Checked after the append: a cancellation that set the flag before it
        # did not see this future in `running`, so cancel it here.
        if cancelled.is_set():
            future.cancel()
        return future.result()

    try:
        return await asyncio.to_thread(_ops.mutate, db, op, bridge)
    except asyncio.CancelledError:
        # The worker thread cannot be interrupted, but it can be told to roll back:
        # set the flag first, then cancel whatever apply already runs.
        cancelled.set()
        for future in list(running):
            future.cancel()
        raise


# async-only: end
