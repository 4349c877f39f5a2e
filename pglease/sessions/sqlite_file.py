"""One session = one SQLite file: connections, checks, the index store, the handle."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import PgleaseError
from ..sqlite._db import error_kind
from ._conveniences import ConvenienceWrites
from .branch_index import BranchIndexStore, BranchQuery, BranchRow, Segment, index_entry
from .branch_index import scan_branch as _scan_branch
from .errors import (
    DuplicateIdError,
    InvalidSessionWriteError,
    SessionAlreadyClaimedError,
    SessionClosedError,
    SessionCorruptError,
    SessionError,
    SessionFileBusyError,
    SessionFileCorruptError,
    SessionFileError,
    SessionVersionError,
    UnknownEntryError,
    WriterLeaseLostError,
)
from .fork import ForkStream
from .ids import uuid7
from .model import (
    AddUsage,
    AppendEntry,
    CommitResult,
    Entry,
    LeaseInfo,
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
from .schema import ENTRY_TYPES, STORAGE_VERSION, TABLES
from .writes import prepare_writes

log = logging.getLogger("pglease.sessions")

NowMs = Callable[[], int]


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


# --- connections and transactions ------------------------------------------------------


#: How long a statement waits for another connection's lock on the file (seconds).
BUSY_TIMEOUT = 5.0


def session_file_error(
    exc: sqlite3.Error, path: Path, busy_timeout: float = BUSY_TIMEOUT
) -> SessionError:
    """A sqlite3 error on a session file as the session error it means."""
    name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
    detail = f"{exc} ({name})"
    kind = error_kind(exc)
    if kind == "busy":
        return SessionFileBusyError(
            f"session file {path} is busy: another connection held its lock past the busy"
            f" timeout ({busy_timeout:g} s); nothing was written ({detail})"
        )
    if kind == "corrupt":
        return SessionFileCorruptError(f"session file {path} is not a usable database: {detail}")
    if kind == "file":
        return SessionFileError(f"cannot use session file {path}: {detail}")
    # A statement of the format failed on this file (a missing column, a
    # constraint the writes were checked against): it does not follow the format.
    return SessionCorruptError(f"session file {path} does not follow the format: {detail}")


@contextlib.contextmanager
def mapped(path: Path, busy_timeout: float = BUSY_TIMEOUT) -> Iterator[None]:
    """Raise sqlite3 errors of the block as session errors (cause kept)."""
    try:
        yield
    except sqlite3.Error as exc:
        raise session_file_error(exc, path, busy_timeout) from exc


def connect(
    path: Path, *, create: bool = False, busy_timeout: float = BUSY_TIMEOUT
) -> sqlite3.Connection:
    """Open a connection (WAL, busy_timeout 5 s). Without `create` the file must exist."""
    uri = "file:" + urllib.parse.quote(os.fsencode(path)) + ("?mode=rwc" if create else "?mode=rw")
    with mapped(path, busy_timeout):
        conn = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=busy_timeout
        )
    try:
        with mapped(path, busy_timeout):
            conn.execute(f"PRAGMA busy_timeout = {round(busy_timeout * 1000)}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            raise SessionCorruptError(f"session file {path} cannot use WAL mode (got {mode!r})")
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection, *, immediate: bool = True) -> Iterator[None]:
    """`BEGIN IMMEDIATE ... COMMIT`, ROLLBACK on any error (deferred for reads).

    A COMMIT that fails is rolled back as well: a failed commit leaves nothing,
    and the connection is not left inside a transaction."""
    conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            # A failing ROLLBACK must not hide why we roll back.
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


# --- checks -----------------------------------------------------------------------------


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


def read_lease(conn: sqlite3.Connection) -> LeaseInfo | None:
    rows = conn.execute(
        "SELECT owner_id, fence, expires_at_ms FROM writer_lease LIMIT 2"
    ).fetchall()
    if not rows:
        return None
    if len(rows) > 1:
        raise SessionCorruptError("writer_lease holds more than one row")
    owner, fence, expires = rows[0]
    return LeaseInfo(str(owner), int(fence), int(expires))


def claim_lease(
    conn: sqlite3.Connection, session_id: str, owner_id: str, now: int, lease_ms: int
) -> int:
    """Claim the writer lease inside the caller's write transaction; return the fence."""
    lease = read_lease(conn)
    expires = now + lease_ms
    if lease is None:
        conn.execute(
            "INSERT INTO writer_lease (owner_id, fence, expires_at_ms) VALUES (?, 1, ?)",
            (owner_id, expires),
        )
        return 1
    if lease.owner_id != owner_id and lease.expires_at_ms > now:
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


# --- the handle -------------------------------------------------------------------------------


def _renew_loop(ref: weakref.ref[SqliteSession], stop: threading.Event, interval: float) -> None:
    """Background renewal. Holds the handle only weakly: a forgotten handle's
    lease simply expires. Warns when a beat comes late (GIL, GC, busy file)."""
    last = time.monotonic()
    while not stop.wait(interval):
        handle = ref()
        if handle is None:
            return
        try:
            handle.renew()
            now = time.monotonic()
            if now - last > interval * 1.5:
                log.warning(
                    "session %s: lease renewal came %.3f s late",
                    handle.id,
                    now - last - interval,
                )
            last = now
        except (WriterLeaseLostError, SessionClosedError):
            return
        except PgleaseError as exc:  # busy file, I/O: try again next beat
            log.warning("session %s: lease renewal failed, will retry: %s", handle.id, exc)
        finally:
            del handle


class SqliteSession(ConvenienceWrites):
    """A writer handle on one session file, holding its writer lease.

    Created by `SessionRepository.create/open/fork`. The lease is renewed by a
    background thread every `renew_interval` seconds and inside every commit's
    own transaction, where the fence is checked. Once the lease is lost the
    handle raises `WriterLeaseLostError` for everything but `close()`.
    """

    def __init__(
        self,
        *,
        session_id: str,
        path: Path,
        conn: sqlite3.Connection,
        owner_id: str,
        fence: int,
        lease_seconds: float,
        renew_interval: float | None,
        now_ms: NowMs,
        on_close: Callable[[SqliteSession], None] | None = None,
        on_lost: Callable[[SqliteSession], None] | None = None,
        busy_timeout: float = BUSY_TIMEOUT,
    ) -> None:
        self._id = session_id
        self._path = path
        self._busy_timeout = busy_timeout
        self._conn = conn
        self._owner_id = owner_id
        self._fence = fence
        self._lease_ms = round(lease_seconds * 1000)
        self._now_ms = now_ms
        self._on_close = on_close
        self._on_lost = on_lost
        self._lock = threading.RLock()
        self._closed = False
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if renew_interval is not None:
            self._thread = threading.Thread(
                target=_renew_loop,
                args=(weakref.ref(self), self._stop, renew_interval),
                name=f"pglease-session-renew-{session_id}",
                daemon=True,
            )
            self._thread.start()

    # -- identity --

    @property
    def id(self) -> str:
        return self._id

    @property
    def path(self) -> Path:
        return self._path

    @property
    def owner_id(self) -> str:
        return self._owner_id

    @property
    def fence(self) -> int:
        return self._fence

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<SqliteSession {self._id} fence={self._fence} owner={self._owner_id}>"

    def __enter__(self) -> SqliteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lease --

    def _usable(self) -> sqlite3.Connection:
        if self._closed:
            raise SessionClosedError(f"session {self._id} handle is closed")
        if self.lost.is_set():
            raise WriterLeaseLostError(
                f"session {self._id}: writer lease was lost (fence {self._fence}); "
                "this handle refuses further work"
            )
        return self._conn

    def _mark_lost(self) -> WriterLeaseLostError:
        first = not self.lost.is_set()
        self.lost.set()
        self._stop.set()
        if first and self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                log.exception("on_lost callback of session %s failed", self._id)
        return WriterLeaseLostError(
            f"session {self._id}: writer lease was lost (owner {self._owner_id}, "
            f"fence {self._fence} no longer current)"
        )

    def _io(self) -> contextlib.AbstractContextManager[None]:
        """sqlite3 errors of the block as session errors naming this file."""
        return mapped(self._path, self._busy_timeout)

    def _renew_in_transaction(self, conn: sqlite3.Connection, now: int) -> None:
        cur = conn.execute(
            "UPDATE writer_lease SET expires_at_ms = ? WHERE owner_id = ? AND fence = ?",
            (now + self._lease_ms, self._owner_id, self._fence),
        )
        if cur.rowcount != 1:
            raise self._mark_lost()

    def renew(self) -> None:
        """Extend the lease by the lease length; lost lease -> `WriterLeaseLostError`."""
        with self._lock, self._io():
            conn = self._usable()
            with transaction(conn):
                self._renew_in_transaction(conn, self._now_ms())

    def close(self) -> None:
        """Stop renewing, release the lease (if still ours) and close the file."""
        with self._lock:
            if self._closed:
                return
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            try:
                if not self.lost.is_set():
                    with transaction(self._conn):
                        self._conn.execute(
                            "DELETE FROM writer_lease WHERE owner_id = ? AND fence = ?",
                            (self._owner_id, self._fence),
                        )
            except (sqlite3.Error, PgleaseError) as exc:
                # Never raised from close(): the lease runs out on its own.
                log.warning("session %s: releasing the lease failed: %s", self._id, exc)
            finally:
                self._closed = True
                self._conn.close()
                if self._on_close is not None:
                    self._on_close(self)

    # -- writes --

    def commit(self, writes: Sequence[Write]) -> CommitResult:
        """Apply `writes` in one transaction: seqs next_seq.., one timestamp."""
        prepared = prepare_writes(writes)
        with self._lock, self._io():
            conn = self._usable()
            now = self._now_ms()
            with transaction(conn):
                self._renew_in_transaction(conn, now)
                row = read_session_row(conn, self._path)
                first_seq = seq = int(row[6])
                message_count = int(row[4])
                usage: dict[str, Any] = load_json(row[5])
                ids: list[str | None] = []
                for item in prepared:
                    write, text, details = item.write, item.text, item.details
                    if isinstance(write, AppendEntry):
                        assert text is not None
                        entry_id = write.id or uuid7(now)
                        self._check_unused(conn, entry_id)
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
                        self._check_unused(conn, usage_id)
                        conn.execute(
                            "INSERT INTO usage_ledger (id, seq, entry_id, adjustment, usage,"
                            " details) VALUES (?, ?, ?, ?, ?, ?)",
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

    @staticmethod
    def _check_unused(conn: sqlite3.Connection, item_id: str) -> None:
        if conn.execute(
            "SELECT 1 FROM entries WHERE id = ? UNION ALL SELECT 1 FROM usage_ledger WHERE id = ?",
            (item_id, item_id),
        ).fetchone():
            raise DuplicateIdError(f"id {item_id!r} is already used by an entry or usage row")

    def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry:
        result = self.commit([AppendEntry(type, parent_id, payload or {}, custom_type, id)])
        entry = self.get_entry(result.ids[0] or "")
        assert entry is not None
        return entry

    def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow:
        result = self.commit([AddUsage(usage, entry_id, adjustment, details, id)])
        with self._lock, self._io():
            row = (
                self._usable()
                .execute(
                    "SELECT id, seq, entry_id, adjustment, usage, details FROM usage_ledger"
                    " WHERE id = ?",
                    (result.ids[0],),
                )
                .fetchone()
            )
        return UsageRow(row[0], row[1], row[2], bool(row[3]), row[4], row[5])

    # -- reads --

    def get_entry(self, entry_id: str) -> Entry | None:
        with self._lock, self._io():
            row = (
                self._usable()
                .execute(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE id = ?", (entry_id,))
                .fetchone()
            )
        return None if row is None else entry_from_row(row)

    def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]:
        """Entries with `seq > after_seq` in seq order, optionally of some types."""
        sql = f"SELECT {ENTRY_COLUMNS} FROM entries WHERE seq > ?"
        params: list[Any] = [after_seq]
        if types is not None:
            wanted = list(types)
            sql += f" AND type IN ({', '.join('?' for _ in wanted)})" if wanted else " AND 0"
            params.extend(wanted)
        sql += " ORDER BY seq"
        if limit is not None:
            if limit < 0:
                raise InvalidSessionWriteError(f"limit must be >= 0, got {limit}")
            sql += " LIMIT ?"
            params.append(limit)
        with self._lock, self._io():
            rows = self._usable().execute(sql, params).fetchall()
        return [entry_from_row(r) for r in rows]

    def scan_branch(
        self,
        leaf_id: str,
        *,
        newest_first: bool = True,
        stop_type: str | None = None,
        stop_id: str | None = None,
        types: Iterable[str] | None = None,
        custom_type: str | None = None,
        cursor: int | None = None,
        limit: int | None = None,
    ) -> list[Entry]:
        """The path from `leaf_id` to the root, read through the branch index.

        See `BranchQuery` for the meaning of the options."""
        query = BranchQuery(
            newest_first=newest_first,
            stop_type=stop_type,
            stop_id=stop_id,
            types=None if types is None else frozenset(types),
            custom_type=custom_type,
            cursor=cursor,
            limit=limit,
        )
        with self._lock, self._io():
            conn = self._usable()
            with transaction(conn, immediate=False):
                leaf = self._entry_or_raise(conn, leaf_id)

                def load(row: BranchRow) -> Entry:
                    return self._entry_or_raise(conn, row.entry_id, corrupt=True)

                return _scan_branch(SqliteBranchIndex(conn), leaf, query, load)

    @staticmethod
    def _entry_or_raise(conn: sqlite3.Connection, entry_id: str, corrupt: bool = False) -> Entry:
        row = conn.execute(
            f"SELECT {ENTRY_COLUMNS} FROM entries WHERE id = ?", (entry_id,)
        ).fetchone()
        if row is None:
            if corrupt:
                raise SessionCorruptError(
                    f"corrupt branch index: indexed entry {entry_id!r} does not exist"
                )
            raise UnknownEntryError(f"entry {entry_id!r} does not exist")
        return entry_from_row(row)

    def get_register(self, namespace: str, key: str) -> Register | None:
        with self._lock, self._io():
            row = (
                self._usable()
                .execute(
                    "SELECT namespace, key, seq, value FROM registers"
                    " WHERE namespace = ? AND key = ?",
                    (namespace, key),
                )
                .fetchone()
            )
        return None if row is None else Register(*row)

    def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        """Registers of `namespace` whose key starts with `prefix`, ordered by key."""
        with self._lock, self._io():
            rows = (
                self._usable()
                .execute(
                    "SELECT namespace, key, seq, value FROM registers"
                    " WHERE namespace = ? AND key >= ? AND substr(key, 1, ?) = ? ORDER BY key",
                    (namespace, prefix, len(prefix), prefix),
                )
                .fetchall()
            )
        return [Register(*r) for r in rows]

    def usage_rows(self) -> list[UsageRow]:
        with self._lock, self._io():
            rows = (
                self._usable()
                .execute(
                    "SELECT id, seq, entry_id, adjustment, usage, details FROM usage_ledger"
                    " ORDER BY seq"
                )
                .fetchall()
            )
        return [UsageRow(r[0], r[1], r[2], bool(r[3]), r[4], r[5]) for r in rows]

    def stats(self) -> SessionStats:
        with self._lock, self._io():
            conn = self._usable()
            with transaction(conn, immediate=False):
                row = read_session_row(conn, self._path)
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
        with self._lock, self._io():
            return read_snapshot(self._usable(), self._path)


# --- streamed forks: a file as the source or the destination -------------------------------

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
