"""What the sync and asyncio PostgreSQL session stores share: SQL, the buffered
branch index, and the commit / plan builders.

Neither store's semantics can drift from the other's: both move the same
statements over a connection. The branch-index algorithm (`index_entry`,
`scan_branch`) is synchronous; the asyncio store runs it against a
`ReplayIndex`, which answers reads from what was fetched so far and raises
`Miss` for anything else. The driver fetches that and runs the step again.
That is safe because every step of the algorithm reads everything it needs
before its first write (all writes are buffered here anyway).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

import psycopg
from psycopg import sql

from ..errors import PgleaseError
from ..ids import resource_id
from ..postgres import _core as store_core
from .branch_index import BranchIndexStore, BranchQuery, BranchRow, Segment, index_entry
from .errors import (
    DuplicateIdError,
    InvalidSessionWriteError,
    SessionCorruptError,
    SessionError,
    SessionExistsError,
    SessionNotFoundError,
    SessionVersionError,
    UnknownEntryError,
)
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
from .schema import EMPTY_USAGE_JSON, ENTRY_TYPES, IDLE_LANE_STATE_JSON, MAIN_LANE, STORAGE_VERSION
from .writes import Prepared

#: Resource type of a session's writer lease.
RESOURCE_TYPE = "session"
#: Owner type of a session writer handle.
OWNER_TYPE = "session"
#: Rows of the first round trip when a branch scan pages through a segment
#: (pages then double, up to MAX_PAGE).
SCAN_PAGE = 256
MAX_PAGE = 8192

Item = TypeVar("Item")
Row: TypeAlias = tuple[Any, ...]
#: One statement and the parameter rows to run it with (executemany).
Batch: TypeAlias = tuple[bytes, list[Row]]


class Sql:
    """The session SQL of one schema, composed once per repository."""

    def __init__(self, schema: str) -> None:
        s = sql.Identifier(schema)

        def q(text: str) -> bytes:
            return sql.SQL(text).format(s=s).as_string(None).encode()

        entry_cols = "id, parent_id, seq, type, custom_type, timestamp, payload"
        seg_cols = "branch_id, tip_entry_id, tip_seq, base_branch_id, base_seq"
        self.read_only = q("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        session_cols = (
            "created_at, parent_session_id, storage_version, message_count, usage_payload, next_seq"
        )
        self.session_row = q(
            f"SELECT {session_cols} FROM {{s}}.sessions WHERE id = %s AND import_token IS NULL"
        )
        self.lock_session = q(
            "SELECT next_seq, message_count, usage_payload,"
            " (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
            " FROM {s}.sessions WHERE id = %s AND import_token IS NULL FOR UPDATE"
        )
        self.update_session = q(
            "UPDATE {s}.sessions SET next_seq = %s, message_count = %s, usage_payload = %s"
            " WHERE id = %s"
        )
        self.insert_session = q(
            "INSERT INTO {s}.sessions (id, resource_id, created_at, parent_session_id,"
            " storage_version, metadata, message_count, usage_payload, next_seq)"
            " VALUES (%s, %s, coalesce(%s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint),"
            " %s, %s, NULL, %s, %s, %s) ON CONFLICT DO NOTHING"
        )
        self.session_exists = q(
            "SELECT storage_version FROM {s}.sessions WHERE id = %s AND import_token IS NULL"
        )
        self.entry_count = q("SELECT count(*) FROM {s}.session_entries WHERE session_id = %s")
        self.insert_entry = q(
            f"INSERT INTO {{s}}.session_entries (session_id, {entry_cols})"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
        )
        self.get_entry = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s AND id = %s"
        )
        self.entries_by_ids = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s AND id = ANY(%s)"
        )
        self.known_entries = q(
            "SELECT id, seq FROM {s}.session_entries WHERE session_id = %s AND id = ANY(%s)"
        )
        self.known_usage = q(
            "SELECT id FROM {s}.session_usage_ledger WHERE session_id = %s AND id = ANY(%s)"
        )
        self.scan_entries = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s AND seq > %s"
            " AND (%s::text[] IS NULL OR type = ANY(%s::text[])) ORDER BY seq LIMIT %s"
        )
        self.all_entries = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s ORDER BY seq"
        )
        self.upsert_register = q(
            "INSERT INTO {s}.session_registers (session_id, namespace, key, seq, value)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (session_id, namespace, key)"
            " DO UPDATE SET seq = excluded.seq, value = excluded.value"
        )
        self.delete_register = q(
            "DELETE FROM {s}.session_registers WHERE session_id = %s AND namespace = %s"
            " AND key = %s"
        )
        self.get_register = q(
            "SELECT namespace, key, seq, value FROM {s}.session_registers"
            " WHERE session_id = %s AND namespace = %s AND key = %s"
        )
        self.list_registers = q(
            "SELECT namespace, key, seq, value FROM {s}.session_registers"
            " WHERE session_id = %s AND namespace = %s AND key >= %s AND starts_with(key, %s)"
            " ORDER BY key"
        )
        self.all_registers = q(
            "SELECT namespace, key, seq, value FROM {s}.session_registers"
            " WHERE session_id = %s ORDER BY namespace, key"
        )
        usage_cols = "id, seq, entry_id, adjustment, usage, details"
        self.insert_usage = q(
            f"INSERT INTO {{s}}.session_usage_ledger (session_id, {usage_cols})"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)"
        )
        self.usage_rows = q(
            f"SELECT {usage_cols} FROM {{s}}.session_usage_ledger WHERE session_id = %s"
            " ORDER BY seq"
        )
        # -- branch index
        self.segment = q(
            f"SELECT {seg_cols} FROM {{s}}.session_branch_meta"
            " WHERE session_id = %s AND branch_id = %s"
        )
        self.segments_by_tips = q(
            f"SELECT {seg_cols} FROM {{s}}.session_branch_meta"
            " WHERE session_id = %s AND tip_entry_id = ANY(%s)"
        )
        self.segment_by_tip = q(
            f"SELECT {seg_cols} FROM {{s}}.session_branch_meta"
            " WHERE session_id = %s AND tip_entry_id = %s"
        )
        self.covering_segment = q(
            "SELECT m.branch_id, m.tip_entry_id, m.tip_seq, m.base_branch_id, m.base_seq"
            " FROM {s}.session_branch_entries AS e JOIN {s}.session_branch_meta AS m"
            " ON m.session_id = e.session_id AND m.branch_id = e.branch_id"
            " WHERE e.session_id = %s AND e.entry_id = %s AND coalesce(m.base_seq, 0) < %s"
            " AND %s <= m.tip_seq ORDER BY m.tip_seq DESC, m.branch_id LIMIT 1"
        )
        self.newest_row_of_type = q(
            "SELECT entry_id, entry_seq, entry_type FROM {s}.session_branch_entries"
            " WHERE session_id = %s AND branch_id = %s AND entry_type = %s"
            " AND entry_seq > %s AND entry_seq <= %s ORDER BY entry_seq DESC LIMIT 1"
        )
        be_where = (
            " WHERE be.session_id = %s AND be.branch_id = %s AND be.entry_seq > %s"
            " AND be.entry_seq <= %s"
        )
        self.rows = {
            order: q(
                "SELECT be.entry_id, be.entry_seq, be.entry_type"
                " FROM {s}.session_branch_entries AS be"
                + be_where
                + f" ORDER BY be.entry_seq {order} LIMIT %s"
            )
            for order in ("ASC", "DESC")
        }
        self.rows_with_entries = {
            order: q(
                "SELECT be.entry_id, be.entry_seq, be.entry_type, x.id, x.parent_id, x.seq,"
                " x.type, x.custom_type, x.timestamp, x.payload"
                " FROM {s}.session_branch_entries AS be"
                " LEFT JOIN {s}.session_entries AS x"
                " ON x.session_id = be.session_id AND x.id = be.entry_id"
                + be_where
                + f" ORDER BY be.entry_seq {order} LIMIT %s"
            )
            for order in ("ASC", "DESC")
        }
        self.insert_segment = q(
            f"INSERT INTO {{s}}.session_branch_meta (session_id, {seg_cols})"
            " VALUES (%s, %s, %s, %s, %s, %s)"
        )
        self.move_tip = q(
            "UPDATE {s}.session_branch_meta SET tip_entry_id = %s, tip_seq = %s"
            " WHERE session_id = %s AND branch_id = %s"
        )
        self.insert_branch_row = q(
            "INSERT INTO {s}.session_branch_entries"
            " (session_id, branch_id, entry_id, entry_seq, entry_type) VALUES (%s, %s, %s, %s, %s)"
        )
        # -- listing: the live lease only (owner recorded and unexpired by the DB clock)
        self.list_sessions = q(
            "SELECT s.id, s.created_at, s.parent_session_id, s.storage_version, s.message_count,"
            " s.usage_payload, s.next_seq, l.owner_id, l.generation,"
            " (extract(epoch FROM l.expires_at) * 1000)::bigint"
            " FROM {s}.sessions AS s LEFT JOIN {s}.leases AS l ON l.resource_id = s.resource_id"
            " AND l.owner_id IS NOT NULL AND l.expires_at > clock_timestamp()"
            " WHERE s.import_token IS NULL AND (%s::text IS NULL OR s.id = %s)"
        )
        # -- streamed forks and chunked imports (sql/0013_session_imports.sql)
        # A fork reads every row of its cursor: plan for all of them. With the
        # default fraction (0.1) the planner picked a fast-start plan for the
        # path walk that took 1.59 s instead of 15 ms on a 5,000-entry branch.
        self.read_whole_cursor = q("SET LOCAL cursor_tuple_fraction = 1")
        self.path_entries = q(
            "WITH RECURSIVE path (id, parent_id, seq) AS ("
            " SELECT id, parent_id, seq FROM {s}.session_entries WHERE session_id = %s AND id = %s"
            " UNION ALL SELECT e.id, e.parent_id, e.seq FROM path AS p"
            " JOIN {s}.session_entries AS e"
            " ON e.session_id = %s AND e.id = p.parent_id AND e.seq < p.seq)"
            " SELECT x.id, x.parent_id, x.seq, x.type, x.custom_type, x.timestamp, x.payload"
            " FROM path JOIN {s}.session_entries AS x ON x.session_id = %s AND x.id = path.id"
            " ORDER BY x.seq"
        )
        self.begin_import = q(
            "INSERT INTO {s}.sessions (id, resource_id, created_at, parent_session_id,"
            " storage_version, metadata, message_count, usage_payload, next_seq,"
            " import_token, import_touched_at)"
            " VALUES (%s, %s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint, %s, %s,"
            " NULL, 0, %s, 1, %s, clock_timestamp()) ON CONFLICT DO NOTHING"
        )
        self.import_state = q(
            "SELECT import_token IS NOT NULL,"
            " extract(epoch FROM clock_timestamp() - import_touched_at)::float8"
            " FROM {s}.sessions WHERE id = %s"
        )
        self.touch_import = q(
            "UPDATE {s}.sessions SET import_touched_at = clock_timestamp()"
            " WHERE id = %s AND import_token = %s RETURNING 1"
        )
        self.take_import = q(
            "UPDATE {s}.sessions SET import_token = %s, import_touched_at = clock_timestamp()"
            " WHERE id = %s AND import_token IS NOT NULL"
            " AND import_touched_at <= clock_timestamp() - make_interval(secs => %s)"
            " RETURNING 1"
        )
        self.stale_imports = q(
            "SELECT id, extract(epoch FROM clock_timestamp() - import_touched_at)::float8"
            " FROM {s}.sessions WHERE import_token IS NOT NULL"
            " AND import_touched_at <= clock_timestamp() - make_interval(secs => %s)"
            " AND (%s::text IS NULL OR id = %s) ORDER BY import_touched_at, id"
        )
        self.purge_rows = [
            q(
                f"DELETE FROM {{s}}.{table} WHERE ctid = ANY(ARRAY("
                f"SELECT ctid FROM {{s}}.{table} WHERE session_id = %s LIMIT %s))"
            )
            for table in (
                "session_branch_entries",
                "session_branch_meta",
                "session_registers",
                "session_usage_ledger",
                "session_entries",
            )
        ]
        # A chunked delete hides the session the way an import is hidden (a
        # token of its own) inside its fenced `session.deleted` mutation, then
        # removes the rows like a failed import's purge.
        self.hide_session = q(
            "UPDATE {s}.sessions SET import_token = %s, import_touched_at = clock_timestamp()"
            " WHERE id = %s AND import_token IS NULL RETURNING 1"
        )
        self.drop_import = q("DELETE FROM {s}.sessions WHERE id = %s AND import_token = %s")
        self.finish_import = q(
            "UPDATE {s}.sessions SET import_token = NULL, import_touched_at = NULL,"
            " created_at = coalesce(%s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint),"
            " message_count = %s, next_seq = %s WHERE id = %s AND import_token = %s"
        )
        # -- import chunks as one statement each (sql/0015_session_import_chunks.sql)
        self.import_alive = q("SELECT 1 FROM {s}.sessions WHERE id = %s AND import_token = %s")
        # covering_segment's best on the server, plus the segments among the
        # given ones (those whose tip a chunk moved, unsent) that hold the
        # entry: ChunkIndex judges them with their new tips.
        covering = (
            "SELECT m.branch_id, m.tip_entry_id, m.tip_seq, m.base_branch_id, m.base_seq"
            " FROM {s}.session_branch_entries AS e JOIN {s}.session_branch_meta AS m"
            " ON m.session_id = e.session_id AND m.branch_id = e.branch_id"
            " WHERE e.session_id = %s AND e.entry_id = %s AND coalesce(m.base_seq, 0) < %s"
            " AND %s <= m.tip_seq"
        )
        self.covering_segments = q(
            f"({covering} ORDER BY m.tip_seq DESC, m.branch_id LIMIT 1)"
            f" UNION ({covering} AND m.branch_id = ANY(%s::text[]))"
        )
        # The arrays go in binary (%b): psycopg's text format escapes every
        # element with a regular expression, 10 ms of client CPU for 500 JSON
        # payloads against 0.3 ms in binary.
        self.import_chunk = q(
            "SELECT {s}.session_import_chunk(%s, %s,"
            " %b::text[], %b::text[], %b::bigint[], %b::text[], %b::text[], %b::bigint[],"
            " %b::text[], %b::text[], %b::text[], %b::bigint[], %b::text[], %b::bigint[],"
            " %b::text[], %b::text[], %b::bigint[],"
            " %b::text[], %b::text[], %b::bigint[], %b::text[])"
        )
        self.import_registers = q(
            "SELECT {s}.session_import_registers(%s, %s, %b::text[], %b::text[],"
            " %b::bigint[], %b::text[])"
        )


def new_owner_id() -> str:
    """A fresh writer-handle owner id: `<host>/<pid>/<uuid7>` (names the holder in errors)."""
    host = socket.gethostname()[:100] or "host"
    return f"{host}/{os.getpid()}/{uuid7()}"


class _Store(Protocol):
    """What the error mapping needs of either PostgreSQL store."""

    @property
    def limits(self) -> store_core.Limits: ...

    @property
    def dsn(self) -> str | None: ...


def pooler_limits(store: _Store) -> bytes | None:
    """Pooler mode: the store's limits as one `set_config(..., true)` statement for
    the start of a read's transaction (no session SET bounds a read there)."""
    return store_core.pooler_local_limits(store)


def driver_error(store: _Store, exc: psycopg.Error, broken: bool = False) -> PgleaseError:
    """A driver error of the session SQL as a PgleaseError, named as the store names
    its own: its time limits (StatementTimeoutError, LockTimeoutError), a lost
    connection (DatabaseUnavailableError; `broken`: nothing was committed), no
    password. Raise it `from cause_of(error, exc)`."""
    if broken:
        return store_core.lost(exc, store.dsn)
    return store_core.driver_error(exc, store.limits, store.dsn)


def cause_of(error: PgleaseError, exc: psycopg.Error) -> psycopg.Error | None:
    """The driver error to keep as `__cause__` (None for pglease's own refusals)."""
    return store_core.cause_of(error, exc)


def translate_unique(exc: psycopg.errors.UniqueViolation) -> SessionError:
    """A unique violation from a session write, as the session error it means."""
    constraint = exc.diag.constraint_name or ""
    if "sessions" in constraint and "pkey" in constraint:
        return SessionExistsError(str(exc.diag.message_detail or exc).strip())
    return DuplicateIdError(f"an id is already used: {exc.diag.message_detail or exc}")


# --- rows ----------------------------------------------------------------------------------


def entry_from_row(row: Sequence[Any]) -> Entry:
    """An `Entry` from `(id, parent_id, seq, type, custom_type, timestamp, payload)`."""
    entry_id, parent_id, seq, type_, custom_type, timestamp, payload = row
    if type_ not in ENTRY_TYPES:
        raise SessionCorruptError(f"entry {entry_id} has unknown type {type_!r}")
    return Entry(entry_id, parent_id, int(seq), type_, custom_type, int(timestamp), payload)


def register_from_row(row: Sequence[Any]) -> Register:
    return Register(row[0], row[1], int(row[2]), row[3])


def usage_from_row(row: Sequence[Any]) -> UsageRow:
    return UsageRow(row[0], int(row[1]), row[2], bool(row[3]), row[4], row[5])


def segment_from_row(row: Sequence[Any] | None) -> Segment | None:
    return None if row is None else Segment(row[0], row[1], int(row[2]), row[3], row[4])


def check_scan_args(
    after_seq: object, limit: object, types: Iterable[object] | None
) -> list[str] | None:
    """Check `scan_entries` arguments before they reach SQL; return the type list."""
    if isinstance(after_seq, bool) or not isinstance(after_seq, int):
        raise InvalidSessionWriteError(f"after_seq must be an int, got {after_seq!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidSessionWriteError(f"limit must be an int >= 0, got {limit!r}")
    if types is None:
        return None
    wanted = list(types)
    if not all(isinstance(t, str) for t in wanted):
        raise InvalidSessionWriteError(f"types must be strings, got {wanted!r}")
    return [str(t) for t in wanted]


def first_page_for(query: BranchQuery) -> int:
    """Rows to fetch first in a branch scan: without filters a valid limit bounds
    the rows needed (the +1 lets the scan see the page was not short)."""
    limit = query.limit
    bounded = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
    if bounded and limit is not None and query.types is None and query.custom_type is None:
        return min(limit + 1, SCAN_PAGE)
    return SCAN_PAGE


def check_version(session_id: str, version: int) -> None:
    if version > STORAGE_VERSION:
        raise SessionVersionError(
            f"session {session_id} has storage_version {version}, newer than {STORAGE_VERSION}"
        )
    if version < STORAGE_VERSION:
        raise SessionVersionError(
            f"session {session_id} has storage_version {version}, which requires migrations"
        )


# --- the buffered branch index ---------------------------------------------------------------


class IndexCore(BranchIndexStore):
    """The `session_branch_*` tables as a `BranchIndexStore`, in one transaction.

    Writes are buffered (`pending()` hands them out as batches): appending a
    chain of entries (rule 2, the common case) costs no round trip per entry.
    Segments read or written are cached as they are now. Other reads go
    through `fetch`, which subclasses implement (flushing first, so reads see
    every write). With `load_entries`, `rows()` fetches the entries with the
    index rows (one round trip per page); `load()` hands them out.
    """

    def __init__(
        self,
        q: Sql,
        session_id: str,
        *,
        load_entries: bool = False,
        first_page: int = SCAN_PAGE,
    ) -> None:
        self.q = q
        self.session_id = session_id
        self.load_entries = load_entries
        self.first_page = max(1, first_page)
        self.loaded: dict[str, Entry] = {}
        self._segments: dict[str, Segment] = {}
        self._by_tip: dict[str, str] = {}
        self._new: list[str] = []
        self._moved: set[str] = set()
        self._rows: list[Row] = []

    def fetch(self, query: bytes, params: Row) -> list[Row]:
        """Run a read (after any buffered writes) and return its rows."""
        raise NotImplementedError

    def _written(self) -> None:
        """Called after every buffered write."""

    def remember(self, segment: Segment | None) -> Segment | None:
        """Cache a segment read in this transaction; a cached one is never older."""
        if segment is not None:
            old = self._segments.get(segment.branch_id)
            if old is not None:
                return old
            self._segments[segment.branch_id] = segment
            self._by_tip[segment.tip_entry_id] = segment.branch_id
        return segment

    def pending(self) -> list[Batch]:
        """Buffered writes as batches (segment inserts, tip moves, rows); clears them."""
        sid = self.session_id
        batches: list[Batch] = []
        if self._new:
            batches.append(
                (
                    self.q.insert_segment,
                    [
                        (sid, s.branch_id, s.tip_entry_id, s.tip_seq, s.base_branch_id, s.base_seq)
                        for s in (self._segments[b] for b in self._new)
                    ],
                )
            )
        if self._moved:
            batches.append(
                (
                    self.q.move_tip,
                    [
                        (s.tip_entry_id, s.tip_seq, sid, s.branch_id)
                        for s in (self._segments[b] for b in sorted(self._moved))
                    ],
                )
            )
        if self._rows:
            batches.append((self.q.insert_branch_row, list(self._rows)))
        self._new.clear()
        self._moved.clear()
        self._rows.clear()
        return batches

    def _one(self, query: bytes, params: Row) -> Row | None:
        rows = self.fetch(query, params)
        return rows[0] if rows else None

    def segment(self, branch_id: str) -> Segment | None:
        if branch_id in self._segments:
            return self._segments[branch_id]
        return self.remember(
            segment_from_row(self._one(self.q.segment, (self.session_id, branch_id)))
        )

    def segment_by_tip(self, tip_entry_id: str) -> Segment | None:
        branch_id = self._by_tip.get(tip_entry_id)
        if branch_id is not None:
            return self._segments[branch_id]
        return self.remember(
            segment_from_row(self._one(self.q.segment_by_tip, (self.session_id, tip_entry_id)))
        )

    def covering_segment(self, entry_id: str, entry_seq: int) -> Segment | None:
        row = self._one(self.q.covering_segment, (self.session_id, entry_id, entry_seq, entry_seq))
        return self.remember(segment_from_row(row))

    def newest_row_of_type(
        self, branch_id: str, entry_type: str, above_seq: int, upto_seq: int
    ) -> BranchRow | None:
        row = self._one(
            self.q.newest_row_of_type,
            (self.session_id, branch_id, entry_type, above_seq, upto_seq),
        )
        return None if row is None else BranchRow(row[0], int(row[1]), row[2])

    def rows(
        self, branch_id: str, above_seq: int, upto_seq: int, newest_first: bool
    ) -> Iterator[BranchRow]:
        """Pages by keyset, so a scan with a small limit reads little: the first
        page is `first_page` rows, each next one twice as big (up to `MAX_PAGE`)."""
        order = "DESC" if newest_first else "ASC"
        query = (self.q.rows_with_entries if self.load_entries else self.q.rows)[order]
        low, high = above_seq, upto_seq
        size = self.first_page
        while high > low:
            page = self.fetch(query, (self.session_id, branch_id, low, high, size))
            for r in page:
                if self.load_entries and r[3] is not None:
                    self.loaded[r[0]] = entry_from_row(r[3:])
                yield BranchRow(r[0], int(r[1]), r[2])
            if len(page) < size:
                return
            last = int(page[-1][1])
            if newest_first:
                high = last - 1
            else:
                low = last
            size = min(size * 2, MAX_PAGE)

    def add_segment(self, segment: Segment) -> None:
        if segment.branch_id in self._segments or segment.tip_entry_id in self._by_tip:
            raise SessionCorruptError(f"segment {segment.branch_id} already exists")
        self._segments[segment.branch_id] = segment
        self._by_tip[segment.tip_entry_id] = segment.branch_id
        self._new.append(segment.branch_id)
        self._written()

    def move_tip(self, branch_id: str, tip_entry_id: str, tip_seq: int) -> None:
        old = self._segments.get(branch_id)
        if old is None:  # the algorithm always reads a segment before moving its tip
            raise SessionCorruptError(f"corrupt branch index: no segment {branch_id}")
        self._by_tip.pop(old.tip_entry_id, None)
        self._segments[branch_id] = Segment(
            branch_id, tip_entry_id, tip_seq, old.base_branch_id, old.base_seq
        )
        self._by_tip[tip_entry_id] = branch_id
        if branch_id not in self._new:
            self._moved.add(branch_id)
        self._written()

    def add_rows(self, branch_id: str, rows: Sequence[BranchRow]) -> None:
        sid = self.session_id
        self._rows.extend((sid, branch_id, r.entry_id, r.entry_seq, r.entry_type) for r in rows)
        self._written()

    def load(self, row: BranchRow) -> Entry:
        """The entry of a row returned by `rows()` (fetched with it when possible)."""
        entry = self.loaded.get(row.entry_id)
        if entry is not None:
            return entry
        found = self._one(self.q.get_entry, (self.session_id, row.entry_id))
        if found is None:
            raise SessionCorruptError(
                f"corrupt branch index: indexed entry {row.entry_id!r} does not exist"
            )
        return entry_from_row(found)


class Miss(Exception):
    """A `ReplayIndex` read that has not been fetched yet (internal)."""

    def __init__(self, query: bytes, params: Row) -> None:
        super().__init__("branch index read not fetched yet")
        self.query = query
        self.params = params


class ReplayIndex(IndexCore):
    """An `IndexCore` for drivers that cannot block (asyncio): a read answers
    from the rows fetched so far or raises `Miss`; the driver flushes
    `pending()`, fetches, `supply()`s the rows and runs the step again.

    A write forgets fetched reads (the next run of a read must see it);
    cached segments stay valid because every change goes through this object.
    """

    def __init__(self, q: Sql, session_id: str, **kwargs: Any) -> None:
        super().__init__(q, session_id, **kwargs)
        self._reads: dict[tuple[bytes, Row], list[Row]] = {}

    def fetch(self, query: bytes, params: Row) -> list[Row]:
        found = self._reads.get((query, params))
        if found is None:
            raise Miss(query, params)
        return found

    def supply(self, miss: Miss, rows: list[Row]) -> None:
        self._reads[(miss.query, miss.params)] = rows

    def _written(self) -> None:
        self._reads.clear()


def send(conn: psycopg.Connection[Any], batches: Sequence[Batch]) -> None:
    """Run write batches in order on a blocking connection."""
    if batches:
        with conn.cursor() as cur:
            for query, rows in batches:
                cur.executemany(query, rows)


class PgBranchIndex(IndexCore):
    """The branch index on a blocking connection, in the caller's transaction:
    a read the caches cannot answer flushes the buffered writes, then queries.
    (The asyncio store cannot block inside the algorithm: it uses `ReplayIndex`.)"""

    def __init__(
        self, conn: psycopg.Connection[Any], q: Sql, session_id: str, **kwargs: Any
    ) -> None:
        super().__init__(q, session_id, **kwargs)
        self.conn = conn

    def flush(self) -> None:
        """Send the buffered segment inserts, tip moves and rows."""
        send(self.conn, self.pending())

    def fetch(self, query: bytes, params: Row) -> list[Row]:
        self.flush()
        return self.conn.execute(query, params).fetchall()


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
