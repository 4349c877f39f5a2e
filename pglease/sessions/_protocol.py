# Generated from pglease/sessions/_protocol_async.py by tools/async_to_sync.py: do not edit.
"""The backend-neutral shape of a session writer handle and of a session repository.

This asyncio module is the source; `_protocol.py` (the blocking shapes
`SessionHandle` / `SessionBackend`) is generated from it by
tools/async_to_sync.py. `protocol.py` exports both.
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
    def fence(self) -> int:
        """The writer lease's fencing generation: every claim of the session
        (after a close, a crash or an expiry takeover) gets a higher one, and it
        never goes back, so it can fence writes downstream."""
        ...

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
