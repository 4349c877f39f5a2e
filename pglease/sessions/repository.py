"""A directory of session files: `<directory>/<session_id>.sqlite`."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import (
    InvalidSessionIdError,
    InvalidSessionWriteError,
    SessionBusyError,
    SessionCorruptError,
    SessionError,
    SessionExistsError,
    SessionFileBusyError,
    SessionFileError,
    SessionNotFoundError,
    SessionTempFileError,
)
from .fork import (
    ForkPlan,
    ForkPosition,
    ForkScope,
    ForkStream,
    checked_path,
    resolve_fork,
)
from .ids import uuid7
from .model import Entry, SessionInfo, SessionSnapshot, load_json
from .schema import EMPTY_USAGE_JSON, IDLE_LANE_STATE_JSON, MAIN_LANE, SCHEMA_SQL, STORAGE_VERSION
from .sqlite_file import (
    BUSY_TIMEOUT,
    NowMs,
    SqliteSession,
    claim_lease,
    connect,
    file_fork_source,
    insert_entry,
    mapped,
    read_lease,
    read_session_row,
    read_snapshot,
    transaction,
    wall_clock_ms,
    write_stream_rows,
)

SUFFIX = ".sqlite"
SIDE_FILES = ("-wal", "-shm")
#: In-progress files start with a dot and end in `.tmp`: never listed as sessions.
TEMP_SUFFIX = ".tmp"
#: NAME_MAX of the file systems we run on: the longest file name, in bytes.
MAX_NAME_BYTES = 255
#: The longest name a session uses is its `<id>.sqlite-wal` (SQLite makes it
#: beside the file), so an id may take 255 - 11 = 244 bytes of UTF-8.
MAX_SESSION_ID_BYTES = MAX_NAME_BYTES - len(SUFFIX) - len("-wal")


def check_session_id(session_id: object) -> str:
    """Session ids are file names: any text but `/`, NUL, `.` and `..`, at most
    244 bytes of UTF-8 (so `<id>.sqlite-wal` fits in a 255-byte file name)."""
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"session id must be a string, got {type(session_id).__name__}")
    if session_id in ("", ".", ".."):
        raise InvalidSessionIdError(f"session id {session_id!r} is not a usable file name")
    if "/" in session_id or "\x00" in session_id:
        raise InvalidSessionIdError(
            f"session id {session_id!r} must not contain '/' or NUL (it is a file name)"
        )
    try:
        size = len(session_id.encode("utf-8"))
    except UnicodeEncodeError:
        # A file name of undecodable bytes (surrogate escapes): PostgreSQL and
        # the harness store ids as UTF-8 text, which this is not.
        raise InvalidSessionIdError(f"session id {session_id!r} is not valid UTF-8 text") from None
    if size > MAX_SESSION_ID_BYTES:
        raise InvalidSessionIdError(
            f"session id is {size} bytes of UTF-8; at most {MAX_SESSION_ID_BYTES} fit"
            f" in a file name (<id>{SUFFIX}-wal, {MAX_NAME_BYTES} bytes)"
        )
    return session_id


#: `.<id>.<16 hex>.tmp`: a file being built by create/fork, published under its
#: final name when complete. One left behind means that call crashed.
_TEMP_NAME = re.compile(r"\.(.*)\.[0-9a-f]{16}\.tmp(?:-wal|-shm|-journal)?", re.DOTALL)
#: A temp group untouched this long is a crash leftover, not a fork in progress
#: (a build keeps writing its file or its -wal; publishing follows at once).
STALE_TEMP_MS = 60_000
# Room left for the id in a temp name: "." + id + "." + 16 hex + ".tmp-journal"
# (SQLite makes a rollback journal while the new file switches to WAL).
_TEMP_ID_BYTES = MAX_NAME_BYTES - len("..") - 16 - len(TEMP_SUFFIX) - len("-journal")


def temp_name(session_id: str) -> str:
    """A fresh temp file name for `session_id`, its id cut to fit NAME_MAX."""
    raw = session_id.encode("utf-8")[:_TEMP_ID_BYTES]
    short = raw.decode("utf-8", errors="ignore")  # never split a character
    return f".{short}.{secrets.token_hex(8)}{TEMP_SUFFIX}"


@dataclass(frozen=True, slots=True)
class SessionProblem:
    """A `*.sqlite` file that `list()` could not read as a session."""

    id: str
    path: str
    error: SessionError


@dataclass(frozen=True, slots=True)
class SessionListing:
    sessions: list[SessionInfo] = field(default_factory=list)
    problems: list[SessionProblem] = field(default_factory=list)

    def ids(self) -> list[str]:
        return [s.id for s in self.sessions]


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_RENAME_NOREPLACE = 1


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Atomic rename that fails when `dst` exists (Linux renameat2), for file
    systems without hard links."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name else None
    renameat2 = getattr(libc, "renameat2", None) if libc is not None else None
    if renameat2 is None:
        raise SessionError("this file system supports neither hard links nor renameat2")
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), _RENAME_NOREPLACE)
    if result != 0:
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        raise OSError(err, os.strerror(err), str(dst))


def _publish(temp: Path, final: Path) -> None:
    """Make `temp` visible as `final` atomically, never replacing an existing file."""
    try:
        os.link(temp, final)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        _rename_noreplace(temp, final)
        return
    _remove_quietly(temp)


def read_session_file(
    path: str | os.PathLike[str], *, busy_timeout: float = BUSY_TIMEOUT
) -> SessionSnapshot:
    """Read any session file (checked: tables, session row, version) into a
    `SessionSnapshot`, in one read transaction and without touching its lease."""
    file_path = Path(path)
    if not file_path.is_file():
        raise SessionNotFoundError(f"session file {file_path} does not exist")
    conn = connect(file_path, busy_timeout=busy_timeout)
    try:
        with mapped(file_path, busy_timeout):
            return read_snapshot(conn, file_path)
    finally:
        conn.close()


class SessionRepository:
    """Session files in one directory.

    `lease_seconds` / `renew_interval` set the writer lease of handles this
    repository opens (30 s / 15 s; `renew_interval=None` disables the background
    renewal). `now_ms` is the clock for lease expiry and timestamps. `on_lost`
    is called (from the renewing thread or the caller) when a handle's lease
    is found lost; each handle also exposes a `lost` event. `busy_timeout` is
    how long a call waits for another connection's lock on a file before it
    raises `SessionFileBusyError` (5 s).

    A missing directory is created (with its parents) unless `create=False`.
    Opening removes the temp files of creates/forks that crashed (`.<id>.<hex>.tmp`
    untouched for a minute, by `now_ms`) unless `clean_temp=False`; `list()`
    reports the ones still there as problems.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        lease_seconds: float = 30.0,
        renew_interval: float | None = 15.0,
        now_ms: NowMs | None = None,
        on_lost: Callable[[SqliteSession], None] | None = None,
        busy_timeout: float = BUSY_TIMEOUT,
        create: bool = True,
        clean_temp: bool = True,
    ) -> None:
        if not lease_seconds > 0:
            raise InvalidSessionWriteError(f"lease_seconds must be > 0, got {lease_seconds!r}")
        if renew_interval is not None and not 0 < renew_interval < lease_seconds:
            raise InvalidSessionWriteError(
                f"renew_interval must be between 0 and lease_seconds, got {renew_interval!r}"
            )
        if isinstance(busy_timeout, bool) or not (
            isinstance(busy_timeout, int | float) and 0 < busy_timeout <= 3600
        ):
            raise InvalidSessionWriteError(
                f"busy_timeout must be in (0, 3600] seconds, got {busy_timeout!r}"
            )
        self.busy_timeout = float(busy_timeout)
        self.directory = Path(directory)
        if not self.directory.is_dir():
            if not create:
                raise SessionNotFoundError(f"session directory {self.directory} does not exist")
            try:
                # Created on demand, as the harness does for its sessions directory.
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SessionFileError(
                    f"cannot create session directory {self.directory}: {exc}"
                ) from exc
        self.lease_seconds = lease_seconds
        self.renew_interval = renew_interval
        self.now_ms: NowMs = now_ms or wall_clock_ms
        self.on_lost = on_lost
        self._lock = threading.Lock()
        # weak: a handle the caller dropped stops renewing and its lease expires
        self._open: weakref.WeakValueDictionary[str, SqliteSession] = weakref.WeakValueDictionary()
        #: Crash leftovers this repository removed when it opened.
        self.removed_temp_files: list[Path] = []
        if clean_temp:
            self.removed_temp_files = self._remove_stale_temp_files()

    def stale_temp_files(self) -> list[Path]:
        """Temp files (and their -wal/-shm/-journal) of creates/forks that did not finish:
        leftovers of a crash, never sessions. A group is stale when none of its
        files was touched for `STALE_TEMP_MS` (a fork in progress writes its
        -wal, not the main file, so the newest of the three counts)."""
        now = self.now_ms()
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            raise SessionFileError(
                f"cannot list session directory {self.directory}: {exc}"
            ) from exc
        groups: dict[str, list[tuple[Path, int]]] = {}
        for name in names:
            if not _TEMP_NAME.fullmatch(name):
                continue
            path = self.directory / name
            try:
                mtime_ms = path.stat().st_mtime_ns // 1_000_000
            except FileNotFoundError:
                continue  # published or removed meanwhile
            except OSError as exc:
                raise SessionFileError(f"cannot inspect temp file {path}: {exc}") from exc
            base = name.removesuffix("-wal").removesuffix("-shm").removesuffix("-journal")
            groups.setdefault(base, []).append((path, mtime_ms))
        stale: list[Path] = []
        for members in groups.values():
            if now - max(m for _, m in members) >= STALE_TEMP_MS:
                stale.extend(p for p, _ in members)
        return stale

    def _remove_stale_temp_files(self) -> list[Path]:
        removed: list[Path] = []
        for path in self.stale_temp_files():
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError:
                continue  # list() reports it: a leftover we cannot remove is no reason to fail
            removed.append(path)
        if removed:
            _fsync_dir(self.directory)
        return removed

    @property
    def _lease_ms(self) -> int:
        return round(self.lease_seconds * 1000)

    def path_for(self, session_id: str) -> Path:
        return self.directory / (check_session_id(session_id) + SUFFIX)

    def exists(self, session_id: str) -> bool:
        return self.path_for(session_id).exists()

    # -- handles --

    def _forget(self, handle: SqliteSession) -> None:
        with self._lock:
            if self._open.get(handle.id) is handle:
                del self._open[handle.id]

    def _handle(
        self, session_id: str, path: Path, conn: sqlite3.Connection, owner_id: str, fence: int
    ) -> SqliteSession:
        handle = SqliteSession(
            session_id=session_id,
            path=path,
            conn=conn,
            owner_id=owner_id,
            fence=fence,
            lease_seconds=self.lease_seconds,
            renew_interval=self.renew_interval,
            now_ms=self.now_ms,
            on_close=self._forget,
            on_lost=self.on_lost,
            busy_timeout=self.busy_timeout,
        )
        with self._lock:
            self._open[session_id] = handle
        return handle

    def _open_claimed(self, session_id: str) -> SqliteSession:
        path = self.path_for(session_id)
        if not path.exists():
            raise SessionNotFoundError(f"session {session_id} does not exist ({path})")
        conn = connect(path, busy_timeout=self.busy_timeout)
        owner_id = uuid7()
        try:
            with mapped(path, self.busy_timeout), transaction(conn):
                read_session_row(conn, path)
                fence = claim_lease(conn, session_id, owner_id, self.now_ms(), self._lease_ms)
        except BaseException:
            conn.close()
            raise
        return self._handle(session_id, path, conn, owner_id, fence)

    def open(self, session_id: str) -> SqliteSession:
        """Open an existing session and claim its writer lease."""
        return self._open_claimed(check_session_id(session_id))

    # -- creating files --

    def _materialise(self, session_id: str, build: Callable[[sqlite3.Connection], None]) -> None:
        """Build a complete session file under a temporary name, then publish it
        as `<id>.sqlite` without replacing anything. On failure nothing stays."""
        final = self.path_for(session_id)
        if final.exists():
            raise SessionExistsError(f"session {session_id} already exists ({final})")
        temp = self.directory / temp_name(session_id)
        try:
            fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as exc:
            raise SessionFileError(f"cannot write session file {final}: {exc}") from exc
        os.close(fd)
        try:
            conn = connect(temp, create=True, busy_timeout=self.busy_timeout)
            try:
                with mapped(temp, self.busy_timeout):
                    conn.executescript("BEGIN IMMEDIATE;\n" + SCHEMA_SQL)
                    try:
                        build(conn)
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            with contextlib.suppress(sqlite3.Error):
                                conn.execute("ROLLBACK")
                        raise
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                conn.close()
            for side in SIDE_FILES:
                side_path = Path(str(temp) + side)
                if side_path.exists() and side_path.stat().st_size > 0 and side == "-wal":
                    raise SessionError(f"could not checkpoint new session file {temp}")
            fd = os.open(temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                _publish(temp, final)
            except FileExistsError:
                raise SessionExistsError(f"session {session_id} already exists ({final})") from None
            _fsync_dir(self.directory)
        except OSError as exc:
            raise SessionFileError(f"cannot write session file {final}: {exc}") from exc
        finally:
            for path in (temp, *(Path(str(temp) + side) for side in SIDE_FILES)):
                _remove_quietly(path)

    def _write_session_row(
        self,
        conn: sqlite3.Connection,
        parent_session_id: str | None,
        message_count: int,
        next_seq: int,
    ) -> None:
        conn.execute(
            "INSERT INTO session (created_at, parent_session_id, storage_version, metadata,"
            " message_count, usage_payload, next_seq) VALUES (?, ?, ?, NULL, ?, ?, ?)",
            (
                self.now_ms(),
                parent_session_id,
                STORAGE_VERSION,
                message_count,
                EMPTY_USAGE_JSON,
                next_seq,
            ),
        )

    def create(self, id: str | None = None, parent_session_id: str | None = None) -> SqliteSession:
        """Create a new empty session (registers lane.leaf/main=null at seq 1 and
        lane.state/main=idle at seq 2; next_seq 3) and claim its lease."""
        session_id = check_session_id(id) if id is not None else uuid7()
        if parent_session_id is not None and not isinstance(parent_session_id, str):
            raise InvalidSessionWriteError("parent_session_id must be a string or None")
        owner_id = uuid7()

        def build(conn: sqlite3.Connection) -> None:
            self._write_session_row(conn, parent_session_id, 0, 3)
            conn.executemany(
                "INSERT INTO registers (namespace, key, seq, value) VALUES (?, ?, ?, ?)",
                [
                    ("lane.leaf", MAIN_LANE, 1, "null"),
                    ("lane.state", MAIN_LANE, 2, IDLE_LANE_STATE_JSON),
                ],
            )
            claim_lease(conn, session_id, owner_id, self.now_ms(), self._lease_ms)

        self._materialise(session_id, build)
        return self._adopt(session_id, owner_id)

    def _adopt(self, session_id: str, owner_id: str) -> SqliteSession:
        """Open a file we just published, whose lease we wrote (owner_id, fence 1)."""
        path = self.path_for(session_id)
        conn = connect(path, busy_timeout=self.busy_timeout)
        try:
            with mapped(path, self.busy_timeout), transaction(conn):
                read_session_row(conn, path)
                fence = claim_lease(conn, session_id, owner_id, self.now_ms(), self._lease_ms)
        except BaseException:
            conn.close()
            raise
        return self._handle(session_id, path, conn, owner_id, fence)

    def fork(
        self,
        source_id: str,
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> SqliteSession:
        """Copy (part of) a session into a new one and open it.

        Streamed: the source is read in one read transaction of its file (its
        lease untouched), `STREAM_FETCH` entries at a time, and written into
        the new file as it is read, so memory does not grow with the source; a
        branch fork reads only the branch. A failure leaves no new file."""
        source_id = check_session_id(source_id)
        new_id = check_session_id(id) if id is not None else uuid7()
        if self.path_for(new_id).exists():
            raise SessionExistsError(f"session {new_id} already exists")
        source_path = self.path_for(source_id)
        if not source_path.exists():
            raise SessionNotFoundError(f"session {source_id} does not exist ({source_path})")
        owner_id = uuid7()
        with file_fork_source(source_path, self.busy_timeout) as source:
            shape = resolve_fork(source.registers, source.lookup, scope, entry_id, position)
            entries: Iterable[Entry]
            if shape.scope == "tree":
                # In (seq, id) order as the snapshot path read them; a child not
                # after its parent is refused by the branch index as it was there.
                entries = source.entries()
            elif shape.tip is None:
                entries = ()
            else:
                entries = checked_path(source.path_entries(shape.tip), shape.tip)
            stream = ForkStream(entries, shape.lanes, source.registers, source_id, shape.scope)

            def build(conn: sqlite3.Connection) -> None:
                messages, next_seq = write_stream_rows(conn, stream)
                self._write_session_row(conn, source_id, messages, next_seq)
                claim_lease(conn, new_id, owner_id, self.now_ms(), self._lease_ms)

            try:
                self._materialise(new_id, build)
            finally:
                stream.close()
        return self._adopt(new_id, owner_id)

    def snapshot(self, session_id: str) -> SessionSnapshot:
        """Entries and registers of a session in one consistent read, without
        touching its writer lease."""
        source_path = self.path_for(session_id)
        if not source_path.exists():
            raise SessionNotFoundError(f"session {session_id} does not exist ({source_path})")
        return read_session_file(source_path, busy_timeout=self.busy_timeout)

    def _build_plan(
        self, plan: ForkPlan, session_id: str, owner_id: str | None
    ) -> Callable[[sqlite3.Connection], None]:
        def build(conn: sqlite3.Connection) -> None:
            self._write_session_row(conn, plan.parent_session_id, plan.message_count, plan.next_seq)
            seqs: dict[str, int] = {}
            for entry in plan.entries:
                parent_seq = None if entry.parent_id is None else seqs[entry.parent_id]
                insert_entry(conn, entry, parent_seq)
                seqs[entry.id] = entry.seq
            conn.executemany(
                "INSERT INTO registers (namespace, key, seq, value) VALUES (?, ?, ?, ?)",
                [(r.namespace, r.key, r.seq, r.value_json) for r in plan.registers],
            )
            if owner_id is not None:
                claim_lease(conn, session_id, owner_id, self.now_ms(), self._lease_ms)

        return build

    def create_from_plan(self, plan: ForkPlan, id: str | None = None) -> SqliteSession:
        """Write a fork plan (from any backend's snapshot) as a new session file
        and open it, holding its writer lease."""
        new_id = check_session_id(id) if id is not None else uuid7()
        owner_id = uuid7()
        self._materialise(new_id, self._build_plan(plan, new_id, owner_id))
        return self._adopt(new_id, owner_id)

    def write_plan(self, plan: ForkPlan, id: str | None = None) -> Path:
        """Write a fork plan as a new, closed session file (no writer lease row);
        return its path. A failure leaves no file."""
        new_id = check_session_id(id) if id is not None else uuid7()
        self._materialise(new_id, self._build_plan(plan, new_id, None))
        return self.path_for(new_id)

    def write_stream(self, stream: ForkStream, id: str | None = None) -> Path:
        """`write_plan` for a streamed fork: entries are written as they are
        read, so memory does not grow with the source. A failure leaves no file."""
        new_id = check_session_id(id) if id is not None else uuid7()

        def build(conn: sqlite3.Connection) -> None:
            messages, next_seq = write_stream_rows(conn, stream)
            self._write_session_row(conn, stream.parent_session_id, messages, next_seq)

        self._materialise(new_id, build)
        return self.path_for(new_id)

    # -- listing and deleting --

    def _info(self, session_id: str, path: Path) -> SessionInfo:
        conn = connect(path, busy_timeout=self.busy_timeout)
        try:
            with mapped(path, self.busy_timeout), transaction(conn, immediate=False):
                row = read_session_row(conn, path)
                lease = read_lease(conn)
        finally:
            conn.close()
        try:
            usage = load_json(row[5])
        except ValueError as exc:
            raise SessionCorruptError(f"session file {path} has invalid usage_payload") from exc
        return SessionInfo(
            id=session_id,
            path=str(path),
            created_at=int(row[0]),
            parent_session_id=row[1],
            storage_version=int(row[2]),
            message_count=int(row[4]),
            usage=usage,
            next_seq=int(row[6]),
            lease=lease,
        )

    def list(self) -> SessionListing:
        """Every `*.sqlite` session, newest `created_at` first. Unreadable files are
        reported in `problems`, never fatal."""
        listing = SessionListing()
        try:
            paths = sorted(self.directory.iterdir())
        except OSError as exc:
            raise SessionFileError(
                f"cannot list session directory {self.directory}: {exc}"
            ) from exc
        for path in paths:
            name = path.name
            if not name.endswith(SUFFIX) or not path.is_file():
                continue
            session_id = name[: -len(SUFFIX)]
            try:
                check_session_id(session_id)
                listing.sessions.append(self._info(session_id, path))
            except SessionError as exc:
                listing.problems.append(SessionProblem(session_id, str(path), exc))
        for path in self.stale_temp_files():
            match = _TEMP_NAME.fullmatch(path.name)
            assert match is not None
            error = SessionTempFileError(
                f"{path} is the temp file of a create or fork of session {match[1]!r} that"
                " did not finish (untouched for over a minute); nothing refers to it and"
                " it can be deleted"
            )
            listing.problems.append(SessionProblem(match[1], str(path), error))
        listing.sessions.sort(key=lambda s: (-s.created_at, s.id))
        return listing

    def delete(self, session_id: str) -> None:
        """Remove a session's file, `-wal` and `-shm`. Refused while the session is
        open in this repository or another writer's lease is live."""
        path = self.path_for(session_id)
        if not path.exists():
            raise SessionNotFoundError(f"session {session_id} does not exist ({path})")
        with self._lock:
            handle = self._open.get(session_id)
        if handle is not None and not handle.closed:
            raise SessionBusyError(f"session {session_id} is open; close it before deleting")
        lease = None
        try:
            conn = connect(path, busy_timeout=self.busy_timeout)
        except SessionFileBusyError:
            raise  # the lease cannot be checked: refuse rather than guess
        except SessionError:
            conn = None  # not a usable database: nothing can hold a lease on it
        if conn is not None:
            try:
                with mapped(path, self.busy_timeout), transaction(conn, immediate=False):
                    lease = read_lease(conn)
            except SessionFileBusyError:
                raise
            except SessionError:
                lease = None
            finally:
                conn.close()
        now = self.now_ms()
        if lease is not None and lease.expires_at_ms > now:
            raise SessionBusyError(
                f"session {session_id} is leased by writer {lease.owner_id} "
                f"(fence {lease.fence}) for another {lease.expires_at_ms - now} ms"
            )
        try:
            path.unlink()
            for side in SIDE_FILES:
                _remove_quietly(Path(str(path) + side))
        except FileNotFoundError:
            raise SessionNotFoundError(f"session {session_id} does not exist ({path})") from None
        except OSError as exc:
            raise SessionFileError(f"cannot delete session file {path}: {exc}") from exc
        _fsync_dir(self.directory)

    def close(self) -> None:
        """Close every handle this repository opened."""
        with self._lock:
            handles = list(self._open.values())
        for handle in handles:
            handle.close()

    def __enter__(self) -> SessionRepository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
