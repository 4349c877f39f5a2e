"""Chunked imports and purges, sans I/O: the chunk's branch index
(`ChunkIndex`), the `session_import_chunk` call (`ChunkBuilder`), chunk
sizing (`ChunkSizer`) and the errors an import reports."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg

from ..errors import PgleaseError
from .branch_index import BranchRow, Segment, index_entry
from .errors import DuplicateIdError, InvalidSessionWriteError, SessionError, UnknownEntryError
from .model import Entry, Register
from .pg_common import Item, Row, segment_from_row
from .pg_index import IndexCore, Miss
from .pg_sql import Sql

# --- chunked imports -----------------------------------------------------------------------------

#: Entries per import transaction: about 20-60 ms each on a loaded 2-core host
#: (bench/RESULTS-sessions.md), so no import transaction holds back the
#: cluster's snapshot xmin, and every watcher with it, for longer than that.
IMPORT_CHUNK = 500
#: Seconds the end of an import waits for the new session's lease (held only
#: by a create() of the same id racing it, and only for a moment).
IMPORT_CLAIM_WAIT = 10.0
#: Rows deleted per transaction when a partial import or a deleted session is
#: removed (5,000 rows: 10-20 ms a transaction, bench/RESULTS-sessions.md).
PURGE_CHUNK = 5000
#: A hidden partial import whose last chunk is older than this (seconds, by
#: the database clock) is taken to be abandoned.
IMPORT_STALE_AFTER = 120.0


def stale_import_problem(session_id: str, age: float) -> SessionError:
    """How `list()` reports the hidden partial of an interrupted import."""
    return SessionError(
        f"session {session_id}: an interrupted import or delete left a hidden partial (no"
        f" progress for {age:.0f} s); the next import of this id or cleanup_imports()"
        " removes it"
    )


def import_gone(session_id: str) -> SessionError:
    return SessionError(
        f"the import of session {session_id} was removed while it ran (a cleanup took it"
        " for abandoned: no chunk within the stale limit); nothing of it is visible"
    )


#: SQLSTATEs of the import chunk functions (sql/functions/40_sessions.sql).
IMPORT_GONE_STATE = "PGL30"
INVALID_CHUNK_STATE = "PGL31"


def import_refusal(exc: psycopg.Error) -> SessionError | None:
    """A refusal of the import chunk functions as the session error it means
    (their message names the session and the problem); None for any other error."""
    state = exc.diag.sqlstate
    message = exc.diag.message_primary or str(exc)
    if state == IMPORT_GONE_STATE:
        return SessionError(message)
    if state == INVALID_CHUNK_STATE:
        return InvalidSessionWriteError(message)
    return None


class ChunkIndex(IndexCore):
    """The branch index of one import chunk, sent as one statement at its end.

    Reads go to the server without flushing (plain reads outside any
    transaction: the rows of earlier chunks, which no one but this import
    writes while its token holds) and are merged here with the chunk's own
    buffered writes. A read not supplied yet raises `Miss`, as in
    `ReplayIndex`; the driver fetches it, `supply()`s the rows and runs the
    step again (the server's rows do not change during the chunk, so
    supplied reads stay valid across writes)."""

    def __init__(self, q: Sql, session_id: str) -> None:
        super().__init__(q, session_id)
        self._reads: dict[tuple[bytes, Row], list[Row]] = {}
        self._created: set[str] = set()
        self._own: dict[str, list[BranchRow]] = {}  # buffered rows by branch, seq order
        self._own_of_entry: dict[str, set[str]] = {}

    @staticmethod
    def _key(query: bytes, params: Row) -> tuple[bytes, Row]:
        return query, tuple(tuple(p) if isinstance(p, list) else p for p in params)

    def fetch(self, query: bytes, params: Row) -> list[Row]:
        found = self._reads.get(self._key(query, params))
        if found is None:
            raise Miss(query, params)
        return found

    def supply(self, miss: Miss, rows: list[Row]) -> None:
        self._reads[self._key(miss.query, miss.params)] = rows

    def add_segment(self, segment: Segment) -> None:
        super().add_segment(segment)
        self._created.add(segment.branch_id)

    def add_rows(self, branch_id: str, rows: Sequence[BranchRow]) -> None:
        super().add_rows(branch_id, rows)
        self._own.setdefault(branch_id, []).extend(rows)
        for row in rows:
            self._own_of_entry.setdefault(row.entry_id, set()).add(branch_id)

    def segment_by_tip(self, tip_entry_id: str) -> Segment | None:
        branch_id = self._by_tip.get(tip_entry_id)
        if branch_id is not None:
            return self._segments[branch_id]
        found = segment_from_row(self._one(self.q.segment_by_tip, (self.session_id, tip_entry_id)))
        if found is not None and found.branch_id in self._segments:
            return None  # the server's tip, moved on by this chunk
        return self.remember(found)

    def covering_segment(self, entry_id: str, entry_seq: int) -> Segment | None:
        where = (self.session_id, entry_id, entry_seq, entry_seq)
        moved = sorted(self._moved)
        candidates: dict[str, Segment] = {}
        for row in self.fetch(self.q.covering_segments, (*where, *where, moved)):
            segment = segment_from_row(row)
            assert segment is not None
            candidates[segment.branch_id] = self._segments.get(segment.branch_id, segment)
        for branch_id in self._own_of_entry.get(entry_id, ()):
            candidates[branch_id] = self._segments[branch_id]
        fitting = [s for s in candidates.values() if s.floor < entry_seq <= s.tip_seq]
        if not fitting:
            return None
        # covering_segment's order: the newest tip first (tips are unique, so no tie)
        return self.remember(max(fitting, key=lambda s: s.tip_seq))

    def _own_rows(self, branch_id: str, above_seq: int, upto_seq: int) -> list[BranchRow]:
        return [r for r in self._own.get(branch_id, ()) if above_seq < r.entry_seq <= upto_seq]

    def newest_row_of_type(
        self, branch_id: str, entry_type: str, above_seq: int, upto_seq: int
    ) -> BranchRow | None:
        own = self._own_rows(branch_id, above_seq, upto_seq)
        found = [r for r in own if r.entry_type == entry_type]
        if branch_id not in self._created:
            server = super().newest_row_of_type(branch_id, entry_type, above_seq, upto_seq)
            if server is not None:
                found.append(server)
        return max(found, key=lambda r: r.entry_seq, default=None)

    def rows(
        self, branch_id: str, above_seq: int, upto_seq: int, newest_first: bool
    ) -> Iterator[BranchRow]:
        found = self._own_rows(branch_id, above_seq, upto_seq)
        if branch_id not in self._created:
            found += super().rows(branch_id, above_seq, upto_seq, newest_first)
        return iter(sorted(found, key=lambda r: r.entry_seq, reverse=newest_first))

    def columns(self) -> tuple[list[Any], ...]:
        """The buffered writes as the column arrays of `session_import_chunk`:
        new segments (5), tip moves (3), branch rows (4)."""
        new = [self._segments[b] for b in self._new]
        moved = [self._segments[b] for b in sorted(self._moved)]
        rows = self._rows
        return (
            [s.branch_id for s in new],
            [s.tip_entry_id for s in new],
            [s.tip_seq for s in new],
            [s.base_branch_id for s in new],
            [s.base_seq for s in new],
            [s.branch_id for s in moved],
            [s.tip_entry_id for s in moved],
            [s.tip_seq for s in moved],
            *([r[i] for r in rows] for i in range(1, 5)),
        )


class ChunkBuilder:
    """One chunk of a chunked import: entries (seq order, following the
    entries of earlier chunks) through the branch index, then one call.

    1. `lookups()`: parents from earlier chunks (plain reads: no transaction);
    2. `start(results)`; 3. `step(i)` per entry (its index reads, plain too);
    4. `call()`: `session_import_chunk`, one statement in autocommit that
       checks the import token, moves its progress time and writes every row.

    The chunk's transaction is that one statement: the server never waits
    for the client with it open (on a busy host most of a chunk's time was
    the server waiting for the client's next message, bench/RESULTS-sessions.md
    run 6). `alive()` is the token check as a read, for a chunk that fails
    before its call (a missing parent may mean a cleanup took the import over).
    """

    def __init__(
        self, q: Sql, session_id: str, token: str, entries: Sequence[Entry], index: ChunkIndex
    ) -> None:
        self.q = q
        self.session_id = session_id
        self.token = token
        self.entries = entries
        self.index = index
        ids = {e.id for e in entries}
        self.parents = sorted({e.parent_id for e in entries if e.parent_id} - ids)
        self.seqs: dict[str, int] = {}

    def lookups(self) -> dict[str, tuple[bytes, Row]]:
        sid = self.session_id
        reads: dict[str, tuple[bytes, Row]] = {}
        if self.parents:
            reads["known"] = (self.q.known_entries, (sid, self.parents))
            reads["tips"] = (self.q.segments_by_tips, (sid, self.parents))
        return reads

    def alive(self) -> tuple[bytes, Row]:
        """The token check as a read."""
        return self.q.import_alive, (self.session_id, self.token)

    def checked(self, rows: list[Row]) -> None:
        if not rows:
            raise import_gone(self.session_id)

    def start(self, results: dict[str, list[Row]]) -> None:
        self.seqs = {r[0]: int(r[1]) for r in results.get("known", [])}
        for row in results.get("tips", []):
            self.index.remember(segment_from_row(row))

    def step(self, i: int) -> None:
        entry = self.entries[i]
        if entry.id in self.seqs:
            raise DuplicateIdError(f"id {entry.id!r} appears twice in the source")
        parent_seq = None if entry.parent_id is None else self.seqs.get(entry.parent_id)
        if entry.parent_id is not None and parent_seq is None:
            raise UnknownEntryError(f"entry {entry.id!r} has a missing parent {entry.parent_id!r}")
        index_entry(self.index, entry.id, entry.seq, entry.type, entry.parent_id, parent_seq)
        self.seqs[entry.id] = entry.seq

    def call(self) -> tuple[bytes, Row]:
        """The whole chunk as one `session_import_chunk` call."""
        entries = self.entries
        return (
            self.q.import_chunk,
            (
                self.session_id,
                self.token,
                [e.id for e in entries],
                [e.parent_id for e in entries],
                [e.seq for e in entries],
                [e.type for e in entries],
                [e.custom_type for e in entries],
                [e.timestamp for e in entries],
                [e.payload_json for e in entries],
                *self.index.columns(),
            ),
        )


def registers_call(
    q: Sql, session_id: str, token: str, registers: Sequence[Register]
) -> tuple[bytes, Row]:
    """A chunk of an import's registers as one `session_import_registers` call."""
    return (
        q.import_registers,
        (
            session_id,
            token,
            [r.namespace for r in registers],
            [r.key for r in registers],
            [r.seq for r in registers],
            [r.value_json for r in registers],
        ),
    )


def chunks(items: Iterable[Item], size: int) -> Iterator[list[Item]]:
    """`items` in lists of `size` (the last one shorter), read lazily."""
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def delete_interrupted(session_id: str, exc: PgleaseError) -> SessionError:
    """A chunked delete that stopped after hiding the session."""
    return SessionError(
        f"session {session_id} is deleted (hidden at once) but removing its rows stopped:"
        f" {exc}; the hidden remainder is removed by cleanup_imports() once stale, or by"
        " the next import of this id"
    )


#: Seconds a chunk transaction of an import or a purge aims at: the chunk size
#: adapts to the time the previous chunk took (`ChunkSizer`).
CHUNK_TARGET = 0.05
#: A chunk never shrinks below this many entries or rows (nor below its limit,
#: if smaller): a 100-row transaction is short whatever the server does.
CHUNK_FLOOR = 100


class ChunkSizer:
    """Entries or rows per chunk transaction, adapted so a transaction stays
    near `target` seconds: after a chunk that took longer, the size shrinks in
    proportion; after one under half the target, it doubles; always between
    `min(limit, CHUNK_FLOOR)` and `limit`. Late chunks of a big import or
    purge cost more (deeper indexes, dead index entries to step over,
    checkpoints), so a fixed size either wastes the early ones or lets the
    late ones run long (bench/RESULTS-sessions.md, run 6)."""

    def __init__(self, limit: int, target: float = CHUNK_TARGET) -> None:
        self.limit = limit
        self.floor = min(limit, CHUNK_FLOOR)
        self.target = target
        self.size = limit

    def record(self, seconds: float) -> None:
        """The previous chunk of `size` took `seconds`."""
        if seconds > self.target:
            self.size = max(self.floor, int(self.size * self.target / seconds))
        elif seconds < self.target / 2:
            self.size = min(self.limit, self.size * 2)


def sized_chunks(items: Iterable[Item], sizer: ChunkSizer) -> Iterator[list[Item]]:
    """`items` in lists of the sizer's current size (the last one shorter), read lazily."""
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) >= sizer.size:
            yield batch
            batch = []
    if batch:
        yield batch


def check_chunk_size(value: object, name: str = "chunk_entries") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise InvalidSessionWriteError(f"{name} must be an int in [1, 1000000], got {value!r}")
    return value


def check_stale_after(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidSessionWriteError(f"stale_after must be seconds >= 0, got {value!r}")
    return float(value)
