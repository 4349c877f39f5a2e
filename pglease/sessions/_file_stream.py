"""Streamed forks with a session file as the source (`file_fork_source`) or the
destination (`write_stream_rows`): memory does not grow with the session."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ._file_db import BUSY_TIMEOUT, connect, mapped
from ._file_rows import ENTRY_COLUMNS, entry_from_row, insert_entry, read_session_row
from .errors import DuplicateIdError, UnknownEntryError
from .fork import ForkStream
from .model import Entry, Register

#: Entries read from a file per fetch when a fork or import streams it.
STREAM_FETCH = 1000


_PATH_SQL = (
    "WITH RECURSIVE path (id, parent_id, seq) AS ("
    " SELECT id, parent_id, seq FROM entries WHERE id = ?"
    " UNION ALL SELECT e.id, e.parent_id, e.seq FROM path AS p"
    " JOIN entries AS e ON e.id = p.parent_id AND e.seq < p.seq)"
    f" SELECT {', '.join('x.' + c for c in ENTRY_COLUMNS.split(', '))}"
    " FROM path JOIN entries AS x ON x.id = path.id ORDER BY path.seq"
)


class FileForkSource:
    """A session file read for a streamed fork, inside one read transaction
    (`file_fork_source`): registers in memory, entries streamed in seq order."""

    def __init__(self, conn: sqlite3.Connection, path: Path, busy_timeout: float) -> None:
        self.conn = conn
        self.path = path
        self.busy_timeout = busy_timeout
        with mapped(path, busy_timeout):
            self.registers = tuple(
                Register(ns, key, seq, value)
                for ns, key, seq, value in conn.execute(
                    "SELECT namespace, key, seq, value FROM registers ORDER BY namespace, key"
                )
            )

    def lookup(self, ids: Sequence[str]) -> dict[str, Entry]:
        """The entries among `ids`."""
        out: dict[str, Entry] = {}
        with mapped(self.path, self.busy_timeout):
            for start in range(0, len(ids), 500):
                part = list(ids[start : start + 500])
                marks = ", ".join("?" * len(part))
                for row in self.conn.execute(
                    f"SELECT {ENTRY_COLUMNS} FROM entries WHERE id IN ({marks})", part
                ):
                    entry = entry_from_row(row)
                    out[entry.id] = entry
        return out

    def entries(self) -> Iterator[Entry]:
        """Every entry in seq order, fetched `STREAM_FETCH` rows at a time."""
        return self._stream(f"SELECT {ENTRY_COLUMNS} FROM entries ORDER BY seq, id", ())

    def path_entries(self, tip: str) -> Iterator[Entry]:
        """The branch from its root down to `tip`, in seq order, fetched
        `STREAM_FETCH` rows at a time. The walk up from the tip only follows a
        parent with a smaller seq (a corrupt cycle cannot loop); a broken chain
        ends the walk early, which `checked_path` reports. SQLite sorts the
        path's (seq, id) pairs in its sorter, which spills to a temp file past
        the page cache, so memory stays bounded for any branch length."""
        return self._stream(_PATH_SQL, (tip,))

    def _stream(self, sql: str, params: Sequence[Any]) -> Iterator[Entry]:
        with mapped(self.path, self.busy_timeout):
            cur = self.conn.execute(sql, params)
        try:
            while True:
                with mapped(self.path, self.busy_timeout):
                    rows = cur.fetchmany(STREAM_FETCH)
                if not rows:
                    return
                for row in rows:
                    yield entry_from_row(row)
        finally:
            # A wrapping generator that failed leaves this one to the garbage
            # collector, which may close it after its connection was closed.
            with contextlib.suppress(sqlite3.Error):
                cur.close()


@contextlib.contextmanager
def file_fork_source(path: Path, busy_timeout: float = BUSY_TIMEOUT) -> Iterator[FileForkSource]:
    """Open a session file (checked as `read_snapshot` checks it) for a streamed
    fork: one read transaction for the whole block, the lease untouched."""
    conn = connect(path, busy_timeout=busy_timeout)
    try:
        with mapped(path, busy_timeout):
            conn.execute("BEGIN")
            read_session_row(conn, path)
        yield FileForkSource(conn, path, busy_timeout)
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.close()


def write_stream_rows(conn: sqlite3.Connection, stream: ForkStream) -> tuple[int, int]:
    """Write a streamed fork's entries (through the branch index) and registers
    into a new file's open transaction; return (message_count, next_seq).

    Parents are looked up in the file itself (the previous entry is kept, as a
    chain's parent almost always is), so memory does not grow with the source.
    """
    messages = 0
    last_seq = 0
    previous: Entry | None = None
    for entry in stream.entries:
        parent_seq: int | None = None
        if entry.parent_id is not None:
            if previous is not None and previous.id == entry.parent_id:
                parent_seq = previous.seq
            else:
                row = conn.execute(
                    "SELECT seq FROM entries WHERE id = ?", (entry.parent_id,)
                ).fetchone()
                if row is None:
                    raise UnknownEntryError(
                        f"entry {entry.id!r} has a missing parent {entry.parent_id!r}"
                    )
                parent_seq = int(row[0])
        try:
            insert_entry(conn, entry, parent_seq)
        except sqlite3.IntegrityError as exc:
            raise DuplicateIdError(f"id {entry.id!r} appears twice in the source") from exc
        messages += entry.type == "message"
        last_seq = max(last_seq, entry.seq)
        previous = entry
    keys = stream.label_keys()
    copied: set[str] = set()
    for start in range(0, len(keys), 500):
        part = keys[start : start + 500]
        marks = ", ".join("?" * len(part))
        copied.update(
            r[0] for r in conn.execute(f"SELECT id FROM entries WHERE id IN ({marks})", part)
        )
    registers, next_seq = stream.registers(last_seq, copied)
    conn.executemany(
        "INSERT INTO registers (namespace, key, seq, value) VALUES (?, ?, ?, ?)",
        [(r.namespace, r.key, r.seq, r.value_json) for r in registers],
    )
    return messages, next_seq
