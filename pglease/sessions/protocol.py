"""The backend-neutral shape of a session writer handle and of a session repository.

`SqliteSession` / `SessionRepository` (one file per session) and
`PostgresSession` / `PostgresSessionRepository` (shared tables) both satisfy
these protocols, so code and tests can work with either. `AsyncSessionHandle` /
`AsyncSessionBackend` are the asyncio shapes (`AsyncPostgresSessionRepository`,
`AsyncSessionRepository` over files); `Session` / `AsyncSession` build on them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from .fork import ForkPlan, ForkPosition, ForkScope
from .model import CommitResult, Entry, Register, SessionSnapshot, SessionStats, UsageRow, Write


class SessionHandle(Protocol):
    """A writer handle holding a session's writer lease.

    Every commit is fenced: it fails with `WriterLeaseLostError` once another
    writer took the lease over, and after that the handle refuses all work
    except `close()`.
    """

    lost: threading.Event

    @property
    def id(self) -> str: ...

    @property
    def owner_id(self) -> str: ...

    @property
    def fence(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def renew(self) -> None: ...

    def close(self) -> None: ...

    def commit(self, writes: Sequence[Write]) -> CommitResult: ...

    def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry: ...

    def append_message(
        self,
        parent_id: str | None,
        message: Any,
        *,
        terminate: bool | None = None,
        id: str | None = None,
    ) -> Entry: ...

    def set_register(self, namespace: str, key: str, value: Any) -> int: ...

    def delete_register(self, namespace: str, key: str) -> int: ...

    def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow: ...

    def get_entry(self, entry_id: str) -> Entry | None: ...

    def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]: ...

    def scan_branch(
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
    ) -> list[Entry]: ...

    def get_register(self, namespace: str, key: str) -> Register | None: ...

    def list_registers(self, namespace: str, prefix: str = "") -> list[Register]: ...

    def usage_rows(self) -> list[UsageRow]: ...

    def stats(self) -> SessionStats: ...

    def snapshot(self) -> SessionSnapshot: ...


class SessionBackend(Protocol):
    """Creating, opening and forking sessions within one backend."""

    def create(
        self, id: str | None = None, parent_session_id: str | None = None
    ) -> SessionHandle: ...

    def open(self, session_id: str) -> SessionHandle: ...

    def fork(
        self,
        source_id: str,
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> SessionHandle: ...

    def create_from_plan(self, plan: ForkPlan, id: str | None = None) -> SessionHandle: ...

    def snapshot(self, session_id: str) -> SessionSnapshot: ...

    def close(self) -> None: ...


class AsyncSessionHandle(Protocol):
    """The asyncio shape of `SessionHandle` (the same methods, as coroutines)."""

    @property
    def id(self) -> str: ...

    @property
    def owner_id(self) -> str: ...

    @property
    def fence(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def renew(self) -> None: ...

    async def close(self) -> None: ...

    async def commit(self, writes: Sequence[Write]) -> CommitResult: ...

    async def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry: ...

    async def set_register(self, namespace: str, key: str, value: Any) -> int: ...

    async def delete_register(self, namespace: str, key: str) -> int: ...

    async def get_entry(self, entry_id: str) -> Entry | None: ...

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
    ) -> list[Entry]: ...

    async def get_register(self, namespace: str, key: str) -> Register | None: ...

    async def list_registers(self, namespace: str, prefix: str = "") -> list[Register]: ...

    async def usage_rows(self) -> list[UsageRow]: ...

    async def stats(self) -> SessionStats: ...

    async def snapshot(self) -> SessionSnapshot: ...


class AsyncSessionBackend(Protocol):
    """The asyncio shape of `SessionBackend`."""

    async def create(
        self, id: str | None = None, parent_session_id: str | None = None
    ) -> AsyncSessionHandle: ...

    async def open(self, session_id: str) -> AsyncSessionHandle: ...

    async def fork(
        self,
        source_id: str,
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> AsyncSessionHandle: ...

    async def create_from_plan(
        self, plan: ForkPlan, id: str | None = None
    ) -> AsyncSessionHandle: ...

    async def snapshot(self, session_id: str) -> SessionSnapshot: ...

    async def close(self) -> None: ...


__all__ = ["AsyncSessionBackend", "AsyncSessionHandle", "SessionBackend", "SessionHandle"]
