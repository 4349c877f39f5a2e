"""Session files for asyncio: `AsyncSessionRepository` and `AsyncSqliteSession`.

They are the source of the blocking `SessionRepository` / `SqliteSession`
(`_repo_async.py`, `_handle_async.py`; the twins are generated). SQLite has
no asyncio driver, so every file call runs in a worker thread; the event loop
never waits on a file lock. Semantics, errors and the lease are those of the
blocking classes. A call already running in its thread finishes even when the
awaiting task is cancelled: a cancelled commit may still have committed (read
the session to find out).
"""

from __future__ import annotations

from ._handle_async import AsyncSqliteSession
from ._repo_async import AsyncSessionRepository

__all__ = ["AsyncSessionRepository", "AsyncSqliteSession"]
