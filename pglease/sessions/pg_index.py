"""The buffered branch index over PostgreSQL: `IndexCore` holds what a
transaction has read and buffers what it writes; `ReplayIndex` (asyncio)
raises `Miss` for a read it has not fetched, `PgBranchIndex` (blocking)
queries as it goes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from .branch_index import BranchIndexStore, BranchRow, Segment
from .errors import SessionCorruptError
from .model import Entry
from .pg_common import MAX_PAGE, SCAN_PAGE, Batch, Row, entry_from_row, segment_from_row
from .pg_sql import Sql

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
