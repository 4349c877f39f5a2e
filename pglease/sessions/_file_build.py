"""What a repository does to whole session files, as plain blocking functions:
claiming a file's writer lease, building new files (empty, from a plan, from a
stream, a fork), reading a file's listing row, deleting one."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ._dir import (
    SIDE_FILES,
    SUFFIX,
    SessionListing,
    SessionProblem,
    _fsync_dir,
    _remove_quietly,
    check_session_id,
    materialise,
    stale_temp_files,
    temp_problem,
)
from ._file_db import NowMs, connect, mapped, transaction
from ._file_rows import claim_lease, insert_entry, read_lease, read_session_row
from ._file_stream import file_fork_source, write_stream_rows
from .errors import (
    SessionBusyError,
    SessionCorruptError,
    SessionError,
    SessionFileBusyError,
    SessionFileError,
    SessionNotFoundError,
)
from .fork import ForkPlan, ForkPosition, ForkScope, ForkStream, checked_path, resolve_fork
from .model import Entry, SessionInfo, load_json
from .schema import EMPTY_USAGE_JSON, IDLE_LANE_STATE_JSON, MAIN_LANE, STORAGE_VERSION

Build = Callable[[sqlite3.Connection], None]


@dataclass(frozen=True, slots=True)
class NewLease:
    """The writer lease a new file is built with: who claims it, for how long, by which clock."""

    session_id: str
    owner_id: str
    lease_ms: int
    now_ms: NowMs

    def claim(self, conn: sqlite3.Connection) -> int:
        return claim_lease(conn, self.session_id, self.owner_id, self.now_ms(), self.lease_ms)


def claim_file(path: Path, lease: NewLease, busy_timeout: float) -> tuple[sqlite3.Connection, int]:
    """Open an existing session file and claim its writer lease: the
    connection the handle keeps, and the fence."""
    if not path.exists():
        raise SessionNotFoundError(f"session {lease.session_id} does not exist ({path})")
    conn = connect(path, busy_timeout=busy_timeout)
    try:
        with mapped(path, busy_timeout), transaction(conn):
            read_session_row(conn, path)
            fence = lease.claim(conn)
    except BaseException:
        conn.close()
        raise
    return conn, fence


def _write_session_row(
    conn: sqlite3.Connection,
    now: int,
    parent_session_id: str | None,
    message_count: int,
    next_seq: int,
) -> None:
    conn.execute(
        "INSERT INTO session (created_at, parent_session_id, storage_version, metadata,"
        " message_count, usage_payload, next_seq) VALUES (?, ?, ?, NULL, ?, ?, ?)",
        (now, parent_session_id, STORAGE_VERSION, message_count, EMPTY_USAGE_JSON, next_seq),
    )


def build_empty(parent_session_id: str | None, lease: NewLease) -> Build:
    """A new empty session: registers lane.leaf/main=null at seq 1 and
    lane.state/main=idle at seq 2; next_seq 3."""

    def build(conn: sqlite3.Connection) -> None:
        _write_session_row(conn, lease.now_ms(), parent_session_id, 0, 3)
        conn.executemany(
            "INSERT INTO registers (namespace, key, seq, value) VALUES (?, ?, ?, ?)",
            [
                ("lane.leaf", MAIN_LANE, 1, "null"),
                ("lane.state", MAIN_LANE, 2, IDLE_LANE_STATE_JSON),
            ],
        )
        lease.claim(conn)

    return build


def build_plan(plan: ForkPlan, now_ms: NowMs, lease: NewLease | None) -> Build:
    """A fork plan (from any backend's snapshot) as a file; leased when `lease` is given."""

    def build(conn: sqlite3.Connection) -> None:
        _write_session_row(
            conn, now_ms(), plan.parent_session_id, plan.message_count, plan.next_seq
        )
        seqs: dict[str, int] = {}
        for entry in plan.entries:
            parent_seq = None if entry.parent_id is None else seqs[entry.parent_id]
            insert_entry(conn, entry, parent_seq)
            seqs[entry.id] = entry.seq
        conn.executemany(
            "INSERT INTO registers (namespace, key, seq, value) VALUES (?, ?, ?, ?)",
            [(r.namespace, r.key, r.seq, r.value_json) for r in plan.registers],
        )
        if lease is not None:
            lease.claim(conn)

    return build


def build_stream(
    stream: ForkStream, parent_session_id: str | None, now_ms: NowMs, lease: NewLease | None
) -> Build:
    """A streamed fork as a file, its entries written as they are read."""

    def build(conn: sqlite3.Connection) -> None:
        messages, next_seq = write_stream_rows(conn, stream)
        _write_session_row(conn, now_ms(), parent_session_id, messages, next_seq)
        if lease is not None:
            lease.claim(conn)

    return build


def fork_file(
    directory: Path,
    source_id: str,
    scope: ForkScope,
    entry_id: str | None,
    position: ForkPosition,
    lease: NewLease,
    busy_timeout: float,
) -> None:
    """Copy (part of) the session file `source_id` into the new file `lease.session_id`.

    The source is read in one read transaction (its lease untouched),
    `STREAM_FETCH` entries at a time, and written as it is read; a branch
    fork reads only the branch. A failure leaves no new file."""
    source_path = directory / (source_id + SUFFIX)
    if not source_path.exists():
        raise SessionNotFoundError(f"session {source_id} does not exist ({source_path})")
    with file_fork_source(source_path, busy_timeout) as source:
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
        try:
            build = build_stream(stream, source_id, lease.now_ms, lease)
            materialise(directory, lease.session_id, build, busy_timeout)
        finally:
            stream.close()


def file_info(session_id: str, path: Path, busy_timeout: float) -> SessionInfo:
    """A session file's listing row (read without touching its lease)."""
    conn = connect(path, busy_timeout=busy_timeout)
    try:
        with mapped(path, busy_timeout), transaction(conn, immediate=False):
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


def delete_file(session_id: str, path: Path, busy_timeout: float, now_ms: NowMs) -> None:
    """Remove a session's file, `-wal` and `-shm`, refused while another
    writer's lease on it is live."""
    if not path.exists():
        raise SessionNotFoundError(f"session {session_id} does not exist ({path})")
    lease = None
    try:
        conn = connect(path, busy_timeout=busy_timeout)
    except SessionFileBusyError:
        raise  # the lease cannot be checked: refuse rather than guess
    except SessionError:
        conn = None  # not a usable database: nothing can hold a lease on it
    if conn is not None:
        try:
            with mapped(path, busy_timeout), transaction(conn, immediate=False):
                lease = read_lease(conn)
        except SessionFileBusyError:
            raise
        except SessionError:
            lease = None
        finally:
            conn.close()
    now = now_ms()
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
    _fsync_dir(directory=path.parent)


def list_directory(directory: Path, busy_timeout: float, now: int) -> SessionListing:
    """Every `*.sqlite` session, newest `created_at` first; unreadable files
    and stale temp files (by `now`, ms) are reported in `problems`, never fatal."""
    listing = SessionListing()
    try:
        paths = sorted(directory.iterdir())
    except OSError as exc:
        raise SessionFileError(f"cannot list session directory {directory}: {exc}") from exc
    for path in paths:
        name = path.name
        if not name.endswith(SUFFIX) or not path.is_file():
            continue
        session_id = name[: -len(SUFFIX)]
        try:
            check_session_id(session_id)
            listing.sessions.append(file_info(session_id, path, busy_timeout))
        except SessionError as exc:
            listing.problems.append(SessionProblem(session_id, str(path), exc))
    for path in stale_temp_files(directory, now):
        owner, error = temp_problem(path)
        listing.problems.append(SessionProblem(owner, str(path), error))
    listing.sessions.sort(key=lambda s: (-s.created_at, s.id))
    return listing
