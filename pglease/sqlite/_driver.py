# Generated from pglease/sqlite/_driver_async.py by tools/async_to_sync.py: do not edit.
"""The SQLite store driver (`pglease.driver.store`), written once.

`AsyncSqliteDriver` is the asyncio source and `SqliteDriver` in
`pglease/sqlite/_driver.py` its generated blocking twin. The sqlite3 work
itself is the plain blocking functions of `_ops`; each operation reaches
them through one hop, ``await to_thread(op, ...)`` (`pglease._compat_async`),
which runs them in a worker thread here (the event loop stays free while a
call waits for the file's write lock) and is a direct call in the twin.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

from .._compat import to_thread
from ..driver import ops
from ..errors import LeaseLostError, StoreClosedError
from ..types import Claim, Event, MutationResult, ResourceState
from . import _ops
from ._db import Database, check_busy_timeout, check_path

_NOT_OPEN = "the store is not open (use `await AsyncSqliteStore.open()`)"


class SqliteDriver:
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

    def open(self) -> None:
        if self._db is None:
            self._db = to_thread(
                _ops.open_database, self.path, self.busy_timeout, self._auto_migrate
            )

    def close(self) -> None:
        """Close every pooled connection; connections in use close when returned."""
        if self._db is not None:
            db = self._db
            # A blocking store keeps its Database: a call after close then gets
            # its StoreClosedError ("the store is closed").
            to_thread(db.close)

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """An autocommit connection whose statements' errors stay sqlite3's; its
        calls block, keep them short on an event loop."""
        with self.db.raw_connection() as conn:
            yield conn

    def migrate(self) -> list[str]:
        return to_thread(_ops.migrate, self.db)

    def ensure_resource(self, op: ops.EnsureOp) -> str:
        return to_thread(_ops.ensure_resource, self.db, op)

    def claim(self, op: ops.ClaimOp) -> Claim | None:
        return to_thread(_ops.claim, self.db, op)

    def renew(self, op: ops.RenewOp) -> Claim:
        return to_thread(_ops.renew, self.db, op)

    def release(self, op: ops.ReleaseOp) -> int:
        return to_thread(_ops.release, self.db, op)

    def claim_many(self, op: ops.ClaimManyOp) -> list[Claim | None]:
        return to_thread(_ops.claim_many, self.db, op)

    def renew_many(self, op: ops.RenewManyOp) -> list[Claim | LeaseLostError]:
        return to_thread(_ops.renew_many, self.db, op)

    def release_many(self, op: ops.ReleaseManyOp) -> list[int | LeaseLostError]:
        return to_thread(_ops.release_many, self.db, op)

    def mutate(
        self, op: ops.MutateOp, apply: Callable[[sqlite3.Connection], Any] | None
    ) -> MutationResult:
        """One write transaction (`_ops.mutate`). Under asyncio it runs in a worker
        thread and `apply` on the event loop, with the same connection, while
        the thread waits (`_bridged`)."""
        db = self.db
        return to_thread(_ops.mutate, db, op, apply)

    def get(self, op: ops.GetOp) -> ResourceState:
        return to_thread(_ops.get, self.db, op)

    def list_resources(self, op: ops.ListOp) -> list[ResourceState]:
        return to_thread(_ops.list_resources, self.db, op)

    def events(self, op: ops.EventsOp) -> list[Event]:
        return to_thread(_ops.events, self.db, op)

    def read_log(self, op: ops.ReadLogOp) -> list[Event]:
        return to_thread(_ops.read_log, self.db, op)

    # --- a watcher's reads (pglease.sqlite.watch) ---------------------------------------

    def now_cursor(self) -> str:
        return to_thread(_ops.now_cursor, self.db)

    def check_cursor(self, cursor: str) -> None:
        to_thread(_ops.check_cursor, self.db, cursor)

    def events_after_id(self, event_id: int, limit: int) -> list[Event]:
        return to_thread(_ops.events_after_id, self.db, event_id, limit)
