# Generated from pglease/sessions/session_async.py by tools/async_to_sync.py: do not edit.
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

import threading
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
from .protocol import SessionBackend, SessionHandle
from .schema import MAIN_LANE


class Session:
    """A session opened for writing, seen as lanes over its entry tree.

    Holds the session's writer lease (through its handle) until `close()`;
    every write is a fenced commit of the handle, so a writer that lost its
    lease gets `WriterLeaseLostError` and nothing is written.
    """

    def __init__(self, handle: SessionHandle, repository: SessionBackend) -> None:
        self._handle = handle
        self._repository = repository
        # One append at a time per session: the leaf read and the commit that
        # moves it must not interleave with another append to the same lane.
        self._lock = threading.Lock()

    @classmethod
    def create(cls, repository: SessionBackend, id: str | None = None) -> Session:
        """Create a new empty session (lane main, empty) and hold its writer lease."""
        return cls(repository.create(id), repository)

    @classmethod
    def open(cls, repository: SessionBackend, session_id: str) -> Session:
        """Open an existing session for writing; another live writer ->
        `SessionAlreadyClaimedError`."""
        return cls(repository.open(session_id), repository)

    @property
    def id(self) -> str:
        return self._handle.id

    @property
    def handle(self) -> SessionHandle:
        """The writer handle underneath (for commits the layer does not cover)."""
        return self._handle

    @property
    def repository(self) -> SessionBackend:
        return self._repository

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def __repr__(self) -> str:
        return f"<AsyncSession {self.id}>"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the writer lease (if still ours) and close the handle."""
        self._handle.close()

    # -- lanes --

    def lanes(self) -> list[str]:
        """Every lane (a `lane.leaf` register), main first."""
        return sorted_lanes(self._handle.list_registers(LANE_LEAF))

    def leaf(self, lane: str = MAIN_LANE) -> str | None:
        """The entry the lane appends to next (None: the lane is empty)."""
        check_lane(lane)
        register = self._handle.get_register(LANE_LEAF, lane)
        if register is None:
            raise LaneValidationError(
                f"session {self.id} has no lane {lane!r} (no lane.leaf register)"
            )
        return leaf_value(lane, register)

    def branch(self, lane: str = MAIN_LANE) -> list[Entry]:
        """The lane's branch: the entries from the root to its leaf, oldest first."""
        leaf = self.leaf(lane)
        if leaf is None:
            return []
        return self._handle.scan_branch(leaf, newest_first=False)

    def lane_config(self, lane: str = MAIN_LANE) -> Any:
        """The lane's `lane.config` value, None when it has none (main may not)."""
        return self._value(LANE_CONFIG, check_lane(lane))

    def lane_state(self, lane: str = MAIN_LANE) -> Any:
        """The lane's `lane.state` value (`{currentOperationId, pendingNextRun}`)."""
        return self._value(LANE_STATE, check_lane(lane))

    def last_result(self, lane: str = MAIN_LANE) -> Any:
        """The lane's `lane.lastResult` value, None when it has none."""
        return self._value(LANE_LAST_RESULT, check_lane(lane))

    def add_lane(self, lane: str, config: Any, *, at: str | None = None) -> None:
        """Create a lane (config, leaf `at` or empty, idle state) in one commit.

        Lanes other than main need a config (a fork refuses a session without).
        """
        check_lane(lane)
        with self._lock:
            if self._handle.get_register(LANE_LEAF, lane) is not None:
                raise InvalidSessionWriteError(f"session {self.id} already has lane {lane!r}")
            if at is not None:
                self._require_entry(at)
            self._handle.commit(
                [
                    SetRegister(LANE_CONFIG, lane, config),
                    SetRegister(LANE_LEAF, lane, at),
                    SetRegister(LANE_STATE, lane, IDLE_LANE_STATE),
                ]
            )

    def set_leaf(self, lane: str, entry_id: str | None) -> None:
        """Move the lane's leaf to an existing entry (or empty it): the next
        append then starts a new branch there."""
        with self._lock:
            self.leaf(lane)
            if entry_id is not None:
                self._require_entry(entry_id)
            self._handle.commit([SetRegister(LANE_LEAF, lane, entry_id)])

    def append(
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
        with self._lock:
            parent = self.leaf(lane)
            writes: list[Write] = [AppendEntry(kind, parent, payload or {}, custom_type, entry_id)]
            if usage is not None:
                writes.append(AddUsage(usage, entry_id=entry_id))
            writes.append(SetRegister(LANE_LEAF, lane, entry_id))
            result = self._handle.commit(writes)
        return Entry(entry_id, parent, result.first_seq, kind, custom_type, result.timestamp, text)

    # -- facts --

    def name(self) -> Any:
        """The session name (`fact.name`), None when unnamed."""
        return self._value(FACT_NAME, "")

    def set_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise InvalidSessionWriteError(f"a session name must be a string, got {name!r}")
        self._handle.commit([SetRegister(FACT_NAME, "", name)])

    def labels(self) -> dict[str, str]:
        """Every label, as {entry id: label}."""
        return label_map(self._handle.list_registers(FACT_LABEL))

    def label(self, entry_id: str) -> str | None:
        register = self._handle.get_register(FACT_LABEL, entry_id)
        return None if register is None else label_map([register])[entry_id]

    def set_label(self, entry_id: str, label: str | None) -> None:
        """Label an existing entry; None removes its label."""
        if label is not None:
            check_label(label)
        self._require_entry(entry_id)
        write: Write = (
            DeleteRegister(FACT_LABEL, entry_id)
            if label is None
            else SetRegister(FACT_LABEL, entry_id, label)
        )
        self._handle.commit([write])

    def custom(self, key: str) -> Any:
        """An application value (`fact.custom`), None when unset."""
        return self._value(FACT_CUSTOM, key)

    def set_custom(self, key: str, value: Any) -> None:
        self._handle.commit([SetRegister(FACT_CUSTOM, key, value)])

    # -- usage --

    def usage(self) -> dict[str, Any]:
        """The session's usage totals: the sum of its usage ledger."""
        return (self._handle.stats()).usage

    def branch_usage(self, lane: str = MAIN_LANE) -> dict[str, Any]:
        """The usage the lane's branch carries: assistant messages' `usage`,
        compactions' and branch summaries' `usage`, summed."""
        return branch_usage(self.branch(lane))

    # -- registers --

    def get_register(self, namespace: str, key: str) -> Register | None:
        return self._handle.get_register(namespace, key)

    def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        """Registers of `namespace` whose key starts with `prefix`, by key."""
        return self._handle.list_registers(namespace, prefix)

    def set_register(self, namespace: str, key: str, value: Any) -> int:
        """Upsert any register (no lane checks: the lane methods do those)."""
        return self._handle.set_register(namespace, key, value)

    def delete_register(self, namespace: str, key: str) -> int:
        return self._handle.delete_register(namespace, key)

    # -- forks --

    def fork(
        self,
        lane: str = MAIN_LANE,
        at: str | None = None,
        *,
        position: ForkPosition = "at",
        scope: ForkScope = "branch",
        id: str | None = None,
    ) -> Session:
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
            handle = self._repository.fork(self.id, "tree", id=id)
            return Session(handle, self._repository)
        if scope != "branch":
            raise InvalidSessionWriteError(f"fork scope must be 'branch' or 'tree', got {scope!r}")
        target = at if at is not None else self.leaf(lane)
        if target is not None:
            handle = self._repository.fork(self.id, "branch", target, position, id)
        elif position == "before":
            raise InvalidSessionWriteError(
                f"cannot fork before the leaf of lane {lane!r}: the lane is empty"
            )
        else:
            # An empty lane: the repository would fall back to main's leaf.
            snapshot = with_empty_main(self._repository.snapshot(self.id))
            plan = plan_fork(snapshot, self.id, "branch", None, position)
            handle = self._repository.create_from_plan(plan, id)
        return Session(handle, self._repository)

    # -- helpers --

    def _value(self, namespace: str, key: str) -> Any:
        register = self._handle.get_register(namespace, key)
        return None if register is None else register.value

    def _require_entry(self, entry_id: str) -> None:
        if not isinstance(entry_id, str) or entry_id == "":
            raise InvalidSessionWriteError(f"entry id must be a non-empty string, got {entry_id!r}")
        if self._handle.get_entry(entry_id) is None:
            raise UnknownEntryError(f"entry {entry_id!r} does not exist in session {self.id}")


__all__ = ["Session"]
