"""The blocking work of one writer handle on its session file (`SessionFile`).

Both handle flavours (`SqliteSession`, and `AsyncSqliteSession`, which runs
these calls in a worker thread) are thin shells over this. Every method takes
the file's thread lock: a renewal from another thread and a caller's call
never share the connection at once.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import PgleaseError
from ._file_db import NowMs, mapped, transaction
from ._file_rows import (
    ENTRY_COLUMNS,
    SqliteBranchIndex,
    entry_from_row,
    insert_entry,
    read_session_row,
    read_snapshot,
    release_lease,
)
from .branch_index import BranchQuery, BranchRow
from .branch_index import scan_branch as _scan_branch
from .errors import (
    DuplicateIdError,
    InvalidSessionWriteError,
    SessionClosedError,
    SessionCorruptError,
    UnknownEntryError,
    WriterLeaseLostError,
)
from .ids import uuid7
from .model import (
    AddUsage,
    AppendEntry,
    CommitResult,
    Entry,
    Register,
    SessionSnapshot,
    SessionStats,
    SetRegister,
    UsageRow,
    Write,
    dump_json,
    load_json,
    sum_usage,
)
from .writes import prepare_writes

log = logging.getLogger("pglease.sessions")

_USAGE_COLUMNS = "id, seq, entry_id, adjustment, usage, details"


def _usage_row(r: Sequence[Any]) -> UsageRow:
    return UsageRow(r[0], r[1], r[2], bool(r[3]), r[4], r[5])


class SessionFile:
    """One open session file and the writer lease held on it.

    `on_lost` runs once, in whichever thread first finds the lease lost.
    """

    def __init__(
        self,
        *,
        session_id: str,
        path: Path,
        conn: sqlite3.Connection,
        owner_id: str,
        fence: int,
        lease_ms: int,
        now_ms: NowMs,
        busy_timeout: float,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.id = session_id
        self.path = path
        self.conn = conn
        self.owner_id = owner_id
        self.fence = fence
        self.lease_ms = lease_ms
        self.now_ms = now_ms
        self.busy_timeout = busy_timeout
        self.on_lost = on_lost
        self.lock = threading.RLock()
        self.closed = False
        #: Set when the handle starts closing: a loss reported after it is none.
        self.closing = False
        self.lost = threading.Event()
        self._lost_guard = threading.Lock()

    # -- state --

    def io(self) -> contextlib.AbstractContextManager[None]:
        """sqlite3 errors of the block as session errors naming this file."""
        return mapped(self.path, self.busy_timeout)

    def usable(self) -> sqlite3.Connection:
        if self.closed:
            raise SessionClosedError(f"session {self.id} handle is closed")
        if self.lost.is_set():
            raise WriterLeaseLostError(
                f"session {self.id}: writer lease was lost (fence {self.fence}); "
                "this handle refuses further work"
            )
        return self.conn

    def mark_lost(self, why: str = "no longer current") -> WriterLeaseLostError:
        """Record the loss (first time: run `on_lost`); the error to raise."""
        # Not under `lock`: the keeper's thread may report the loss while a
        # caller's commit holds it.
        with self._lost_guard:
            first = not self.lost.is_set()
            self.lost.set()
        if first and self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:
                log.exception("on_lost callback of session %s failed", self.id)
        return WriterLeaseLostError(
            f"session {self.id}: writer lease was lost (owner {self.owner_id}, "
            f"fence {self.fence} {why})"
        )

    # -- the lease --

    def _renew_in_transaction(self, conn: sqlite3.Connection, now: int) -> None:
        cur = conn.execute(
            "UPDATE writer_lease SET expires_at_ms = ? WHERE owner_id = ? AND fence = ?",
            (now + self.lease_ms, self.owner_id, self.fence),
        )
        if cur.rowcount != 1:
            raise self.mark_lost()

    def renew(self) -> None:
        """Extend the lease by the lease length; lost lease -> `WriterLeaseLostError`."""
        with self.lock, self.io():
            conn = self.usable()
            with transaction(conn):
                self._renew_in_transaction(conn, self.now_ms())

    def close(self) -> bool:
        """Release the lease (if still ours) and close the file; False when already closed."""
        with self.lock:
            if self.closed:
                return False
            try:
                if not self.lost.is_set():
                    with transaction(self.conn):
                        release_lease(self.conn, self.owner_id, self.fence)
            except (sqlite3.Error, PgleaseError) as exc:
                # Never raised from close(): the lease runs out on its own.
                log.warning("session %s: releasing the lease failed: %s", self.id, exc)
            finally:
                self.closed = True
                self.conn.close()
            return True

    # -- writes --

    def commit(self, writes: Sequence[Write]) -> CommitResult:
        """Apply `writes` in one transaction, renewing the lease in it (the fence check)."""
        prepared = prepare_writes(writes)
        with self.lock, self.io():
            conn = self.usable()
            now = self.now_ms()
            with transaction(conn):
                self._renew_in_transaction(conn, now)
                row = read_session_row(conn, self.path)
                first_seq = seq = int(row[6])
                message_count = int(row[4])
                usage: dict[str, Any] = load_json(row[5])
                ids: list[str | None] = []
                for item in prepared:
                    write, text, details = item.write, item.text, item.details
                    if isinstance(write, AppendEntry):
                        assert text is not None
                        entry_id = write.id or uuid7(now)
                        _check_unused(conn, entry_id)
                        parent_seq: int | None = None
                        if write.parent_id is not None:
                            found = conn.execute(
                                "SELECT seq FROM entries WHERE id = ?", (write.parent_id,)
                            ).fetchone()
                            if found is None:
                                raise UnknownEntryError(
                                    f"parent entry {write.parent_id!r} does not exist"
                                )
                            parent_seq = int(found[0])
                        entry = Entry(
                            entry_id,
                            write.parent_id,
                            seq,
                            write.type,
                            write.custom_type,
                            now,
                            text,
                        )
                        insert_entry(conn, entry, parent_seq)
                        if write.type == "message":
                            message_count += 1
                        ids.append(entry_id)
                    elif isinstance(write, AddUsage):
                        assert text is not None
                        usage_id = write.id or uuid7(now)
                        _check_unused(conn, usage_id)
                        conn.execute(
                            f"INSERT INTO usage_ledger ({_USAGE_COLUMNS})"
                            " VALUES (?, ?, ?, ?, ?, ?)",
                            (usage_id, seq, write.entry_id, int(write.adjustment), text, details),
                        )
                        usage = sum_usage(usage, write.usage)
                        ids.append(usage_id)
                    elif isinstance(write, SetRegister):
                        conn.execute(
                            "INSERT INTO registers (namespace, key, seq, value) VALUES (?, ?, ?, ?)"
                            " ON CONFLICT (namespace, key) DO UPDATE"
                            " SET seq = excluded.seq, value = excluded.value",
                            (write.namespace, write.key, seq, text),
                        )
                        ids.append(None)
                    else:
                        conn.execute(
                            "DELETE FROM registers WHERE namespace = ? AND key = ?",
                            (write.namespace, write.key),
                        )
                        ids.append(None)
                    seq += 1
                conn.execute(
                    "UPDATE session SET next_seq = ?, message_count = ?, usage_payload = ?",
                    (seq, message_count, dump_json(usage, "usage_payload")),
                )
        return CommitResult(first_seq, seq, now, tuple(ids))

    # -- reads --

    def _one(self, sql: str, params: Sequence[Any] = ()) -> Any:
        with self.lock, self.io():
            return self.usable().execute(sql, params).fetchone()

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self.lock, self.io():
            return self.usable().execute(sql, params).fetchall()

    def usage_row(self, usage_id: str | None) -> UsageRow:
        return _usage_row(
            self._one(f"SELECT {_USAGE_COLUMNS} FROM usage_ledger WHERE id = ?", (usage_id,))
        )

    def get_entry(self, entry_id: str) -> Entry | None:
        row = self._one(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE id = ?", (entry_id,))
        return None if row is None else entry_from_row(row)

    def scan_entries(
        self, after_seq: int, limit: int | None, types: list[str] | None
    ) -> list[Entry]:
        sql = f"SELECT {ENTRY_COLUMNS} FROM entries WHERE seq > ?"
        params: list[Any] = [after_seq]
        if types is not None:
            sql += f" AND type IN ({', '.join('?' for _ in types)})" if types else " AND 0"
            params.extend(types)
        sql += " ORDER BY seq"
        if limit is not None:
            if limit < 0:
                raise InvalidSessionWriteError(f"limit must be >= 0, got {limit}")
            sql += " LIMIT ?"
            params.append(limit)
        return [entry_from_row(r) for r in self._all(sql, params)]

    def scan_branch(self, leaf_id: str, query: BranchQuery) -> list[Entry]:
        with self.lock, self.io():
            conn = self.usable()
            with transaction(conn, immediate=False):
                leaf = _entry_or_raise(conn, leaf_id)

                def load(row: BranchRow) -> Entry:
                    return _entry_or_raise(conn, row.entry_id, corrupt=True)

                return _scan_branch(SqliteBranchIndex(conn), leaf, query, load)

    def get_register(self, namespace: str, key: str) -> Register | None:
        row = self._one(
            "SELECT namespace, key, seq, value FROM registers WHERE namespace = ? AND key = ?",
            (namespace, key),
        )
        return None if row is None else Register(*row)

    def list_registers(self, namespace: str, prefix: str) -> list[Register]:
        rows = self._all(
            "SELECT namespace, key, seq, value FROM registers"
            " WHERE namespace = ? AND key >= ? AND substr(key, 1, ?) = ? ORDER BY key",
            (namespace, prefix, len(prefix), prefix),
        )
        return [Register(*r) for r in rows]

    def usage_rows(self) -> list[UsageRow]:
        rows = self._all(f"SELECT {_USAGE_COLUMNS} FROM usage_ledger ORDER BY seq")
        return [_usage_row(r) for r in rows]

    def stats(self) -> SessionStats:
        with self.lock, self.io():
            conn = self.usable()
            with transaction(conn, immediate=False):
                row = read_session_row(conn, self.path)
                count = conn.execute("SELECT count(*) FROM entries").fetchone()[0]
        return SessionStats(
            created_at=int(row[0]),
            parent_session_id=row[1],
            message_count=int(row[4]),
            usage=load_json(row[5]),
            next_seq=int(row[6]),
            entry_count=int(count),
        )

    def snapshot(self) -> SessionSnapshot:
        with self.lock, self.io():
            return read_snapshot(self.usable(), self.path)


def _check_unused(conn: sqlite3.Connection, item_id: str) -> None:
    if conn.execute(
        "SELECT 1 FROM entries WHERE id = ? UNION ALL SELECT 1 FROM usage_ledger WHERE id = ?",
        (item_id, item_id),
    ).fetchone():
        raise DuplicateIdError(f"id {item_id!r} is already used by an entry or usage row")


def _entry_or_raise(conn: sqlite3.Connection, entry_id: str, corrupt: bool = False) -> Entry:
    row = conn.execute(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE id = ?", (entry_id,)).fetchone()
    if row is None:
        if corrupt:
            raise SessionCorruptError(
                f"corrupt branch index: indexed entry {entry_id!r} does not exist"
            )
        raise UnknownEntryError(f"entry {entry_id!r} does not exist")
    return entry_from_row(row)
