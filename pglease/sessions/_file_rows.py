"""The rows of a session file: checks on read, the writer lease row, entries and
their branch index (`SqliteBranchIndex`), each inside the caller's transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._file_db import transaction
from .branch_index import BranchIndexStore, BranchRow, Segment, index_entry
from .errors import SessionAlreadyClaimedError, SessionCorruptError, SessionVersionError
from .model import Entry, LeaseInfo, Register, SessionSnapshot
from .schema import ENTRY_TYPES, STORAGE_VERSION, TABLES


def check_tables(conn: sqlite3.Connection, path: Path) -> None:
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    missing = [t for t in TABLES if t not in names]
    if missing:
        raise SessionCorruptError(f"session file {path} is missing table(s): {', '.join(missing)}")


def read_session_row(conn: sqlite3.Connection, path: Path) -> tuple[Any, ...]:
    """The single session row, after the table, row-count and version checks:
    (created_at, parent_session_id, storage_version, metadata, message_count,
    usage_payload, next_seq)."""
    check_tables(conn, path)
    rows = conn.execute(
        "SELECT created_at, parent_session_id, storage_version, metadata, message_count,"
        " usage_payload, next_seq FROM session LIMIT 2"
    ).fetchall()
    if len(rows) != 1:
        raise SessionCorruptError(
            f"session file {path} must have exactly one session row, found "
            f"{'none' if not rows else 'more than one'}"
        )
    row = rows[0]
    version = row[2]
    if not isinstance(version, int):
        raise SessionCorruptError(f"session file {path} has storage_version {version!r}")
    if version > STORAGE_VERSION:
        raise SessionVersionError(
            f"session file {path} has storage_version {version}, newer than {STORAGE_VERSION}"
        )
    if version < STORAGE_VERSION:
        raise SessionVersionError(
            f"session file {path} has storage_version {version}, which requires migrations"
        )
    if not isinstance(row[6], int) or not isinstance(row[4], int):
        raise SessionCorruptError(f"session file {path} has a malformed session row")
    return tuple(row)


#: The `owner_id` of a released lease row: no holder. A release keeps the row
#: (and its fence) so that the next claim takes generation fence + 1, as a
#: takeover of an expired lease does; the harness's claim reads such a row as
#: an expired lease of another owner and does the same.
RELEASED_OWNER = ""

#: The `expires_at_ms` of a released lease row: long past, by any clock.
RELEASED_EXPIRES_MS = 0


def read_lease_row(conn: sqlite3.Connection) -> LeaseInfo | None:
    """The writer_lease row as it is, a released one included (None: no row)."""
    rows = conn.execute(
        "SELECT owner_id, fence, expires_at_ms FROM writer_lease LIMIT 2"
    ).fetchall()
    if not rows:
        return None
    if len(rows) > 1:
        raise SessionCorruptError("writer_lease holds more than one row")
    owner, fence, expires = rows[0]
    return LeaseInfo(str(owner), int(fence), int(expires))


def read_lease(conn: sqlite3.Connection) -> LeaseInfo | None:
    """The file's writer lease (live or run out), or None when nobody claimed
    it since it was released, or ever."""
    lease = read_lease_row(conn)
    if lease is None or lease.owner_id == RELEASED_OWNER:
        return None
    return lease


def release_lease(conn: sqlite3.Connection, owner_id: str, fence: int) -> bool:
    """Release the lease inside the caller's write transaction if `owner_id`
    still holds it at `fence` (a stale owner cannot release its successor's).
    The row stays, holder cleared, fence kept: generations never go back.
    False when the lease was no longer this one."""
    cur = conn.execute(
        "UPDATE writer_lease SET owner_id = ?, expires_at_ms = ? WHERE owner_id = ? AND fence = ?",
        (RELEASED_OWNER, RELEASED_EXPIRES_MS, owner_id, fence),
    )
    return cur.rowcount == 1


def claim_lease(
    conn: sqlite3.Connection, session_id: str, owner_id: str, now: int, lease_ms: int
) -> int:
    """Claim the writer lease inside the caller's write transaction; return the fence.

    No row: fence 1. A live lease of another owner: refused. Otherwise (run
    out, or released) taken over with fence + 1, so a fence is never handed
    out twice for a session while its row lasts."""
    lease = read_lease_row(conn)
    expires = now + lease_ms
    if lease is None:
        conn.execute(
            "INSERT INTO writer_lease (owner_id, fence, expires_at_ms) VALUES (?, 1, ?)",
            (owner_id, expires),
        )
        return 1
    released = lease.owner_id == RELEASED_OWNER
    if not released and lease.owner_id != owner_id and lease.expires_at_ms > now:
        raise SessionAlreadyClaimedError(
            f"session {session_id} is already claimed by writer {lease.owner_id} "
            f"(fence {lease.fence}, expires in {lease.expires_at_ms - now} ms)"
        )
    fence = lease.fence if lease.owner_id == owner_id else lease.fence + 1
    conn.execute(
        "UPDATE writer_lease SET owner_id = ?, fence = ?, expires_at_ms = ?",
        (owner_id, fence, expires),
    )
    return fence


ENTRY_COLUMNS = "id, parent_id, seq, type, custom_type, timestamp, payload"


def entry_from_row(row: Sequence[Any]) -> Entry:
    entry_id, parent_id, seq, type_, custom_type, timestamp, payload = row
    if type_ not in ENTRY_TYPES:
        raise SessionCorruptError(f"entry {entry_id} has unknown type {type_!r}")
    if type_ == "custom" and not custom_type:
        raise SessionCorruptError(f"custom entry {entry_id} has no custom_type")
    if type_ != "custom" and custom_type is not None:
        raise SessionCorruptError(f"{type_} entry {entry_id} has a custom_type")
    if not isinstance(payload, str) or not isinstance(seq, int):
        raise SessionCorruptError(f"entry {entry_id} has a malformed row")
    return Entry(str(entry_id), parent_id, seq, type_, custom_type, int(timestamp), payload)


def read_snapshot(conn: sqlite3.Connection, path: Path) -> SessionSnapshot:
    """Entries (seq order) and registers in one consistent read transaction."""
    with transaction(conn, immediate=False):
        row = read_session_row(conn, path)
        entries = tuple(
            entry_from_row(r)
            for r in conn.execute(f"SELECT {ENTRY_COLUMNS} FROM entries ORDER BY seq, id")
        )
        registers = tuple(
            Register(ns, key, seq, value)
            for ns, key, seq, value in conn.execute(
                "SELECT namespace, key, seq, value FROM registers ORDER BY namespace, key"
            )
        )
    return SessionSnapshot(entries, registers, row[1])


# --- the branch index on SQLite ----------------------------------------------------------

_SEGMENT_COLUMNS = "branch_id, tip_entry_id, tip_seq, base_branch_id, base_seq"


def _segment(row: Sequence[Any] | None) -> Segment | None:
    return None if row is None else Segment(row[0], row[1], row[2], row[3], row[4])


class SqliteBranchIndex(BranchIndexStore):
    """`branch_entries` / `branch_meta` as a `BranchIndexStore` (caller's transaction)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def segment(self, branch_id: str) -> Segment | None:
        return _segment(
            self.conn.execute(
                f"SELECT {_SEGMENT_COLUMNS} FROM branch_meta WHERE branch_id = ?", (branch_id,)
            ).fetchone()
        )

    def segment_by_tip(self, tip_entry_id: str) -> Segment | None:
        return _segment(
            self.conn.execute(
                f"SELECT {_SEGMENT_COLUMNS} FROM branch_meta WHERE tip_entry_id = ?",
                (tip_entry_id,),
            ).fetchone()
        )

    def covering_segment(self, entry_id: str, entry_seq: int) -> Segment | None:
        return _segment(
            self.conn.execute(
                "SELECT m.branch_id, m.tip_entry_id, m.tip_seq, m.base_branch_id, m.base_seq"
                " FROM branch_entries AS e JOIN branch_meta AS m ON m.branch_id = e.branch_id"
                " WHERE e.entry_id = ? AND coalesce(m.base_seq, 0) < ? AND ? <= m.tip_seq"
                " ORDER BY m.tip_seq DESC, m.branch_id LIMIT 1",
                (entry_id, entry_seq, entry_seq),
            ).fetchone()
        )

    def newest_row_of_type(
        self, branch_id: str, entry_type: str, above_seq: int, upto_seq: int
    ) -> BranchRow | None:
        row = self.conn.execute(
            "SELECT entry_id, entry_seq, entry_type FROM branch_entries"
            " WHERE branch_id = ? AND entry_type = ? AND entry_seq > ? AND entry_seq <= ?"
            " ORDER BY entry_seq DESC LIMIT 1",
            (branch_id, entry_type, above_seq, upto_seq),
        ).fetchone()
        return None if row is None else BranchRow(row[0], row[1], row[2])

    def rows(
        self, branch_id: str, above_seq: int, upto_seq: int, newest_first: bool
    ) -> Iterable[BranchRow]:
        # Pages by keyset (256 rows, then doubling): a scan with a small limit
        # reads little, and no statement stays open between pages.
        order = "DESC" if newest_first else "ASC"
        low, high, size = above_seq, upto_seq, 256
        while high > low:
            page = self.conn.execute(
                "SELECT entry_id, entry_seq, entry_type FROM branch_entries"
                " WHERE branch_id = ? AND entry_seq > ? AND entry_seq <= ?"
                f" ORDER BY entry_seq {order} LIMIT ?",
                (branch_id, low, high, size),
            ).fetchall()
            for r in page:
                yield BranchRow(r[0], r[1], r[2])
            if len(page) < size:
                return
            if newest_first:
                high = page[-1][1] - 1
            else:
                low = page[-1][1]
            size = min(size * 2, 8192)

    def add_segment(self, segment: Segment) -> None:
        self.conn.execute(
            f"INSERT INTO branch_meta ({_SEGMENT_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
            (
                segment.branch_id,
                segment.tip_entry_id,
                segment.tip_seq,
                segment.base_branch_id,
                segment.base_seq,
            ),
        )

    def move_tip(self, branch_id: str, tip_entry_id: str, tip_seq: int) -> None:
        self.conn.execute(
            "UPDATE branch_meta SET tip_entry_id = ?, tip_seq = ? WHERE branch_id = ?",
            (tip_entry_id, tip_seq, branch_id),
        )

    def add_rows(self, branch_id: str, rows: Sequence[BranchRow]) -> None:
        self.conn.executemany(
            "INSERT INTO branch_entries (branch_id, entry_id, entry_seq, entry_type)"
            " VALUES (?, ?, ?, ?)",
            [(branch_id, r.entry_id, r.entry_seq, r.entry_type) for r in rows],
        )


def insert_entry(conn: sqlite3.Connection, entry: Entry, parent_seq: int | None) -> None:
    """Insert an entry row and index it (caller's transaction)."""
    conn.execute(
        f"INSERT INTO entries ({ENTRY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            entry.id,
            entry.parent_id,
            entry.seq,
            entry.type,
            entry.custom_type,
            entry.timestamp,
            entry.payload_json,
        ),
    )
    index_entry(
        SqliteBranchIndex(conn), entry.id, entry.seq, entry.type, entry.parent_id, parent_seq
    )
