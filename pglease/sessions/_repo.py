# Generated from pglease/sessions/_repo_async.py by tools/async_to_sync.py: do not edit.
"""A directory of session files, `<directory>/<session_id>.sqlite`:
`AsyncSessionRepository` (the source) and `SessionRepository`, generated from
it into `_repo.py`. The file work is blocking (`_file_build`, `_dir`): the
asyncio repository runs it in a worker thread, the blocking one directly.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from .._compat import to_thread
from ..clock import SYSTEM_CLOCK, Clock
from ..runtime import Keeper, Timing
from ._dir import (
    SUFFIX,
    SessionListing,
    check_session_id,
    materialise,
    read_session_file,
    remove_stale_temp_files,
    stale_temp_files,
)
from ._file_build import (
    NewLease,
    build_empty,
    build_plan,
    build_stream,
    claim_file,
    delete_file,
    fork_file,
    list_directory,
)
from ._file_channel import FileLeaseSource
from ._file_db import BUSY_TIMEOUT, NowMs, wall_clock_ms
from ._file_leases import FileLeases
from ._file_ops import SessionFile
from ._handle import LeaseKeeping, SqliteSession
from .errors import (
    InvalidSessionWriteError,
    SessionBusyError,
    SessionExistsError,
    SessionFileError,
    SessionNotFoundError,
)
from .fork import ForkPlan, ForkPosition, ForkScope, ForkStream
from .ids import uuid7
from .model import SessionSnapshot


class SessionRepository:
    """Session files in one directory.

    `lease_seconds` / `renew_interval` set the writer lease of handles this
    repository opens (30 s / 15 s; `renew_interval=None` disables the background
    renewal). The repository's keeper (`pglease.runtime`, one per repository,
    started with its first handle, closed by `close()`) renews every open
    handle's lease, one short write transaction per file; `clock` is its clock
    (due times, trust windows; a test's `FakeClock`). `now_ms` is the clock for
    lease expiry in the files and timestamps. `on_lost` is called (from the
    keeper, or the caller that found out) when a handle's lease is found lost:
    taken over, expired, or not renewed before the trust window
    (`ttl - margin` after the last renewal) closed; each handle also exposes
    a `lost` event. `busy_timeout` is
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
        clock: Clock = SYSTEM_CLOCK,
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
        #: The keeper's clock: due times and trust windows of the leases.
        self.clock = clock
        self._keeping: LeaseKeeping | None = None
        self._lock = threading.Lock()
        # weak: a handle the caller dropped stops renewing and its lease expires
        self._open: weakref.WeakValueDictionary[str, SqliteSession] = weakref.WeakValueDictionary()
        #: Crash leftovers this repository removed when it opened.
        self.removed_temp_files: list[Path] = []
        if clean_temp:
            self.removed_temp_files = remove_stale_temp_files(self.directory, self.now_ms())

    def stale_temp_files(self) -> list[Path]:
        """Temp files (and their -wal/-shm/-journal) of creates/forks that did not finish:
        leftovers of a crash, never sessions. A group is stale when none of its
        files was touched for `STALE_TEMP_MS` (a fork in progress writes its
        -wal, not the main file, so the newest of the three counts)."""
        return stale_temp_files(self.directory, self.now_ms())

    @property
    def _lease_ms(self) -> int:
        return round(self.lease_seconds * 1000)

    def path_for(self, session_id: str) -> Path:
        return self.directory / (check_session_id(session_id) + SUFFIX)

    def exists(self, session_id: str) -> bool:
        return to_thread(self.path_for(session_id).exists)

    # -- handles --

    def _new_lease(self, session_id: str) -> NewLease:
        return NewLease(session_id, uuid7(), self._lease_ms, self.now_ms)

    def _forget(self, handle: SqliteSession) -> None:
        with self._lock:
            if self._open.get(handle.id) is handle:
                del self._open[handle.id]

    @property
    def keeper(self) -> Keeper | None:
        """The keeper renewing this repository's leases (None before the first
        handle, after `close()`, and without `renew_interval`)."""
        return None if self._keeping is None else self._keeping.keeper

    def _keeper(self) -> LeaseKeeping | None:
        """The keeper of this repository's leases, started on first use (none
        without `renew_interval`)."""
        if self.renew_interval is None:
            return None
        with self._lock:  # one keeper, whichever thread opens first
            keeping = self._keeping
            if keeping is None:
                ttl, interval = self.lease_seconds, self.renew_interval
                # Not `Timing.of`: the documented interval may exceed ttl/3 (15 s of
                # 30 s). The margin leaves the first beat time before the window
                # closes, however close to the lease length the interval is.
                timing = Timing(ttl, interval, min(ttl / 10, interval / 2, (ttl - interval) / 2))
                source = FileLeaseSource(FileLeases())
                keeper = Keeper(source, clock=self.clock)
                keeping = self._keeping = LeaseKeeping(keeper, source.leases, timing)
                # The keeper stops once neither the repository nor a handle refers to
                # it (the asyncio one with its event loop).
                weakref.finalize(keeping, keeper.close)
            return keeping

    def _claim(self, lease: NewLease) -> SqliteSession:
        """Open `lease.session_id`'s file and claim its writer lease (for a file
        just published, the lease we wrote: same owner, fence 1)."""
        path = self.path_for(lease.session_id)
        keeping = self._keeper()
        requested_at = self.clock.monotonic()
        conn, fence = to_thread(claim_file, path, lease, self.busy_timeout)
        return self._handle(lease, path, conn, fence, keeping, requested_at)

    def _handle(
        self,
        lease: NewLease,
        path: Path,
        conn: sqlite3.Connection,
        fence: int,
        keeping: LeaseKeeping | None,
        requested_at: float,
    ) -> SqliteSession:
        file = SessionFile(
            session_id=lease.session_id,
            path=path,
            conn=conn,
            owner_id=lease.owner_id,
            fence=fence,
            lease_ms=lease.lease_ms,
            now_ms=self.now_ms,
            busy_timeout=self.busy_timeout,
        )
        handle = SqliteSession(
            file,
            keeping=keeping,
            requested_at=requested_at,
            on_close=self._forget,
            on_lost=self.on_lost,
        )
        with self._lock:
            self._open[lease.session_id] = handle
        return handle

    def open(self, session_id: str) -> SqliteSession:
        """Open an existing session and claim its writer lease."""
        return self._claim(self._new_lease(check_session_id(session_id)))

    # -- creating files --

    def create(self, id: str | None = None, parent_session_id: str | None = None) -> SqliteSession:
        """Create a new empty session (registers lane.leaf/main=null at seq 1 and
        lane.state/main=idle at seq 2; next_seq 3) and claim its lease."""
        session_id = check_session_id(id) if id is not None else uuid7()
        if parent_session_id is not None and not isinstance(parent_session_id, str):
            raise InvalidSessionWriteError("parent_session_id must be a string or None")
        lease = self._new_lease(session_id)
        build = build_empty(parent_session_id, lease)
        to_thread(materialise, self.directory, session_id, build, self.busy_timeout)
        return self._claim(lease)

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
        lease = self._new_lease(new_id)
        to_thread(
            fork_file,
            self.directory,
            source_id,
            scope,
            entry_id,
            position,
            lease,
            self.busy_timeout,
        )
        return self._claim(lease)

    def snapshot(self, session_id: str) -> SessionSnapshot:
        """Entries and registers of a session in one consistent read, without
        touching its writer lease."""
        source_path = self.path_for(session_id)
        if not source_path.exists():
            raise SessionNotFoundError(f"session {session_id} does not exist ({source_path})")
        return to_thread(read_session_file, source_path, busy_timeout=self.busy_timeout)

    def create_from_plan(self, plan: ForkPlan, id: str | None = None) -> SqliteSession:
        """Write a fork plan (from any backend's snapshot) as a new session file
        and open it, holding its writer lease."""
        new_id = check_session_id(id) if id is not None else uuid7()
        lease = self._new_lease(new_id)
        build = build_plan(plan, self.now_ms, lease)
        to_thread(materialise, self.directory, new_id, build, self.busy_timeout)
        return self._claim(lease)

    def write_plan(self, plan: ForkPlan, id: str | None = None) -> Path:
        """Write a fork plan as a new, closed session file (no writer lease row);
        return its path. A failure leaves no file."""
        new_id = check_session_id(id) if id is not None else uuid7()
        build = build_plan(plan, self.now_ms, None)
        to_thread(materialise, self.directory, new_id, build, self.busy_timeout)
        return self.path_for(new_id)

    def write_stream(self, stream: ForkStream, id: str | None = None) -> Path:
        """`write_plan` for a streamed fork: entries are written as they are
        read, so memory does not grow with the source. A failure leaves no file."""
        new_id = check_session_id(id) if id is not None else uuid7()
        build = build_stream(stream, stream.parent_session_id, self.now_ms, None)
        to_thread(materialise, self.directory, new_id, build, self.busy_timeout)
        return self.path_for(new_id)

    # -- listing and deleting --

    def list(self) -> SessionListing:
        """Every `*.sqlite` session, newest `created_at` first. Unreadable files are
        reported in `problems`, never fatal."""
        return to_thread(list_directory, self.directory, self.busy_timeout, self.now_ms())

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
        to_thread(delete_file, session_id, path, self.busy_timeout, self.now_ms)

    def close(self) -> None:
        """Close every handle this repository opened."""
        with self._lock:
            handles = list(self._open.values())
        for handle in handles:
            handle.close()
        keeping, self._keeping = self._keeping, None
        if keeping is not None:
            keeping.keeper.close()

    def __enter__(self) -> SessionRepository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
