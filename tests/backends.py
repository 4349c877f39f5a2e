"""One face for every store backend, so a single conformance suite runs against all.

`Backend.store` exposes the blocking store API. For asyncio stores it is a thin
bridge that runs each call on a private event loop, so the async twin is
exercised through exactly the same test bodies.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import psycopg

from pglease import AsyncPostgresStore, PostgresStore
from pglease.testing import set_test_clock


class LoopThread:
    """An event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class AsyncBridge:
    """Blocking facade over an async store; `mutate`'s apply is adapted by the backend."""

    def __init__(self, store: Any, loop: LoopThread) -> None:
        self._store = store
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run(attr(*args, **kwargs))

        return call


class Backend:
    """A store plus the dialect bits a test needs for `mutate`'s own SQL."""

    name: str
    is_async: bool
    store: Any

    def side_table(self) -> None:
        raise NotImplementedError

    def insert_apply(self, value: str) -> Callable[..., Any]:
        """An `apply` callback inserting `value` into the side table; returns "ok"."""
        raise NotImplementedError

    def failing_apply(self, value: str) -> Callable[..., Any]:
        """An `apply` that inserts `value` and then raises RuntimeError."""
        raise NotImplementedError

    def side_rows(self) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class PostgresBackend(Backend):
    def __init__(self, dsn: str, schema: str, *, is_async: bool) -> None:
        self.dsn = dsn
        self.schema = schema
        self.is_async = is_async
        self.name = "postgres-async" if is_async else "postgres"
        if is_async:
            self._loop: LoopThread | None = LoopThread()
            astore = self._loop.run(AsyncPostgresStore.open(dsn, schema=schema, max_size=8))
            self.store = AsyncBridge(astore, self._loop)
        else:
            self._loop = None
            self.store = PostgresStore(dsn, schema=schema, max_size=8)
        # The conformance suite places calls at chosen instants with `now=`.
        with psycopg.connect(dsn, autocommit=True) as conn:
            set_test_clock(conn, schema)

    def _sql(self, text: str) -> str:
        return text.replace("side", f'"{self.schema}".side')

    def side_table(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(self._sql("CREATE TABLE side (value text PRIMARY KEY)"))

    def insert_apply(self, value: str) -> Callable[..., Any]:
        query = self._sql("INSERT INTO side (value) VALUES (%s)")
        if self.is_async:

            async def apply_async(conn: psycopg.AsyncConnection[Any]) -> str:
                await conn.execute(query, [value])
                return "ok"

            return apply_async

        def apply(conn: psycopg.Connection[Any]) -> str:
            conn.execute(query, [value])
            return "ok"

        return apply

    def failing_apply(self, value: str) -> Callable[..., Any]:
        insert = self.insert_apply(value)
        if self.is_async:

            async def fail_async(conn: psycopg.AsyncConnection[Any]) -> str:
                await insert(conn)
                raise RuntimeError("apply failed on purpose")

            return fail_async

        def fail(conn: psycopg.Connection[Any]) -> str:
            insert(conn)
            raise RuntimeError("apply failed on purpose")

        return fail

    def side_rows(self) -> list[str]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(self._sql("SELECT value FROM side ORDER BY value")).fetchall()
        return [r[0] for r in rows]

    def payload_count(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(f'SELECT count(*) FROM "{self.schema}".payloads').fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        self.store.close()
        if self._loop is not None:
            self._loop.close()


class SqliteBackend(Backend):
    """`SqliteStore` / `AsyncSqliteStore` on a fresh file; `apply` gets a sqlite3 connection."""

    def __init__(self, path: str, *, is_async: bool) -> None:
        from pglease.sqlite import AsyncSqliteStore, SqliteStore

        self.path = path
        self.is_async = is_async
        self.name = "sqlite-async" if is_async else "sqlite"
        if is_async:
            self._loop: LoopThread | None = LoopThread()
            astore = self._loop.run(AsyncSqliteStore.open(path))
            self.store = AsyncBridge(astore, self._loop)
        else:
            self._loop = None
            self.store = SqliteStore(path)

    def _query(self, text: str) -> list[Any]:
        import sqlite3

        conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            return conn.execute(text).fetchall()
        finally:
            conn.close()

    def side_table(self) -> None:
        self._query("CREATE TABLE side (value TEXT PRIMARY KEY)")

    def insert_apply(self, value: str) -> Callable[..., Any]:
        import sqlite3

        query = "INSERT INTO side (value) VALUES (?)"
        if self.is_async:

            async def apply_async(conn: sqlite3.Connection) -> str:
                conn.execute(query, (value,))
                return "ok"

            return apply_async

        def apply(conn: sqlite3.Connection) -> str:
            conn.execute(query, (value,))
            return "ok"

        return apply

    def failing_apply(self, value: str) -> Callable[..., Any]:
        import sqlite3

        insert = self.insert_apply(value)
        if self.is_async:

            async def fail_async(conn: sqlite3.Connection) -> str:
                await insert(conn)
                raise RuntimeError("apply failed on purpose")

            return fail_async

        def fail(conn: sqlite3.Connection) -> str:
            insert(conn)
            raise RuntimeError("apply failed on purpose")

        return fail

    def side_rows(self) -> list[str]:
        return [r[0] for r in self._query("SELECT value FROM side ORDER BY value")]

    def payload_count(self) -> int:
        return int(self._query("SELECT count(*) FROM payloads")[0][0])

    def close(self) -> None:
        self.store.close()
        if self._loop is not None:
            self._loop.close()
