# Generated from pglease/sessions/_conveniences_async.py by tools/async_to_sync.py: do not edit.
"""One-write conveniences shared by the session handles.

Each is a single `commit` (or `append_entry`), so they behave identically on
every backend; the handle supplies those two methods. This asyncio module is
the source of `_conveniences.py` (`ConvenienceWrites`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .model import CommitResult, DeleteRegister, Entry, SetRegister, Write


class ConvenienceWrites:
    def commit(self, writes: Sequence[Write]) -> CommitResult:
        raise NotImplementedError

    def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry:
        raise NotImplementedError

    def append_message(
        self,
        parent_id: str | None,
        message: Any,
        *,
        terminate: bool | None = None,
        id: str | None = None,
    ) -> Entry:
        """Append a `message` entry (`terminate` only when given)."""
        payload: dict[str, Any] = {"message": message}
        if terminate is not None:
            payload["terminate"] = terminate
        return self.append_entry("message", parent_id, payload, id=id)

    def set_register(self, namespace: str, key: str, value: Any) -> int:
        """Upsert a register; returns the seq it was written at."""
        return self.commit([SetRegister(namespace, key, value)]).first_seq

    def delete_register(self, namespace: str, key: str) -> int:
        """Delete a register (no tombstone); the delete still takes a seq."""
        return self.commit([DeleteRegister(namespace, key)]).first_seq
