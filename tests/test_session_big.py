"""Big sessions: file-to-file forks streamed from one read transaction of the
source, and PostgreSQL deletes that hide the session at once and remove its
rows in short chunks (a killed one leaves a hidden remainder cleanup removes)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from pglease import AsyncPostgresStore, LockTimeoutError, PostgresStore
from pglease.sessions import (
    AsyncPostgresSessionRepository,
    InvalidSessionWriteError,
    PostgresSessionRepository,
    SessionBusyError,
    SessionError,
    SessionExistsError,
    SessionNotFoundError,
    SessionRepository,
    UnknownEntryError,
    plan_fork,
)
from pglease.sessions.fork import ForkPosition, ForkScope
from pglease.sessions.pg_core import ChunkSizer, sized_chunks

from .conformance.test_sessions import Clock
from .test_session_cross import file_rows
from .test_session_pg import events
from .test_session_streaming import leftover_rows, source_file

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def files(tmp_path: Path, clock: Clock) -> Iterator[SessionRepository]:
    directory = tmp_path / "files"
    directory.mkdir()
    with SessionRepository(directory, renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture
def pg_repo(pg_store: PostgresStore, clock: Clock) -> Iterator[PostgresSessionRepository]:
    with PostgresSessionRepository(pg_store, renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture
async def apg_repo(
    apg_store: AsyncPostgresStore, clock: Clock
) -> AsyncIterator[AsyncPostgresSessionRepository]:
    async with AsyncPostgresSessionRepository(apg_store, renew_interval=None, now_ms=clock) as repo:
        yield repo


def names(files: SessionRepository) -> list[str]:
    return sorted(p.name for p in files.directory.iterdir())


# --- file -> file forks, streamed ----------------------------------------------------------


@pytest.mark.parametrize(
    ("scope", "entry_id", "position"),
    [
        ("tree", None, "at"),
        ("branch", None, "at"),
        ("branch", "c12", "at"),
        ("branch", "c12", "before"),
        ("branch", "c3", "at"),
        ("branch", "u1", "before"),
        ("branch", "i", "at"),
    ],
)
def test_streamed_file_fork_writes_the_file_the_snapshot_plan_writes(
    files: SessionRepository, scope: ForkScope, entry_id: str | None, position: ForkPosition
) -> None:
    source_file(files)
    with files.fork("src", scope, entry_id, position, id="streamed") as forked:
        assert forked.id == "streamed" and not forked.closed
    plan = plan_fork(files.snapshot("src"), "src", scope, entry_id, position)
    files.create_from_plan(plan, "planned").close()
    streamed = file_rows(files.path_for("streamed"))
    assert streamed == file_rows(files.path_for("planned"))
    assert streamed["session"][0][0] == "src"
    if scope == "branch":
        # only the branch is copied: one chain from a root
        ids = [e.id for e in files.snapshot("streamed").entries]
        assert len(ids) == len(plan.entries) < len(files.snapshot("src").entries)


def test_streamed_file_fork_of_an_empty_main_lane(files: SessionRepository) -> None:
    files.create("empty").close()
    for position in ("at", "before"):
        with files.fork("empty", position=position, id=f"e-{position}") as forked:
            assert forked.snapshot().entries == ()


def test_a_parent_cycle_in_the_source_ends_the_walk_and_writes_no_file(
    files: SessionRepository,
) -> None:
    source_file(files)
    conn = sqlite3.connect(files.path_for("src"), isolation_level=None)
    # c5's parent now points forward to c10 (whose chain leads back to c5):
    # the walk up from c12 must stop rather than loop, and the fork fail.
    conn.execute("UPDATE entries SET parent_id = 'c10' WHERE id = 'c5'")
    conn.close()
    before = names(files)
    with pytest.raises(UnknownEntryError, match="missing parent"):
        files.fork("src", entry_id="c12", id="cyc")
    assert names(files) == before and not files.exists("cyc")


def test_streamed_file_fork_refusals_write_nothing(files: SessionRepository) -> None:
    source_file(files)
    files.create("taken").close()
    before = names(files)
    with pytest.raises(SessionNotFoundError):
        files.fork("nothing", id="x")
    with pytest.raises(SessionExistsError):
        files.fork("src", id="taken")
    with pytest.raises(UnknownEntryError, match="does not exist"):
        files.fork("src", entry_id="zz", id="x")
    with pytest.raises(InvalidSessionWriteError):
        files.fork("src", "tree", entry_id="c3", id="x")
    with pytest.raises(InvalidSessionWriteError):
        files.fork("src", "sideways", id="x")  # type: ignore[arg-type]
    assert names(files) == before


# --- chunked PostgreSQL deletes -----------------------------------------------------------


def test_delete_hides_at_once_then_removes_rows_in_chunks(
    pg_repo: PostgresSessionRepository,
    pg_store: PostgresStore,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    pg_repo.import_file(source_file(files), id="big").close()
    rows = leftover_rows(pg_dsn, schema, "big")
    total = sum(rows.values()) - 1
    progress: list[int] = []
    seen: list[tuple[bool, list[str]]] = []

    def during(removed: int) -> None:
        progress.append(removed)
        seen.append((pg_repo.exists("big"), pg_repo.list().ids()))
        with pytest.raises(SessionNotFoundError):
            pg_repo.open("big")
        with pytest.raises(SessionNotFoundError):
            pg_repo.snapshot("big")

    pg_repo.delete("big", chunk_rows=7, on_progress=during)
    assert set(leftover_rows(pg_dsn, schema, "big").values()) == {0}
    # every chunk removed at most 7 rows, all of them in the end
    assert progress == sorted(progress) and progress[-1] >= total - 1
    assert all(b - a <= 7 for a, b in zip([0, *progress], progress, strict=False))
    assert len(progress) >= total // 7
    assert seen and all(s == (False, []) for s in seen)
    assert [t for t, _ in events(pg_store, "big")].count("session.deleted") == 1
    with pytest.raises(SessionNotFoundError):
        pg_repo.delete("big")
    # the id is free again
    with pg_repo.create("big") as again:
        assert again.stats().entry_count == 0


def test_delete_refusals_change_nothing(
    pg_repo: PostgresSessionRepository, files: SessionRepository, pg_dsn: str, schema: str
) -> None:
    pg_repo.import_file(source_file(files), id="kept").close()
    before = leftover_rows(pg_dsn, schema, "kept")
    for bad in (0, -1, True, 2.5, "10"):
        with pytest.raises(InvalidSessionWriteError, match="chunk_rows"):
            pg_repo.delete("kept", chunk_rows=bad)  # type: ignore[arg-type]
    with pg_repo.open("kept"), pytest.raises(SessionBusyError, match="leased"):
        pg_repo.delete("kept", chunk_rows=3)
    assert leftover_rows(pg_dsn, schema, "kept") == before
    assert pg_repo.exists("kept") and pg_repo.list().problems == []


def test_a_delete_whose_caller_fails_midway_leaves_a_hidden_remainder(
    pg_store: PostgresStore,
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    pg_repo.import_file(source_file(files), id="half").close()

    def stop(removed: int) -> None:
        raise RuntimeError(f"stopped after {removed}")

    with pytest.raises(RuntimeError, match="stopped after 5"):
        pg_repo.delete("half", chunk_rows=5, on_progress=stop)
    rows = leftover_rows(pg_dsn, schema, "half")
    assert rows["sessions"] == 1 and sum(rows.values()) > 1
    assert not pg_repo.exists("half") and pg_repo.list().ids() == []
    eager = PostgresSessionRepository(pg_store, renew_interval=None, import_stale_after=0)
    (problem,) = eager.list().problems
    assert problem.id == "half" and "interrupted import or delete" in str(problem.error)
    assert eager.cleanup_imports() == ["half"]
    assert set(leftover_rows(pg_dsn, schema, "half").values()) == {0}


KILLED_DELETE = textwrap.dedent(
    """
    import sys
    from pglease import PostgresStore
    from pglease.sessions import PostgresSessionRepository

    dsn, schema, sid = sys.argv[1:4]

    def progress(removed: int) -> None:
        print(removed, flush=True)
        if removed >= 6:
            sys.stdin.readline()  # wait here for the SIGKILL

    with PostgresStore(dsn, schema=schema) as store:
        repo = PostgresSessionRepository(store, renew_interval=None)
        repo.delete(sid, chunk_rows=3, on_progress=progress)
    print("finished", flush=True)
    """
)


def test_a_killed_delete_leaves_a_hidden_remainder_that_cleanup_removes(
    pg_store: PostgresStore,
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    pg_repo.import_file(source_file(files), id="killed").close()
    before = leftover_rows(pg_dsn, schema, "killed")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_DELETE, pg_dsn, schema, "killed"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip(), proc.stdout.readline().strip()]
        assert lines == ["3", "6"]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=120) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=120)
    rows = leftover_rows(pg_dsn, schema, "killed")
    assert rows["sessions"] == 1
    assert sum(rows.values()) == sum(before.values()) - 6  # two chunks of 3 went
    fresh = PostgresSessionRepository(pg_store, renew_interval=None)
    assert not fresh.exists("killed") and fresh.list().ids() == []
    assert fresh.list().problems == [] and fresh.cleanup_imports() == []  # not stale yet
    with pytest.raises(SessionExistsError):
        fresh.create("killed")
    eager = PostgresSessionRepository(pg_store, renew_interval=None, import_stale_after=0)
    (problem,) = eager.list().problems
    assert problem.id == "killed"
    assert eager.cleanup_imports() == ["killed"]
    assert set(leftover_rows(pg_dsn, schema, "killed").values()) == {0}
    with eager.create("killed") as again:
        assert again.stats().entry_count == 0


async def test_async_delete_hides_then_removes_in_chunks(
    apg_repo: AsyncPostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    await (await apg_repo.import_file(source_file(files), id="abig")).close()
    progress: list[int] = []
    await apg_repo.delete("abig", chunk_rows=4, on_progress=progress.append)
    assert not await apg_repo.exists("abig") and (await apg_repo.list()).ids() == []
    assert len(progress) >= 10 and all(
        b - a <= 4 for a, b in zip([0, *progress], progress, strict=False)
    )
    assert set(leftover_rows(pg_dsn, schema, "abig").values()) == {0}
    with pytest.raises(SessionNotFoundError):
        await apg_repo.delete("abig")
    with pytest.raises(InvalidSessionWriteError, match="chunk_rows"):
        await apg_repo.delete("abig", chunk_rows=0)
    async with await apg_repo.create("abig") as session:
        with pytest.raises(SessionBusyError, match="leased"):
            await apg_repo.delete("abig")
        assert (await session.stats()).entry_count == 0


# --- chunk sizes adapted to the time a chunk took -------------------------------------------


def test_chunk_sizer_shrinks_after_a_long_chunk_and_grows_back() -> None:
    sizer = ChunkSizer(500, target=0.05)
    assert (sizer.size, sizer.floor) == (500, 100)
    sizer.record(0.04)  # within the target, above half of it: unchanged
    assert sizer.size == 500
    sizer.record(0.1)  # twice the target: half the size
    assert sizer.size == 250
    sizer.record(5.0)  # a stall: never below the floor
    assert sizer.size == 100
    sizer.record(0.01)
    sizer.record(0.01)
    assert sizer.size == 400
    sizer.record(0.0)
    assert sizer.size == 500  # never above the limit


def test_chunk_sizer_never_goes_below_a_small_limit() -> None:
    sizer = ChunkSizer(3, target=0.05)
    sizer.record(10.0)
    assert sizer.size == 3  # an explicit small chunk stays as asked


def test_sized_chunks_follow_the_sizer_between_chunks() -> None:
    sizer = ChunkSizer(400, target=0.05)
    got = []
    for part in sized_chunks(range(1000), sizer):
        got.append(len(part))
        sizer.record(0.2)  # every chunk four times too long
    assert got == [400, 100, 100, 100, 100, 100, 100]
    assert sum(got) == 1000


def test_a_delete_that_fails_after_hiding_says_so_and_cleanup_finishes_it(
    pg_dsn: str, schema: str, files: SessionRepository
) -> None:
    """The purge's next chunk waits on a session row another connection holds:
    the lock timeout reaches the caller as a SessionError naming the state."""
    with PostgresStore(pg_dsn, schema=schema, lock_timeout=0.2) as store:
        repo = PostgresSessionRepository(store, renew_interval=None)
        repo.import_file(source_file(files), id="stuck").close()
        with psycopg.connect(pg_dsn) as blocker:

            def hold_the_row(removed: int) -> None:
                if removed <= 5:
                    blocker.execute(
                        f'SELECT 1 FROM "{schema}".sessions WHERE id = %s FOR UPDATE', ("stuck",)
                    )

            with pytest.raises(
                SessionError, match=r"is deleted \(hidden at once\) but removing"
            ) as info:
                repo.delete("stuck", chunk_rows=5, on_progress=hold_the_row)
            assert isinstance(info.value.__cause__, LockTimeoutError)
            blocker.rollback()
        assert not repo.exists("stuck") and repo.list().ids() == []
        assert leftover_rows(pg_dsn, schema, "stuck")["sessions"] == 1
        eager = PostgresSessionRepository(store, renew_interval=None, import_stale_after=0)
        assert eager.cleanup_imports() == ["stuck"]
        assert set(leftover_rows(pg_dsn, schema, "stuck").values()) == {0}


async def test_async_delete_that_fails_after_hiding_says_so(
    pg_dsn: str, schema: str, files: SessionRepository
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=0.2) as store:
        repo = AsyncPostgresSessionRepository(store, renew_interval=None)
        await (await repo.import_file(source_file(files), id="astuck")).close()
        with psycopg.connect(pg_dsn) as blocker:

            def hold_the_row(removed: int) -> None:
                if removed <= 5:
                    blocker.execute(
                        f'SELECT 1 FROM "{schema}".sessions WHERE id = %s FOR UPDATE', ("astuck",)
                    )

            with pytest.raises(SessionError, match=r"is deleted \(hidden at once\)") as info:
                await repo.delete("astuck", chunk_rows=5, on_progress=hold_the_row)
            assert isinstance(info.value.__cause__, LockTimeoutError)
            blocker.rollback()
        assert not await repo.exists("astuck")
        assert await repo.cleanup_imports(0) == ["astuck"]
        assert set(leftover_rows(pg_dsn, schema, "astuck").values()) == {0}
