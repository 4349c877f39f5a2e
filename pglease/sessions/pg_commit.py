"""Commits and new sessions, sans I/O: `CommitBuilder` turns prepared writes
into the reads and write batches of one fenced commit, `PlanBuilder` a fork
plan into the rows of a new session."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..ids import resource_id
from .branch_index import index_entry
from .errors import DuplicateIdError, SessionNotFoundError, UnknownEntryError
from .fork import ForkPlan
from .ids import uuid7
from .model import (
    AddUsage,
    AppendEntry,
    CommitResult,
    DeleteRegister,
    Entry,
    Register,
    SetRegister,
    UsageRow,
    dump_json,
    load_json,
    sum_usage,
)
from .pg_common import RESOURCE_TYPE, Batch, Row, segment_from_row
from .pg_index import IndexCore
from .pg_sql import Sql
from .schema import EMPTY_USAGE_JSON, IDLE_LANE_STATE_JSON, MAIN_LANE, STORAGE_VERSION
from .writes import Prepared

# --- commits -------------------------------------------------------------------------------------


class SeqMoved(Exception):
    """The session's next_seq is not what the handle expected (internal; resynced)."""

    def __init__(self, next_seq: int) -> None:
        super().__init__(next_seq)
        self.next_seq = next_seq


class CommitBuilder:
    """The session half of one commit, independent of how SQL is sent.

    1. `lookups()`: the reads to send together (one pipelined round trip);
    2. `start(results)`: checks (next_seq, duplicate ids), fixes ids and time;
    3. `step(i)` for each write: runs the branch index (replay-safe: state
       changes only after the index step succeeded);
    4. `batches()`: every remaining write, in order, as executemany batches.
    """

    def __init__(
        self,
        q: Sql,
        session_id: str,
        prepared: Sequence[Prepared],
        expected_seq: int,
        fixed_now: int | None,
        index: IndexCore,
    ) -> None:
        self.q = q
        self.session_id = session_id
        self.prepared = prepared
        self.expected_seq = expected_seq
        self.fixed_now = fixed_now
        self.index = index
        explicit: list[str] = []
        parents: set[str] = set()
        for item in prepared:
            w = item.write
            if isinstance(w, AppendEntry | AddUsage) and w.id is not None:
                explicit.append(w.id)
            if isinstance(w, AppendEntry) and w.parent_id is not None:
                parents.add(w.parent_id)
        if len(set(explicit)) != len(explicit):
            dup = next(i for i in explicit if explicit.count(i) > 1)
            raise DuplicateIdError(f"id {dup!r} is used twice in one commit")
        self.explicit = explicit
        self.parents = sorted(parents)
        self.lookup = sorted(parents | set(explicit))
        self.entries: list[Entry] = []
        self.usage_rows: list[UsageRow] = []
        self.register_ops: list[Batch] = []
        self.ids: list[str | None] = []
        self.seq = expected_seq
        self.now = 0
        self.message_count = 0
        self.usage: dict[str, Any] = {}
        self.known: dict[str, int] = {}
        self.item_ids: list[str | None] = []

    def lookups(self) -> dict[str, tuple[bytes, Row]]:
        """The session row (locked), parents' seqs, id checks, segments tipped by a parent."""
        sid = self.session_id
        reads: dict[str, tuple[bytes, Row]] = {"session": (self.q.lock_session, (sid,))}
        if self.lookup:
            reads["known"] = (self.q.known_entries, (sid, self.lookup))
        if self.explicit:
            reads["usage"] = (self.q.known_usage, (sid, self.explicit))
        if self.parents:
            reads["tips"] = (self.q.segments_by_tips, (sid, self.parents))
        return reads

    def start(self, results: dict[str, list[Row]]) -> None:
        rows = results["session"]
        if not rows:
            raise SessionNotFoundError(f"session {self.session_id} does not exist")
        next_seq, message_count, usage_text, db_now = rows[0]
        if int(next_seq) != self.expected_seq:
            raise SeqMoved(int(next_seq))
        self.now = int(db_now) if self.fixed_now is None else self.fixed_now
        self.message_count = int(message_count)
        self.usage = load_json(usage_text)
        self.known = {r[0]: int(r[1]) for r in results.get("known", [])}
        taken = [i for i in self.explicit if i in self.known]
        taken += [r[0] for r in results.get("usage", [])]
        if taken:
            raise DuplicateIdError(f"id {taken[0]!r} is already used by an entry or usage row")
        for row in results.get("tips", []):
            self.index.remember(segment_from_row(row))
        # Ids are fixed before any step, so running a step again is harmless.
        self.item_ids = [
            (w.id or uuid7(self.now)) if isinstance(w, AppendEntry | AddUsage) else None
            for w in (item.write for item in self.prepared)
        ]

    def step(self, i: int) -> None:
        item = self.prepared[i]
        w = item.write
        seq = self.expected_seq + i
        sid = self.session_id
        if isinstance(w, AppendEntry):
            assert item.text is not None
            entry_id = self.item_ids[i]
            assert entry_id is not None
            parent_seq: int | None = None
            if w.parent_id is not None:
                parent_seq = self.known.get(w.parent_id)
                if parent_seq is None:
                    raise UnknownEntryError(f"parent entry {w.parent_id!r} does not exist")
            index_entry(self.index, entry_id, seq, w.type, w.parent_id, parent_seq)
            self.known[entry_id] = seq
            self.entries.append(
                Entry(entry_id, w.parent_id, seq, w.type, w.custom_type, self.now, item.text)
            )
            if w.type == "message":
                self.message_count += 1
        elif isinstance(w, AddUsage):
            assert item.text is not None
            usage_id = self.item_ids[i]
            assert usage_id is not None
            self.usage_rows.append(
                UsageRow(usage_id, seq, w.entry_id, w.adjustment, item.text, item.details)
            )
            self.usage = sum_usage(self.usage, w.usage)
        elif isinstance(w, SetRegister):
            self.register_ops.append(
                (self.q.upsert_register, [(sid, w.namespace, w.key, seq, item.text)])
            )
        else:
            assert isinstance(w, DeleteRegister)
            self.register_ops.append((self.q.delete_register, [(sid, w.namespace, w.key)]))
        self.seq = seq + 1

    def batches(self) -> list[Batch]:
        sid = self.session_id
        out = [*self.register_ops, *self.index.pending()]
        if self.entries:
            out.append((self.q.insert_entry, [entry_params(sid, e) for e in self.entries]))
        if self.usage_rows:
            out.append(
                (
                    self.q.insert_usage,
                    [
                        (
                            sid,
                            u.id,
                            u.seq,
                            u.entry_id,
                            int(u.adjustment),
                            u.usage_json,
                            u.details_json,
                        )
                        for u in self.usage_rows
                    ],
                )
            )
        out.append(
            (
                self.q.update_session,
                [(self.seq, self.message_count, dump_json(self.usage, "usage_payload"), sid)],
            )
        )
        return out

    def result(self) -> tuple[CommitResult, list[Entry], list[UsageRow]]:
        ids = tuple(self.item_ids)
        return (
            CommitResult(self.expected_seq, self.seq, self.now, ids),
            self.entries,
            self.usage_rows,
        )


def entry_params(session_id: str, e: Entry) -> Row:
    return (
        session_id,
        e.id,
        e.parent_id,
        e.seq,
        e.type,
        e.custom_type,
        e.timestamp,
        e.payload_json,
    )


# --- new sessions from a plan --------------------------------------------------------------------


def new_session_plan(parent_session_id: str | None) -> ForkPlan:
    """A new empty session: lane.leaf/main = null (seq 1), lane.state/main idle (seq 2)."""
    return ForkPlan(
        entries=(),
        registers=(
            Register("lane.leaf", MAIN_LANE, 1, "null"),
            Register("lane.state", MAIN_LANE, 2, IDLE_LANE_STATE_JSON),
        ),
        message_count=0,
        next_seq=3,
        parent_session_id=parent_session_id,
    )


class PlanBuilder:
    """Writing a `ForkPlan` as a new session: the session row first (its
    rowcount tells whether the id was free), then `step(i)` per entry in seq
    order through the branch index, then `batches()`."""

    def __init__(
        self, q: Sql, session_id: str, plan: ForkPlan, created_at: int | None, index: IndexCore
    ) -> None:
        self.q = q
        self.session_id = session_id
        self.plan = plan
        self.index = index
        self.created_at = created_at
        self.entries = sorted(plan.entries, key=lambda e: e.seq)
        self.seqs: dict[str, int] = {}

    def session_insert(self) -> tuple[bytes, Row]:
        p = self.plan
        return (
            self.q.insert_session,
            (
                self.session_id,
                resource_id(RESOURCE_TYPE, self.session_id),
                self.created_at,
                p.parent_session_id,
                STORAGE_VERSION,
                p.message_count,
                EMPTY_USAGE_JSON,
                p.next_seq,
            ),
        )

    def step(self, i: int) -> None:
        entry = self.entries[i]
        if entry.id in self.seqs:
            raise DuplicateIdError(f"id {entry.id!r} appears twice in the plan")
        parent_seq = None if entry.parent_id is None else self.seqs.get(entry.parent_id)
        if entry.parent_id is not None and parent_seq is None:
            raise UnknownEntryError(f"entry {entry.id!r} has a missing parent {entry.parent_id!r}")
        index_entry(self.index, entry.id, entry.seq, entry.type, entry.parent_id, parent_seq)
        self.seqs[entry.id] = entry.seq

    def batches(self) -> list[Batch]:
        sid = self.session_id
        out = self.index.pending()
        if self.entries:
            out.append((self.q.insert_entry, [entry_params(sid, e) for e in self.entries]))
        if self.plan.registers:
            out.append(
                (
                    self.q.upsert_register,
                    [(sid, r.namespace, r.key, r.seq, r.value_json) for r in self.plan.registers],
                )
            )
        return out
