"""The session layer: lanes, labels and usage over any session repository (asyncio).

`AsyncSession` wraps one writer handle and the repository it came from, so
one implementation serves session files (`AsyncSessionRepository`) and
PostgreSQL (`AsyncPostgresSessionRepository`). Its blocking twin `Session`
(`session.py`) is generated from this module by tools/async_to_sync.py.

A lane is a cursor into the entry tree: its `lane.leaf` register names the
entry it appends to next. `append` writes the entry (parent: the lane's leaf)
and moves the leaf in one commit, so the tree and the leaf never disagree,
even after a crash between the two.
"""

from __future__ import annotations

import asyncio  # sync: import threading
from collections.abc import Mapping
from typing import Any

from .errors import InvalidSessionWriteError, LaneValidationError, UnknownEntryError
from .fork import ForkPosition, ForkScope, plan_fork
from .ids import uuid7
from .lanes import (
    FACT_CUSTOM,
    FACT_LABEL,
    FACT_NAME,
    IDLE_LANE_STATE,
    LANE_CONFIG,
    LANE_LAST_RESULT,
    LANE_LEAF,
    LANE_STATE,
    branch_usage,
    check_label,
    check_lane,
    label_map,
    leaf_value,
    sorted_lanes,
    with_empty_main,
)
from .model import (
    AddUsage,
    AppendEntry,
    DeleteRegister,
    Entry,
    Register,
    SetRegister,
    Write,
    entry_payload_json,
)
from .protocol import AsyncSessionBackend, AsyncSessionHandle
from .schema import MAIN_LANE


class AsyncSession:
    """A session opened for writing, seen as lanes over its entry tree.

    Holds the session's writer lease (through its handle) until `close()`;
    every write is a fenced commit of the handle, so a writer that lost its
    lease gets `WriterLeaseLostError` and nothing is written.
    """

    def __init__(self, handle: AsyncSessionHandle, repository: AsyncSessionBackend) -> None:
        self._handle = handle
        self._repository = repository
        # One append at a time per session: the leaf read and the commit that
        # moves it must not interleave with another append to the same lane.
        self._lock = asyncio.Lock()  # sync: self._lock = threading.Lock()

    @classmethod
    async def create(cls, repository: AsyncSessionBackend, id: str | None = None) -> AsyncSession:
        """Create a new empty session (lane main, empty) and hold its writer lease."""
        return cls(await repository.create(id), repository)

    @classmethod
    async def open(cls, repository: AsyncSessionBackend, session_id: str) -> AsyncSession:
        """Open an existing session for writing; another live writer ->
        `SessionAlreadyClaimedError`."""
        return cls(await repository.open(session_id), repository)

    @property
    def id(self) -> str:
        return self._handle.id

    @property
    def handle(self) -> AsyncSessionHandle:
        """The writer handle underneath (for commits the layer does not cover)."""
        return self._handle

    @property
    def repository(self) -> AsyncSessionBackend:
        return self._repository

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def __repr__(self) -> str:
        return f"<AsyncSession {self.id}>"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Release the writer lease (if still ours) and close the handle."""
        await self._handle.close()

    # -- lanes --

    async def lanes(self) -> list[str]:
        """Every lane (a `lane.leaf` register), main first."""
        return sorted_lanes(await self._handle.list_registers(LANE_LEAF))

    async def leaf(self, lane: str = MAIN_LANE) -> str | None:
        """The entry the lane appends to next (None: the lane is empty)."""
        check_lane(lane)
        register = await self._handle.get_register(LANE_LEAF, lane)
        if register is None:
            raise LaneValidationError(
                f"session {self.id} has no lane {lane!r} (no lane.leaf register)"
            )
        return leaf_value(lane, register)

    async def branch(self, lane: str = MAIN_LANE) -> list[Entry]:
        """The lane's branch: the entries from the root to its leaf, oldest first."""
        leaf = await self.leaf(lane)
        if leaf is None:
            return []
        return await self._handle.scan_branch(leaf, newest_first=False)

    async def lane_config(self, lane: str = MAIN_LANE) -> Any:
        """The lane's `lane.config` value, None when it has none (main may not)."""
        return await self._value(LANE_CONFIG, check_lane(lane))

    async def lane_state(self, lane: str = MAIN_LANE) -> Any:
        """The lane's `lane.state` value (`{currentOperationId, pendingNextRun}`)."""
        return await self._value(LANE_STATE, check_lane(lane))

    async def last_result(self, lane: str = MAIN_LANE) -> Any:
        """The lane's `lane.lastResult` value, None when it has none."""
        return await self._value(LANE_LAST_RESULT, check_lane(lane))

    async def add_lane(self, lane: str, config: Any, *, at: str | None = None) -> None:
        """Create a lane (config, leaf `at` or empty, idle state) in one commit.

        Lanes other than main need a config (a fork refuses a session without).
        """
        check_lane(lane)
        async with self._lock:
            if await self._handle.get_register(LANE_LEAF, lane) is not None:
                raise InvalidSessionWriteError(f"session {self.id} already has lane {lane!r}")
            if at is not None:
                await self._require_entry(at)
            await self._handle.commit(
                [
                    SetRegister(LANE_CONFIG, lane, config),
                    SetRegister(LANE_LEAF, lane, at),
                    SetRegister(LANE_STATE, lane, IDLE_LANE_STATE),
                ]
            )

    async def set_leaf(self, lane: str, entry_id: str | None) -> None:
        """Move the lane's leaf to an existing entry (or empty it): the next
        append then starts a new branch there."""
        async with self._lock:
            await self.leaf(lane)
            if entry_id is not None:
                await self._require_entry(entry_id)
            await self._handle.commit([SetRegister(LANE_LEAF, lane, entry_id)])

    async def append(
        self,
        lane: str,
        kind: str,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        usage: Mapping[str, Any] | None = None,
        id: str | None = None,
    ) -> Entry:
        """Append an entry of type `kind` under the lane's leaf and move the
        leaf to it, in one commit. `usage` (a usage object) also goes into the
        ledger, tied to the entry, in the same commit."""
        check_lane(lane)
        entry_id = id if id is not None else uuid7()
        # Checked before anything is read, so bad input sends nothing.
        text = entry_payload_json(AppendEntry(kind, None, payload or {}, custom_type, entry_id))
        async with self._lock:
            parent = await self.leaf(lane)
            writes: list[Write] = [AppendEntry(kind, parent, payload or {}, custom_type, entry_id)]
            if usage is not None:
                writes.append(AddUsage(usage, entry_id=entry_id))
            writes.append(SetRegister(LANE_LEAF, lane, entry_id))
            result = await self._handle.commit(writes)
        return Entry(entry_id, parent, result.first_seq, kind, custom_type, result.timestamp, text)

    # -- facts --

    async def name(self) -> Any:
        """The session name (`fact.name`), None when unnamed."""
        return await self._value(FACT_NAME, "")

    async def set_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise InvalidSessionWriteError(f"a session name must be a string, got {name!r}")
        await self._handle.commit([SetRegister(FACT_NAME, "", name)])

    async def labels(self) -> dict[str, str]:
        """Every label, as {entry id: label}."""
        return label_map(await self._handle.list_registers(FACT_LABEL))

    async def label(self, entry_id: str) -> str | None:
        register = await self._handle.get_register(FACT_LABEL, entry_id)
        return None if register is None else label_map([register])[entry_id]

    async def set_label(self, entry_id: str, label: str | None) -> None:
        """Label an existing entry; None removes its label."""
        if label is not None:
            check_label(label)
        await self._require_entry(entry_id)
        write: Write = (
            DeleteRegister(FACT_LABEL, entry_id)
            if label is None
            else SetRegister(FACT_LABEL, entry_id, label)
        )
        await self._handle.commit([write])

    async def custom(self, key: str) -> Any:
        """An application value (`fact.custom`), None when unset."""
        return await self._value(FACT_CUSTOM, key)

    async def set_custom(self, key: str, value: Any) -> None:
        await self._handle.commit([SetRegister(FACT_CUSTOM, key, value)])

    # -- usage --

    async def usage(self) -> dict[str, Any]:
        """The session's usage totals: the sum of its usage ledger."""
        return (await self._handle.stats()).usage

    async def branch_usage(self, lane: str = MAIN_LANE) -> dict[str, Any]:
        """The usage the lane's branch carries: assistant messages' `usage`,
        compactions' and branch summaries' `usage`, summed."""
        return branch_usage(await self.branch(lane))

    # -- registers --

    async def get_register(self, namespace: str, key: str) -> Register | None:
        return await self._handle.get_register(namespace, key)

    async def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        """Registers of `namespace` whose key starts with `prefix`, by key."""
        return await self._handle.list_registers(namespace, prefix)

    async def set_register(self, namespace: str, key: str, value: Any) -> int:
        """Upsert any register (no lane checks: the lane methods do those)."""
        return await self._handle.set_register(namespace, key, value)

    async def delete_register(self, namespace: str, key: str) -> int:
        return await self._handle.delete_register(namespace, key)

    # -- forks --

    async def fork(
        self,
        lane: str = MAIN_LANE,
        at: str | None = None,
        *,
        position: ForkPosition = "at",
        scope: ForkScope = "branch",
        id: str | None = None,
    ) -> AsyncSession:
        """Fork into a new session and open it for writing.

        Branch scope copies the path from the root to `at` (default: the
        lane's current leaf; with position "before", to its parent) as the new
        session's lane main. Tree scope copies every entry and lane.
        """
        if scope == "tree":
            if at is not None or position != "at":
                raise InvalidSessionWriteError(
                    "at and position='before' apply to branch scope only"
                )
            handle = await self._repository.fork(self.id, "tree", id=id)
            return AsyncSession(handle, self._repository)
        if scope != "branch":
            raise InvalidSessionWriteError(f"fork scope must be 'branch' or 'tree', got {scope!r}")
        target = at if at is not None else await self.leaf(lane)
        if target is not None:
            handle = await self._repository.fork(self.id, "branch", target, position, id)
        elif position == "before":
            raise InvalidSessionWriteError(
                f"cannot fork before the leaf of lane {lane!r}: the lane is empty"
            )
        else:
            # An empty lane: the repository would fall back to main's leaf.
            snapshot = with_empty_main(await self._repository.snapshot(self.id))
            plan = plan_fork(snapshot, self.id, "branch", None, position)
            handle = await self._repository.create_from_plan(plan, id)
        return AsyncSession(handle, self._repository)

    # -- helpers --

    async def _value(self, namespace: str, key: str) -> Any:
        register = await self._handle.get_register(namespace, key)
        return None if register is None else register.value

    async def _require_entry(self, entry_id: str) -> None:
        if not isinstance(entry_id, str) or entry_id == "":
            raise InvalidSessionWriteError(f"entry id must be a non-empty string, got {entry_id!r}")
        if await self._handle.get_entry(entry_id) is None:
            raise UnknownEntryError(f"entry {entry_id!r} does not exist in session {self.id}")


__all__ = ["AsyncSession"]  # sync: __all__ = ["Session"]
