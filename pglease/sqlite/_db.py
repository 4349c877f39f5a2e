"""The SQLite file: connections, pragmas, write transactions, migrations, timestamps."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ..errors import (
    MigrationError,
    SqliteCorruptError,
    SqliteFileError,
    StoreBusyError,
    StoreClosedError,
    ValidationError,
)
from ..migration_files import Migration, load_migrations, pending_migrations
from ..validation import check_positive_seconds

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DEFAULT_BUSY_TIMEOUT = 5.0
#: Idle connections kept for reuse; more are opened on demand and closed after use.
MAX_IDLE = 8

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


__all__ = [
    "CallerError",
    "Database",
    "SqliteFileError",
    "error_kind",
    "file_error",
    "sqlite_error",
]

# SQLite result codes (primary, the low byte of an extended code) that say
# something about the file rather than about a statement: the lock, the disk,
# the bytes on it. Mapped even when the caller's own SQL hit them.
_BUSY = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
_CORRUPT = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
_FILE = frozenset(
    {
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_NOLFS,
    }
)


def _primary(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def error_kind(exc: sqlite3.Error) -> str:
    """The class of a sqlite3 error: busy, corrupt, file (I/O, full, ...) or statement."""
    code = _primary(exc)
    if code in _BUSY:
        return "busy"
    if code in _CORRUPT:
        return "corrupt"
    return "file" if code in _FILE else "statement"


def file_error(exc: sqlite3.Error) -> bool:
    """Whether `exc` is about the file (lock, disk, corruption), not one statement."""
    return _primary(exc) in _BUSY | _CORRUPT | _FILE


def sqlite_error(
    exc: sqlite3.Error, path: str, busy_timeout: float | None = None
) -> SqliteFileError:
    """Any sqlite3 error as a `SqliteFileError` naming the file and the result code.

    Raise it `from exc`: the sqlite3 error stays as `__cause__` (the watcher
    reads its result code there to tell lasting failures from passing ones).
    """
    name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
    detail = f"{exc} ({name})"
    code = _primary(exc)
    if code in _BUSY:
        waited = f"busy_timeout={busy_timeout:g} s" if busy_timeout is not None else "busy_timeout"
        return StoreBusyError(
            f"SQLite file {path!r} is busy: another connection held its lock past {waited};"
            f" nothing was changed ({detail})"
        )
    if code in _CORRUPT:
        return SqliteCorruptError(f"SQLite file {path!r} is not a usable database: {detail}")
    verb = "open" if code == sqlite3.SQLITE_CANTOPEN else "use"
    return SqliteFileError(f"cannot {verb} SQLite file {path!r}: {detail}")


# --- timestamps: integer microseconds since the epoch, so values round-trip exactly ---


def to_us(value: datetime) -> int:
    return (value - _EPOCH) // _MICROSECOND


def from_us(value: int) -> datetime:
    return _EPOCH + timedelta(microseconds=value)


def opt_from_us(value: int | None) -> datetime | None:
    return None if value is None else from_us(value)


def ttl_us(ttl: float) -> int:
    return round(ttl * 1_000_000)


def clock_us(now: datetime | None) -> int:
    """The store's clock: `now` when given, else the host's wall clock.

    SQLite has no server clock. Every process on the host reads the same
    kernel clock, so it plays the role PostgreSQL's `clock_timestamp()` plays;
    callers read it after BEGIN IMMEDIATE, i.e. after any lock wait.
    """
    return to_us(now) if now is not None else time.time_ns() // 1000


# --- arguments ---------------------------------------------------------------


def check_path(path: object) -> str:
    if not isinstance(path, str | os.PathLike):
        raise ValidationError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise ValidationError("path must be a text path, not bytes")
    # Every pooled connection must reach the same database, and other processes too.
    if text in ("", ":memory:") or text.startswith("file::memory:"):
        raise ValidationError("path must name a file; in-memory SQLite databases are not shared")
    if "\x00" in text:
        raise ValidationError("path must not contain NUL characters")
    return text


def check_busy_timeout(value: object) -> float:
    seconds = check_positive_seconds(value, "busy_timeout")
    if seconds > 3600:
        raise ValidationError(f"busy_timeout must be in (0, 3600] seconds, got {seconds}")
    return seconds


# --- migrations ----------------------------------------------------------------


def split_statements(text: str) -> list[str]:
    """Split a migration script into statements (BEGIN IMMEDIATE must stay ours,
    and `executescript` would commit it)."""
    statements: list[str] = []
    buffer = ""
    for line in text.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statements.append(buffer.strip())
            buffer = ""
    leftover = [ln for ln in buffer.splitlines() if ln.strip() and not ln.strip().startswith("--")]
    if leftover:
        raise MigrationError(f"unterminated SQL statement: {leftover[0]!r}")
    return statements


_MIGRATIONS_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_migrations ("
    " version INTEGER PRIMARY KEY, name TEXT NOT NULL, checksum TEXT NOT NULL,"
    " applied_at INTEGER NOT NULL) STRICT"
)


# --- connections -------------------------------------------------------------


class CallerError(Exception):
    """Carries an error of the caller's own SQL (`mutate`'s apply) past the mapping
    of pglease's statements; `mutate` raises `.error` unchanged."""

    def __init__(self, error: sqlite3.Error) -> None:
        super().__init__(str(error))
        self.error = error


class Database:
    """A small pool of connections to one SQLite file in WAL mode.

    Connections are in autocommit mode (``isolation_level=None``): the module
    never opens transactions behind our back, so every write is exactly the
    ``BEGIN IMMEDIATE ... COMMIT`` issued by `write()`.
    """

    def __init__(self, path: str, busy_timeout: float) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def _connect(self) -> sqlite3.Connection:
        try:
            # check_same_thread=False: the pool hands a connection to one thread at
            # a time, and the asyncio store runs a mutation's apply on the loop thread.
            conn = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise sqlite_error(exc, self.path, self.busy_timeout) from exc
        try:
            self._configure(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise sqlite_error(exc, self.path, self.busy_timeout) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _configure(self, conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        # Switching a fresh file to WAL needs a moment of exclusive access and may
        # answer "locked" without consulting the busy handler: retry until the timeout.
        deadline = time.monotonic() + self.busy_timeout
        while True:
            try:
                row = conn.execute("PRAGMA journal_mode = WAL").fetchone()
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)
        if row is None or str(row[0]).lower() != "wal":
            raise SqliteFileError(
                f"{self.path!r} could not be switched to WAL mode (got {row and row[0]!r});"
                " the store needs a local file system with shared-memory support"
            )
        # FULL: a committed grant survives power loss; NORMAL in WAL mode could
        # lose it and hand out its generation again.
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")

    def _checkout(self) -> sqlite3.Connection:
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            if self._pid != os.getpid():
                # A forked child must not reuse its parent's SQLite handles.
                self._idle = []
                self._pid = os.getpid()
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _checkin(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            # Left open by a caller of `connection()`; never hand it on half-done.
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                conn.close()
                return
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE and self._pid == os.getpid():
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def raw_connection(self) -> Iterator[sqlite3.Connection]:
        """A pooled connection whose statements' errors stay sqlite3's (the
        caller's own SQL); opening it raises only `SqliteFileError`s."""
        conn = self._checkout()
        try:
            yield conn
        finally:
            self._checkin(conn)

    @contextmanager
    def _mapped(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise sqlite_error(exc, self.path, self.busy_timeout) from exc

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """A pooled connection for pglease's own statements: their sqlite3 errors
        come out as `SqliteFileError`s (`StoreBusyError`, `SqliteCorruptError`)."""
        with self._mapped(), self.raw_connection() as conn:
            yield conn

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE, then COMMIT, or ROLLBACK on any error.

        IMMEDIATE takes the file's write lock up front (waiting up to the busy
        timeout), so reads inside the transaction see the state it will commit on.
        A COMMIT that fails is rolled back too: a failed write leaves nothing.
        """
        with self.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    # A failing ROLLBACK must not hide why we roll back; `_checkin`
                    # closes a connection still in a transaction.
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise

    def migrate(self) -> list[Migration]:
        """Apply pending migrations in one write transaction; return those applied."""
        available = load_migrations(MIGRATIONS_DIR)
        with self.write() as conn:
            conn.execute(_MIGRATIONS_TABLE)
            rows = conn.execute("SELECT version, name, checksum FROM schema_migrations")
            pending = pending_migrations(self.path, available, {r[0]: (r[1], r[2]) for r in rows})
            for migration in pending:
                for statement in split_statements(migration.text):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum, applied_at)"
                    " VALUES (?, ?, ?, ?)",
                    (migration.version, migration.name, migration.checksum, clock_us(None)),
                )
        return pending

    def open(self) -> None:
        """Open the first connection now, so a bad path fails at construction."""
        self._checkin(self._checkout())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
