"""Sessions in PostgreSQL tables (`sql/0004_sessions.sql`), shared by a fleet: blocking.

`PostgresSessionRepository` on a `PostgresStore`, the blocking twin of
`pglease.sessions.postgres_async` (whose docstring describes the parts). The
modules named here (``pg_handle``, ``pg_repository``, ``pg_io``, ...) are
generated from their asyncio sources by `tools/async_to_sync.py`; this one
only re-exports them.
"""

from __future__ import annotations

from .pg_core import OWNER_TYPE, RESOURCE_TYPE, PgBranchIndex, new_session_plan
from .pg_handle import PostgresSession
from .pg_io import FETCH_WAIT, Conn, Index, NowMs, write_plan_rows
from .pg_repository import PostgresSessionRepository

__all__ = [
    "FETCH_WAIT",
    "OWNER_TYPE",
    "RESOURCE_TYPE",
    "Conn",
    "Index",
    "NowMs",
    "PgBranchIndex",
    "PostgresSession",
    "PostgresSessionRepository",
    "new_session_plan",
    "write_plan_rows",
]
