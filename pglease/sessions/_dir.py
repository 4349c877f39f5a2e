"""A directory of session files: names (ids, temp files), publishing a new
file atomically, crash leftovers, reading any file. Plain blocking functions."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ._file_db import BUSY_TIMEOUT, connect, mapped
from ._file_rows import read_snapshot
from .errors import (
    InvalidSessionIdError,
    SessionError,
    SessionExistsError,
    SessionFileError,
    SessionNotFoundError,
    SessionTempFileError,
)
from .model import SessionInfo, SessionSnapshot
from .schema import SCHEMA_SQL

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


def stale_temp_files(directory: Path, now: int) -> list[Path]:
    """Temp files (and their -wal/-shm/-journal) of creates/forks that did not finish:
    leftovers of a crash, never sessions. A group is stale when none of its
    files was touched for `STALE_TEMP_MS` before `now` (ms; a fork in progress
    writes its -wal, not the main file, so the newest of the three counts)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise SessionFileError(f"cannot list session directory {directory}: {exc}") from exc
    groups: dict[str, list[tuple[Path, int]]] = {}
    for name in names:
        if not _TEMP_NAME.fullmatch(name):
            continue
        path = directory / name
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


def remove_stale_temp_files(directory: Path, now: int) -> list[Path]:
    """Remove what `stale_temp_files` finds; return what was removed."""
    removed: list[Path] = []
    for path in stale_temp_files(directory, now):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError:
            continue  # list() reports it: a leftover we cannot remove is no reason to fail
        removed.append(path)
    if removed:
        _fsync_dir(directory)
    return removed


def temp_problem(path: Path) -> tuple[str, SessionError]:
    """The session id a stale temp file belonged to, and the problem to list."""
    match = _TEMP_NAME.fullmatch(path.name)
    assert match is not None
    return match[1], SessionTempFileError(
        f"{path} is the temp file of a create or fork of session {match[1]!r} that"
        " did not finish (untouched for over a minute); nothing refers to it and"
        " it can be deleted"
    )


def materialise(
    directory: Path,
    session_id: str,
    build: Callable[[sqlite3.Connection], None],
    busy_timeout: float,
) -> None:
    """Build a complete session file under a temporary name, then publish it
    as `<id>.sqlite` without replacing anything. On failure nothing stays."""
    final = directory / (session_id + SUFFIX)
    if final.exists():
        raise SessionExistsError(f"session {session_id} already exists ({final})")
    temp = directory / temp_name(session_id)
    try:
        fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError as exc:
        raise SessionFileError(f"cannot write session file {final}: {exc}") from exc
    os.close(fd)
    try:
        conn = connect(temp, create=True, busy_timeout=busy_timeout)
        try:
            with mapped(temp, busy_timeout):
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
        _fsync_dir(directory)
    except OSError as exc:
        raise SessionFileError(f"cannot write session file {final}: {exc}") from exc
    finally:
        for path in (temp, *(Path(str(temp) + side) for side in SIDE_FILES)):
            _remove_quietly(path)
