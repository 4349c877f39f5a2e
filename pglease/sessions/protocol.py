"""The backend-neutral shape of a session writer handle and of a session repository.

`SqliteSession` / `SessionRepository` (one file per session) and
`PostgresSession` / `PostgresSessionRepository` (shared tables) both satisfy
these protocols, so code and tests can work with either. `AsyncSessionHandle` /
`AsyncSessionBackend` are the asyncio shapes (`AsyncPostgresSessionRepository`,
`AsyncSessionRepository` over files); `Session` / `AsyncSession` build on them.
The asyncio shapes are the source (`_protocol_async.py`); the blocking ones
are generated from them (`_protocol.py`).
"""

from __future__ import annotations

from ._protocol import SessionBackend, SessionHandle
from ._protocol_async import AsyncSessionBackend, AsyncSessionHandle

__all__ = ["AsyncSessionBackend", "AsyncSessionHandle", "SessionBackend", "SessionHandle"]
