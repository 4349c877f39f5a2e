"""PostgreSQL store: sync `PostgresStore` and asyncio `AsyncPostgresStore`."""

from .async_store import AsyncPostgresStore
from .store import PostgresStore

__all__ = ["AsyncPostgresStore", "PostgresStore"]
