"""SQLite store: sync `SqliteStore` and asyncio `AsyncSqliteStore` on one local file."""

from ._db import SqliteFileError
from .async_store import AsyncSqliteStore
from .store import SqliteStore

__all__ = ["AsyncSqliteStore", "SqliteFileError", "SqliteStore"]
