"""Session files for asyncio: `SessionRepository` and `SqliteSession` behind coroutines.

SQLite has no asyncio driver, so every call runs the blocking method in a
worker thread (`asyncio.to_thread`); the event loop never waits on a file
lock. Semantics, errors and the lease (renewed by the handle's own thread)
are those of the blocking classes. A call already running in its thread
finishes even when the awaiting task is cancelled: a cancelled commit may
still have committed (read the session to find out).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .fork import ForkPlan, ForkPosition, ForkScope
from .model import CommitResult, Entry, Register, SessionSnapshot, SessionStats, UsageRow, Write
from .repository import SessionListing, SessionRepository
from .sqlite_file import BUSY_TIMEOUT, NowMs, SqliteSession


class AsyncSqliteSession:
    """A `SqliteSession` whose calls are coroutines (see `SqliteSession`)."""

    def __init__(self, handle: SqliteSession) -> None:
        self._handle = handle

    @property
    def sync(self) -> SqliteSession:
        """The blocking handle underneath."""
        return self._handle

    @property
    def id(self) -> str:
        return self._handle.id

    @property
    def path(self) -> Path:
        return self._handle.path

    @property
    def owner_id(self) -> str:
        return self._handle.owner_id

    @property
    def fence(self) -> int:
        return self._handle.fence

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def __repr__(self) -> str:
        return f"<AsyncSqliteSession {self.id} fence={self.fence} owner={self.owner_id}>"

    async def __aenter__(self) -> AsyncSqliteSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def renew(self) -> None:
        await asyncio.to_thread(self._handle.renew)

    async def close(self) -> None:
        await asyncio.to_thread(self._handle.close)

    async def commit(self, writes: Sequence[Write]) -> CommitResult:
        return await asyncio.to_thread(self._handle.commit, list(writes))

    async def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry:
        return await asyncio.to_thread(
            self._handle.append_entry, type, parent_id, payload, custom_type=custom_type, id=id
        )

    async def append_message(
        self,
        parent_id: str | None,
        message: Any,
        *,
        terminate: bool | None = None,
        id: str | None = None,
    ) -> Entry:
        return await asyncio.to_thread(
            self._handle.append_message, parent_id, message, terminate=terminate, id=id
        )

    async def set_register(self, namespace: str, key: str, value: Any) -> int:
        return await asyncio.to_thread(self._handle.set_register, namespace, key, value)

    async def delete_register(self, namespace: str, key: str) -> int:
        return await asyncio.to_thread(self._handle.delete_register, namespace, key)

    async def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow:
        return await asyncio.to_thread(
            self._handle.add_usage,
            usage,
            entry_id=entry_id,
            adjustment=adjustment,
            details=details,
            id=id,
        )

    async def get_entry(self, entry_id: str) -> Entry | None:
        return await asyncio.to_thread(self._handle.get_entry, entry_id)

    async def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]:
        return await asyncio.to_thread(
            self._handle.scan_entries, after_seq=after_seq, limit=limit, types=types
        )

    async def scan_branch(
        self,
        leaf_id: str,
        *,
        newest_first: bool = True,
        stop_type: str | None = None,
        stop_id: str | None = None,
        types: Iterable[str] | None = None,
        custom_type: str | None = None,
        cursor: int | None = None,
        limit: int | None = None,
    ) -> list[Entry]:
        return await asyncio.to_thread(
            self._handle.scan_branch,
            leaf_id,
            newest_first=newest_first,
            stop_type=stop_type,
            stop_id=stop_id,
            types=types,
            custom_type=custom_type,
            cursor=cursor,
            limit=limit,
        )

    async def get_register(self, namespace: str, key: str) -> Register | None:
        return await asyncio.to_thread(self._handle.get_register, namespace, key)

    async def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        return await asyncio.to_thread(self._handle.list_registers, namespace, prefix)

    async def usage_rows(self) -> list[UsageRow]:
        return await asyncio.to_thread(self._handle.usage_rows)

    async def stats(self) -> SessionStats:
        return await asyncio.to_thread(self._handle.stats)

    async def snapshot(self) -> SessionSnapshot:
        return await asyncio.to_thread(self._handle.snapshot)


class AsyncSessionRepository:
    """A directory of session files for asyncio (options as `SessionRepository`)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        lease_seconds: float = 30.0,
        renew_interval: float | None = 15.0,
        now_ms: NowMs | None = None,
        busy_timeout: float = BUSY_TIMEOUT,
    ) -> None:
        self._files = SessionRepository(
            directory,
            lease_seconds=lease_seconds,
            renew_interval=renew_interval,
            now_ms=now_ms,
            busy_timeout=busy_timeout,
        )

    @property
    def sync(self) -> SessionRepository:
        """The blocking repository underneath."""
        return self._files

    @property
    def directory(self) -> Path:
        return self._files.directory

    async def __aenter__(self) -> AsyncSessionRepository:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def path_for(self, session_id: str) -> Path:
        return self._files.path_for(session_id)

    async def exists(self, session_id: str) -> bool:
        return await asyncio.to_thread(self._files.exists, session_id)

    async def create(
        self, id: str | None = None, parent_session_id: str | None = None
    ) -> AsyncSqliteSession:
        """Create a new empty session file and claim its writer lease."""
        handle = await asyncio.to_thread(self._files.create, id, parent_session_id)
        return AsyncSqliteSession(handle)

    async def open(self, session_id: str) -> AsyncSqliteSession:
        """Open an existing session file and claim its writer lease."""
        return AsyncSqliteSession(await asyncio.to_thread(self._files.open, session_id))

    async def fork(
        self,
        source_id: str,
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> AsyncSqliteSession:
        """Copy (part of) a session into a new file and open it."""
        handle = await asyncio.to_thread(self._files.fork, source_id, scope, entry_id, position, id)
        return AsyncSqliteSession(handle)

    async def create_from_plan(self, plan: ForkPlan, id: str | None = None) -> AsyncSqliteSession:
        return AsyncSqliteSession(await asyncio.to_thread(self._files.create_from_plan, plan, id))

    async def snapshot(self, session_id: str) -> SessionSnapshot:
        return await asyncio.to_thread(self._files.snapshot, session_id)

    async def list(self) -> SessionListing:
        return await asyncio.to_thread(self._files.list)

    async def delete(self, session_id: str) -> None:
        await asyncio.to_thread(self._files.delete, session_id)

    async def close(self) -> None:
        """Close every handle this repository opened."""
        await asyncio.to_thread(self._files.close)


__all__ = ["AsyncSessionRepository", "AsyncSqliteSession"]
