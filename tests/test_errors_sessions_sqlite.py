"""Failure honesty of session files: no raw sqlite3 error from the public API.

Real files, real processes: a file whose lock another process holds past the
busy timeout, files overwritten with junk, a file that fills up. A failed
commit leaves nothing; the handle stays usable once the trouble is gone.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pglease import (
    LeaseLostError,
    LockTimeoutError,
    SqliteCorruptError,
    SqliteFileError,
    StoreBusyError,
)
from pglease.sessions import (
    AppendEntry,
    SessionCorruptError,
    SessionError,
    SessionFileBusyError,
    SessionFileCorruptError,
    SessionFileError,
    SessionRepository,
    SqliteSession,
    WriterLeaseLostError,
    read_session_file,
)

from .test_errors_sqlite import corrupt_pages_after_the_first, write_lock_held


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except BaseException as exc:
        return exc


def _session_with_entries(repo: SessionRepository, sid: str = "s1") -> Path:
    with repo.create(sid) as s:
        first = s.append_message(None, msg("one"))
        s.append_message(first.id, msg("two"))
        s.set_register("fact", "k", 1)
    return repo.path_for(sid)


# --- the file's lock held past the busy timeout -------------------------------------------


def test_a_locked_session_file_gives_a_typed_error_and_commits_nothing(tmp_path: Path) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None, busy_timeout=0.2)
    with repo.create("s1") as s:
        root = s.append_message(None, msg("root"))
        before = s.stats().next_seq
        with write_lock_held(s.path):
            error = _outcome(lambda: s.append_message(root.id, msg("lost")))
            assert isinstance(error, SessionFileBusyError), repr(error)
            # Session, SQLite-file and lock-wait hierarchies all catch it.
            for cls in (SessionError, SessionFileError, StoreBusyError, LockTimeoutError):
                assert isinstance(error, cls)
            assert isinstance(error.__cause__, sqlite3.OperationalError)
            assert str(s.path) in str(error) and "0.2 s" in str(error)
            assert isinstance(_outcome(s.renew), SessionFileBusyError)
            # WAL: reads are not blocked by the other process's write lock.
            assert s.stats().next_seq == before
        # Nothing of the failed commit is there, and the handle still works.
        assert s.stats().next_seq == before
        assert [e.id for e in s.scan_entries()] == [root.id]
        assert s.append_message(root.id, msg("kept")).seq == before
        assert not s.lost.is_set()


def test_opening_behind_a_held_lock_is_typed(tmp_path: Path) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None, busy_timeout=0.2)
    path = _session_with_entries(repo)
    with write_lock_held(path), pytest.raises(SessionFileBusyError):
        repo.open("s1")
    with repo.open("s1") as s:
        assert s.stats().entry_count == 2


# --- corrupt files ---------------------------------------------------------------------------


def test_a_junk_session_file_is_typed_everywhere(tmp_path: Path) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None)
    path = repo.path_for("junk")
    path.write_bytes(b"definitely not sqlite " * 300)
    for call in (
        lambda: repo.open("junk"),
        lambda: repo.snapshot("junk"),
        lambda: read_session_file(path),
        lambda: repo.fork("junk", id="copy"),
    ):
        error = _outcome(call)
        assert isinstance(error, SessionFileCorruptError), repr(error)
        assert isinstance(error, SessionCorruptError)  # as before
        assert isinstance(error, SqliteCorruptError) and isinstance(error, SqliteFileError)
        assert isinstance(error.__cause__, sqlite3.DatabaseError)
    [problem] = repo.list().problems
    assert isinstance(problem.error, SessionFileCorruptError)
    assert not repo.exists("copy")
    repo.delete("junk")  # nothing can hold a lease on junk
    assert not path.exists()


def test_a_session_file_corrupted_after_writing_is_typed_on_open_and_read(
    tmp_path: Path,
) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None)
    path = _session_with_entries(repo)
    corrupt_pages_after_the_first(path)
    for call in (
        lambda: repo.open("s1"),
        lambda: repo.snapshot("s1"),
        lambda: read_session_file(path),
    ):
        error = _outcome(call)
        assert isinstance(error, SessionFileCorruptError), repr(error)
    [problem] = repo.list().problems
    assert isinstance(problem.error, SessionCorruptError)


def test_a_file_corrupted_under_an_open_handle_is_typed(tmp_path: Path) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None)
    s = repo.create("s1")
    root = s.append_message(None, msg("root"))
    s.append_message(root.id, msg("child"))
    # Move every page into the main file (the WAL is reset, so the handle's page
    # cache is dropped), then damage it.
    other = sqlite3.connect(s.path)
    assert other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    other.close()
    corrupt_pages_after_the_first(s.path)
    calls: list[Callable[[], object]] = [
        s.stats,
        s.snapshot,
        s.scan_entries,
        s.usage_rows,
        lambda: s.get_entry(root.id),
        lambda: s.scan_branch(root.id),
        lambda: s.get_register("lane.leaf", "main"),
        lambda: s.list_registers("lane.leaf"),
        lambda: s.append_message(root.id, msg("more")),
        s.renew,
    ]
    for call in calls:
        error = _outcome(call)
        assert isinstance(error, SessionFileCorruptError), repr(error)
        assert isinstance(error.__cause__, sqlite3.DatabaseError)
    s.close()  # never raises: a lease it cannot release runs out
    assert s.closed


# --- a full file --------------------------------------------------------------------------


def test_a_full_session_file_fails_the_commit_and_leaves_nothing(tmp_path: Path) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None)
    with repo.create("s1") as s:
        root = s.append_message(None, msg("root"))
        before = s.stats()
        # SQLITE_FULL as a full disk gives it, by capping this connection's file.
        conn = s._conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        big = [AppendEntry("message", root.id, {"message": msg("x" * 100_000)}) for _ in range(3)]
        with pytest.raises(SessionFileError, match="SQLITE_FULL") as caught:
            s.commit(big)
        assert not isinstance(caught.value, SessionFileBusyError | SessionCorruptError)
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        assert s.stats() == before
        conn.execute("PRAGMA max_page_count = 1073741823")
        assert s.commit(big).first_seq == before.next_seq


# --- a lost writer lease is a LeaseLostError -------------------------------------------------


def test_a_lost_file_writer_lease_is_a_lease_lost_error(tmp_path: Path) -> None:
    clock = Clock()
    repo = SessionRepository(tmp_path, lease_seconds=1, renew_interval=None, now_ms=clock)
    first: SqliteSession = repo.create("s1")
    clock.now += 2_000
    other = SessionRepository(tmp_path, lease_seconds=1, renew_interval=None, now_ms=clock)
    with other.open("s1"):
        with pytest.raises(LeaseLostError) as caught:
            first.append_message(None, msg("stale"))
        assert isinstance(caught.value, WriterLeaseLostError)
    first.close()


def test_bad_busy_timeouts_are_refused(tmp_path: Path) -> None:
    for bad in (0, -1, True, float("nan"), 1e9, "5"):
        with pytest.raises(SessionError):
            SessionRepository(tmp_path, busy_timeout=bad)  # type: ignore[arg-type]
