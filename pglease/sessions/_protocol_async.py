"""The backend-neutral shape of a session writer handle and of a session repository.

This asyncio module is the source; `_protocol.py` (the blocking shapes
`SessionHandle` / `SessionBackend`) is generated from it by
tools/async_to_sync.py. `protocol.py` exports both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

# sync: import threading
from .fork import ForkPlan, ForkPosition, ForkScope
from .model import CommitResult, Entry, Register, SessionSnapshot, SessionStats, UsageRow, Write


class AsyncSessionHandle(Protocol):
    """A writer handle holding a session's writer lease.

    Every commit is fenced: it fails with `WriterLeaseLostError` once another
    writer took the lease over, and after that the handle refuses all work
    except `close()`.
    """

    # sync: lost: threading.Event

    @property
    def id(self) -> str: ...

    @property
    def owner_id(self) -> str: ...

    @property
    def fence(self) -> int:
        """The writer lease's fencing generation: every claim of the session
        (after a close, a crash or an expiry takeover) gets a higher one, and it
        never goes back, so it can fence writes downstream."""
        ...

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

    async def append_message(
        self,
        parent_id: str | None,
        message: Any,
        *,
        terminate: bool | None = None,
        id: str | None = None,
    ) -> Entry: ...

    async def set_register(self, namespace: str, key: str, value: Any) -> int: ...

    async def delete_register(self, namespace: str, key: str) -> int: ...

    async def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow: ...

    async def get_entry(self, entry_id: str) -> Entry | None: ...

    async def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]: ...

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
    """Creating, opening and forking sessions within one backend."""

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
