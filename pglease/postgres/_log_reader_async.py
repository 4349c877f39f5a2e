"""`AsyncPgLogReader`, written once: the source of the blocking `PgLogReader`.

The listen protocol's log reader (`pglease.driver.listen_async`) for a
PostgreSQL store: a watcher's start and catch-up pages run on the store's
own pooled connections; the hub's listener (`_listen.PgChangeListener`) gets
a dedicated one. Each is bounded by the watcher's stall timeout (`_stall`):
a pooled connection that got no answer is shut down, and the pool replaces it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import psycopg
from psycopg_pool import PoolClosed

from .. import cursor_check
from ..cursors import Cursor
from ..driver.listen_ops import ListenRequest, LogPage, PageOp, StartPoint
from ..errors import WatchClosedError
from ._core import driver_error
from ._listen import PgChangeListener
from ._stall import arm_async
from ._watch_sql import (
    WatchQueries,
    log_read_error,
    parse_page,
    read_args,
    silence,
    silence_error,
)

if TYPE_CHECKING:
    from ..driver.listen import ChangeListener
    from ..driver.listen_async import AsyncLogReader
    from .async_store import AsyncPostgresStore  # sync: from .store import PostgresStore

#: What the errors of a catch-up read say failed.
_WHAT = "a watcher's catch-up read"
#: Where a stall was, in the error that names it.
_WHERE = "a watcher's connection"


class AsyncPgLogReader:
    """An `AsyncLogReader` over one store's pool."""

    def __init__(self, store: AsyncPostgresStore) -> None:
        self._store = store
        self._q = WatchQueries(store.schema)

    @property
    def source(self) -> str:
        return self._store.dsn

    @property
    def schema(self) -> str:
        return self._store.schema

    @property
    def pooler(self) -> bool:
        return self._store.pooler

    async def start(self, cursor: Cursor | None, stall_timeout: float | None = None) -> StartPoint:
        queries = cursor_check.pg_queries(self._store.schema)
        if cursor is None:
            query, args = queries.now, []
        else:
            query, args = queries.check, cursor_check.pg_check_args(cursor)
        try:
            async with self._store.connection() as conn:
                deadline = arm_async(conn, stall_timeout)
                try:
                    cur = await conn.execute(query, args)
                    row = await cur.fetchone()
                except psycopg.Error as exc:
                    if deadline is not None and deadline.fired:
                        raise silence(exc, deadline.seconds, _WHERE) from exc
                    raise
                finally:
                    if deadline is not None:
                        deadline.cancel()  # before the connection goes back to the pool
        except psycopg.Error as exc:
            # Nothing to retry yet: the caller learns at once (closed store,
            # server away, privileges), as from any other store call.
            raise driver_error(exc, dsn=self._store.dsn) from exc
        assert row is not None  # both queries return one row
        if cursor is None:
            position, check = cursor_check.pg_now(row)
            return StartPoint(position, check)
        cursor_check.pg_verify(cursor, row, refuse_expired=False)
        return StartPoint(cursor.position, cursor.check)

    async def read_log(self, op: PageOp) -> LogPage:
        try:
            async with self._store.connection() as conn:
                deadline = arm_async(conn, op.stall_timeout)
                try:
                    cur = await conn.execute(self._q.read, read_args(op.after, op.upto, op.limit))
                    rows = await cur.fetchall()
                except psycopg.Error as exc:
                    if deadline is not None and deadline.fired:
                        cause = silence(exc, deadline.seconds, _WHERE)
                        raise silence_error(cause, _WHAT) from cause
                    raise
                finally:
                    if deadline is not None:
                        deadline.cancel()  # before the connection goes back to the pool
        except PoolClosed:
            raise WatchClosedError("the store was closed") from None
        except psycopg.Error as exc:
            raise log_read_error(exc, _WHAT) from exc
        return parse_page(rows, op.limit)

    def listener(self, request: ListenRequest) -> PgChangeListener:
        return PgChangeListener(request)


if TYPE_CHECKING:

    def _implements(
        reader: AsyncPgLogReader, listener: PgChangeListener
    ) -> tuple[AsyncLogReader, ChangeListener]:
        """mypy proves here that both implement the listen protocol."""
        return reader, listener
