"""What the PostgreSQL reaper and prune (`pglease.watch.reaper`, `.prune`) need
of a store: its DSN, schema and pooled connections. (The watchers need only
a log reader: `pglease.watch._watcher_base.WatchedStore`.)"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

import psycopg


class Store(Protocol):
    """A blocking PostgreSQL store, as the reaper and prune use it."""

    dsn: str
    schema: str

    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...


class AsyncStore(Protocol):
    """An asyncio PostgreSQL store, as the reaper and prune use it."""

    dsn: str
    schema: str

    def connection(self) -> AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]: ...
