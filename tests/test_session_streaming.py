"""Streamed forks and chunked imports: PostgreSQL -> file without a snapshot,
file -> PostgreSQL in short transactions that stay hidden until the last one.
The tests on `pg_repo` or `flavour` run on both flavours, blocking and asyncio."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pglease import AsyncPostgresStore, PostgresStore
from pglease.sessions import (
    AppendEntry,
    AsyncPostgresSessionRepository,
    InvalidSessionWriteError,
    PostgresSessionRepository,
    SessionBusyError,
    SessionError,
    SessionExistsError,
    SessionNotFoundError,
    SessionRepository,
    SetRegister,
    UnknownEntryError,
    plan_fork,
    read_session_file,
)
from pglease.sessions.fork import ForkPosition, ForkScope

from ._blocking import FLAVOURS, Flavour, open_flavour
from .test_session_cross import file_rows, populate
from .test_session_pg import QUERIES, Clock, msg

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clock() -> Clock:
    return Clock()


flavour = pytest.fixture(params=FLAVOURS)(open_flavour)


@pytest.fixture
def pg_repo(flavour: Flavour, clock: Clock) -> Iterator[PostgresSessionRepository]:
    with flavour.repo(renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture
async def apg_repo(
    apg_store: AsyncPostgresStore, clock: Clock
) -> AsyncIterator[AsyncPostgresSessionRepository]:
    async with AsyncPostgresSessionRepository(apg_store, renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture
def files(tmp_path: Path, clock: Clock) -> Iterator[SessionRepository]:
    directory = tmp_path / "files"
    directory.mkdir()
    with SessionRepository(directory, renew_interval=None, now_ms=clock) as repo:
        yield repo


def source_file(files: SessionRepository, name: str = "src", chain: int = 25) -> Path:
    """A file session with a tree (divergences, compactions, lanes, facts,
    labels, things a fork drops) and a longer chain, for many chunks."""
    with files.create(name) as session:
        populate(session)
        parent = "u1"
        writes: list[Any] = []
        for i in range(chain):
            kind = "compaction" if i % 10 == 9 else "message"
            payload: dict[str, Any] = (
                {"summary": "s", "retainedTail": [], "tokensBefore": 1, "fromHook": False}
                if kind == "compaction"
                else {"message": msg(f"m{i}")}
            )
            writes.append(AppendEntry(kind, parent, payload, id=f"c{i}"))
            parent = f"c{i}"
        writes.append(SetRegister("lane.leaf", "main", parent))
        writes.append(SetRegister("fact.label", "c3", "on c3"))
        writes.append(SetRegister("fact.label", "gone", "on an entry that does not exist"))
        session.commit(writes)
    return files.path_for(name)


def index_rows(store_dsn: str, schema: str, session_id: str) -> dict[str, list[tuple[Any, ...]]]:
    """The branch index of one session, without its session_id column."""
    with psycopg.connect(store_dsn) as conn:
        return {
            "entries": conn.execute(
                f'SELECT branch_id, entry_id, entry_seq, entry_type FROM "{schema}".'
                "session_branch_entries WHERE session_id = %s ORDER BY 1, 3",
                (session_id,),
            ).fetchall(),
            "meta": conn.execute(
                "SELECT branch_id, tip_entry_id, tip_seq, base_branch_id, base_seq"
                f' FROM "{schema}".session_branch_meta WHERE session_id = %s ORDER BY 1',
                (session_id,),
            ).fetchall(),
        }


def leftover_rows(dsn: str, schema: str, session_id: str) -> dict[str, int]:
    """Rows of a session in every session table, hidden or not."""
    tables = [
        "sessions",
        "session_entries",
        "session_registers",
        "session_branch_entries",
        "session_branch_meta",
    ]
    with psycopg.connect(dsn) as conn:
        out = {}
        for table in tables:
            column = "id" if table == "sessions" else "session_id"
            row = conn.execute(
                f'SELECT count(*) FROM "{schema}".{table} WHERE {column} = %s', (session_id,)
            ).fetchone()
            assert row is not None
            out[table] = int(row[0])
        return out


def by_key(registers: Any) -> list[Any]:
    return sorted(registers, key=lambda r: (r.namespace, r.key))


# --- chunked imports ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 7, 10_000])
def test_chunked_import_equals_the_one_transaction_import(
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
    chunk: int,
) -> None:
    """Entries, registers, session row and the branch index of an import in
    chunks of `chunk` entries equal those of the plan written in one go."""
    path = source_file(files)
    with pg_repo.create_from_plan(plan_fork(read_session_file(path), "src", "tree"), "ref"):
        pass
    progress: list[int] = []
    with pg_repo.import_file(path, id="imp", chunk_entries=chunk, on_progress=progress.append) as s:
        assert s.stats().entry_count == 12 + 1 + 25
        leaves = [e.id for e in s.scan_entries()]
    total = 12 + 1 + 25
    assert progress == [min(total, chunk * (i + 1)) for i in range(-(-total // chunk))]
    ref, imp = pg_repo.snapshot("ref"), pg_repo.snapshot("imp")
    assert imp.entries == ref.entries and imp.registers == ref.registers
    assert imp.parent_session_id == ref.parent_session_id == "src"
    ref_info, imp_info = pg_repo.info("ref"), pg_repo.info("imp")
    assert (imp_info.message_count, imp_info.next_seq, imp_info.usage) == (
        ref_info.message_count,
        ref_info.next_seq,
        ref_info.usage,
    )
    assert index_rows(pg_dsn, schema, "imp") == index_rows(pg_dsn, schema, "ref")
    labels = {r.key for r in imp.registers if r.namespace == "fact.label"}
    assert labels == {"b", "f", "c3"}  # the label of a missing entry is dropped
    with pg_repo.open("imp") as a, pg_repo.open("ref") as b:
        for leaf in leaves:
            for query in QUERIES[:4]:
                got = a.scan_branch(
                    leaf, newest_first=query.newest_first, stop_type=query.stop_type
                )
                assert got == b.scan_branch(
                    leaf, newest_first=query.newest_first, stop_type=query.stop_type
                )


def test_an_import_is_invisible_until_its_last_transaction(
    pg_repo: PostgresSessionRepository, files: SessionRepository, pg_store: PostgresStore
) -> None:
    path = source_file(files)
    rid = pg_store.ensure_resource("session", "imp")
    seen: list[int] = []
    # Another client looks while the import runs: a blocking one on either
    # flavour, since it runs inside the importer's on_progress.
    other = PostgresSessionRepository(pg_store, renew_interval=None)

    def check(written: int) -> None:
        seen.append(written)
        if len(seen) == 1:  # before create() below claims and releases the lease
            assert pg_store.events(rid) == []  # watchers have nothing to see yet
        assert not other.exists("imp")
        assert "imp" not in other.list().ids()
        assert other.list().problems == []  # in progress, not abandoned
        with pytest.raises(SessionNotFoundError):
            other.open("imp")
        with pytest.raises(SessionNotFoundError):
            other.info("imp")
        with pytest.raises(SessionNotFoundError):
            other.snapshot("imp")
        with pytest.raises(SessionNotFoundError):
            other.delete("imp")
        with pytest.raises(SessionExistsError):
            other.create("imp")
        with pytest.raises(SessionBusyError, match="another import of this id is in progress"):
            other.import_file(path, id="imp")

    with pg_repo.import_file(path, id="imp", chunk_entries=5, on_progress=check) as session:
        assert session.stats().entry_count == 38
    assert len(seen) == 8
    assert pg_repo.exists("imp") and "imp" in pg_repo.list().ids()
    forked = next(e for e in pg_store.events(rid) if e.type == "session.forked")
    assert forked.payload["entries"] == 38


def test_a_failed_import_leaves_nothing(
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    """An entry whose parent is missing, found in the third chunk: the chunks
    already committed are removed, and the id is free again."""
    path = source_file(files)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE entries SET parent_id = 'nowhere' WHERE id = 'c20'")
    conn.commit()
    conn.close()
    with pytest.raises(UnknownEntryError, match="missing parent 'nowhere'"):
        pg_repo.import_file(path, id="imp", chunk_entries=5)
    assert leftover_rows(pg_dsn, schema, "imp") == dict.fromkeys(
        [
            "sessions",
            "session_entries",
            "session_registers",
            "session_branch_entries",
            "session_branch_meta",
        ],
        0,
    )
    assert pg_repo.list().problems == []


def test_bad_import_arguments_change_nothing(
    pg_repo: PostgresSessionRepository,
    flavour: Flavour,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    path = source_file(files)
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(InvalidSessionWriteError, match="chunk_entries"):
            pg_repo.import_file(path, id="imp", chunk_entries=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidSessionWriteError, match="stale_after"):
        pg_repo.cleanup_imports(-1)
    with pytest.raises(InvalidSessionWriteError, match="import_chunk_entries"):
        flavour.repo(import_chunk_entries=0)
    with pytest.raises(SessionNotFoundError):
        pg_repo.import_file(path.with_name("nothing.sqlite"), id="imp")
    assert leftover_rows(pg_dsn, schema, "imp")["sessions"] == 0
    with pg_repo.create("taken"):
        pass
    with pytest.raises(SessionExistsError):
        pg_repo.import_file(path, id="taken", chunk_entries=2)
    assert pg_repo.snapshot("taken").entries == ()
    assert pg_repo.cleanup_imports(0) == []


KILLED_IMPORT = textwrap.dedent(
    """
    import sys
    from pglease import PostgresStore
    from pglease.sessions import PostgresSessionRepository

    dsn, schema, path, new_id = sys.argv[1:5]

    def progress(written: int) -> None:
        print(written, flush=True)
        if written >= 6:
            sys.stdin.readline()  # wait here for the SIGKILL

    with PostgresStore(dsn, schema=schema) as store:
        repo = PostgresSessionRepository(store, renew_interval=None)
        repo.import_file(path, id=new_id, chunk_entries=3, on_progress=progress)
    print("finished", flush=True)
    """
)


def kill_mid_import(pg_dsn: str, schema: str, path: Path, new_id: str) -> None:
    """Run an import in a real process and SIGKILL it after its second chunk."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_IMPORT, pg_dsn, schema, str(path), new_id],
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


def test_a_killed_import_leaves_nothing_visible_and_is_cleaned_up(
    flavour: Flavour,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    path = source_file(files)
    kill_mid_import(pg_dsn, schema, path, "killed")
    rows = leftover_rows(pg_dsn, schema, "killed")
    assert rows["sessions"] == 1 and rows["session_entries"] == 6  # two chunks, hidden
    fresh = flavour.repo(renew_interval=None)
    assert not fresh.exists("killed") and "killed" not in fresh.list().ids()
    # Not stale yet (120 s): neither reported nor removed; another import waits.
    assert fresh.list().problems == []
    assert fresh.cleanup_imports() == []
    with pytest.raises(SessionBusyError):
        fresh.import_file(path, id="killed")
    # With a zero stale limit the leftover is reported, then removed.
    eager = flavour.repo(renew_interval=None, import_stale_after=0)
    (problem,) = eager.list().problems
    assert problem.id == "killed" and "interrupted import" in str(problem.error)
    assert eager.cleanup_imports() == ["killed"]
    assert set(leftover_rows(pg_dsn, schema, "killed").values()) == {0}
    assert eager.list().problems == []


def test_the_next_import_replaces_a_killed_one(
    flavour: Flavour,
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    path = source_file(files)
    kill_mid_import(pg_dsn, schema, path, "again")
    eager = flavour.repo(renew_interval=None, import_stale_after=0)
    with eager.import_file(path, id="again", chunk_entries=4) as session:
        assert session.stats().entry_count == 38
    with pg_repo.create_from_plan(plan_fork(read_session_file(path), "src", "tree"), "ref"):
        pass
    assert pg_repo.snapshot("again").entries == pg_repo.snapshot("ref").entries
    assert pg_repo.snapshot("again").registers == pg_repo.snapshot("ref").registers
    assert index_rows(pg_dsn, schema, "again") == index_rows(pg_dsn, schema, "ref")


async def test_async_chunked_import_equals_the_sync_one(
    apg_repo: AsyncPostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    path = source_file(files)
    seen: list[int] = []

    def check(written: int) -> None:
        seen.append(written)

    session = await apg_repo.import_file(path, id="imp", chunk_entries=4, on_progress=check)
    await session.close()
    ref = await apg_repo.create_from_plan(plan_fork(read_session_file(path), "src", "tree"), "ref")
    await ref.close()
    assert seen == [4, 8, 12, 16, 20, 24, 28, 32, 36, 38]
    a, b = await apg_repo.snapshot("imp"), await apg_repo.snapshot("ref")
    assert a.entries == b.entries and a.registers == b.registers
    assert index_rows(pg_dsn, schema, "imp") == index_rows(pg_dsn, schema, "ref")
    assert (await apg_repo.info("imp")).next_seq == (await apg_repo.info("ref")).next_seq
    with pytest.raises(SessionExistsError):
        await apg_repo.import_file(path, id="imp", chunk_entries=4)
    assert await apg_repo.cleanup_imports(0) == []


# --- streamed forks to files -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scope", "entry_id", "position"),
    [
        ("branch", None, "at"),
        ("branch", "c14", "at"),
        ("branch", "c14", "before"),
        ("branch", "i", "at"),
        ("branch", "a", "before"),
        ("tree", None, "at"),
    ],
)
def test_fork_to_file_copies_exactly_the_branch(
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    tmp_path: Path,
    scope: Any,
    entry_id: str | None,
    position: Any,
) -> None:
    """The streamed fork writes what `plan_fork` over a full snapshot plans:
    for a branch, the path from the root to the entry and nothing else."""
    with pg_repo.import_file(source_file(files), id="pg", chunk_entries=9):
        pass
    snapshot = pg_repo.snapshot("pg")
    plan = plan_fork(snapshot, "pg", scope, entry_id, position)
    out = tmp_path / "out"
    out.mkdir()
    path = pg_repo.fork_to_file("pg", out, scope, entry_id, position, id="fork")
    got = read_session_file(path)
    assert got.entries == plan.entries and by_key(got.registers) == by_key(plan.registers)
    if scope == "branch":
        by_id = snapshot.entry_map()
        ids = [e.id for e in got.entries]
        if ids:
            assert by_id[ids[0]].parent_id is None
            assert all(by_id[b].parent_id == a for a, b in itertools.pairwise(ids))
        expected_tip = entry_id or "c24"
        if position == "before":
            expected_tip = by_id[expected_tip].parent_id or ""
        assert (ids[-1] if ids else "") == expected_tip
    # the file equals the same fork written from the in-memory plan
    reference = SessionRepository(tmp_path / "out", renew_interval=None)
    ref_path = reference.write_plan(plan, "reference")
    rows, ref_rows = file_rows(path), file_rows(ref_path)
    assert rows == ref_rows


async def test_async_fork_to_file_streams_the_same_file(
    apg_repo: AsyncPostgresSessionRepository, files: SessionRepository, tmp_path: Path
) -> None:
    session = await apg_repo.import_file(source_file(files), id="pg", chunk_entries=50)
    await session.close()
    snapshot = await apg_repo.snapshot("pg")
    out = tmp_path / "out"
    out.mkdir()
    cases: list[tuple[ForkScope, str | None, ForkPosition]] = [
        ("branch", None, "at"),
        ("branch", "c14", "before"),
        ("tree", None, "at"),
    ]
    for scope, entry_id, position in cases:
        plan = plan_fork(snapshot, "pg", scope, entry_id, position)
        path = await apg_repo.fork_to_file(
            "pg", out, scope, entry_id, position, id=f"f-{scope}-{position}"
        )
        got = read_session_file(path)
        assert got.entries == plan.entries and by_key(got.registers) == by_key(plan.registers)
    with pytest.raises(UnknownEntryError):
        await apg_repo.fork_to_file("pg", out, "branch", "nope", id="never")
    assert not (out / "never.sqlite").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["f-branch-at.sqlite", "f-branch-before.sqlite", "f-tree-at.sqlite"]
    )


def test_fork_of_a_broken_chain_leaves_no_file(
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
    tmp_path: Path,
) -> None:
    with pg_repo.import_file(source_file(files), id="pg"):
        pass
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'DELETE FROM "{schema}".session_entries WHERE session_id = %s AND id = %s',
            ("pg", "c5"),
        )
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnknownEntryError, match="missing parent 'c5'"):
        pg_repo.fork_to_file("pg", out, "branch", id="broken")
    with pytest.raises(UnknownEntryError, match="missing parent 'c5'"):
        pg_repo.fork_to_file("pg", out, "tree", id="broken")
    assert list(out.iterdir()) == []


async def test_async_failed_import_leaves_nothing(
    apg_repo: AsyncPostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    path = source_file(files)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE entries SET parent_id = 'nowhere' WHERE id = 'c20'")
    conn.commit()
    conn.close()
    with pytest.raises(UnknownEntryError, match="missing parent 'nowhere'"):
        await apg_repo.import_file(path, id="imp", chunk_entries=5)
    assert set(leftover_rows(pg_dsn, schema, "imp").values()) == {0}
    assert (await apg_repo.list()).problems == []
    with pytest.raises(SessionNotFoundError):
        await apg_repo.import_file(path.with_name("nothing.sqlite"))


def test_bad_fork_arguments_write_no_file(
    pg_repo: PostgresSessionRepository, files: SessionRepository, tmp_path: Path
) -> None:
    with pg_repo.import_file(source_file(files), id="pg"):
        pass
    out = tmp_path / "out"
    out.mkdir()
    bad: list[tuple[Any, Any, Any, type[Exception]]] = [
        ("branch", 5, "at", InvalidSessionWriteError),
        ("sideways", None, "at", InvalidSessionWriteError),
        ("branch", "c3", "after", InvalidSessionWriteError),
        ("tree", "c3", "at", InvalidSessionWriteError),
        ("branch", "nope", "at", UnknownEntryError),
    ]
    for scope, entry_id, position, error in bad:
        with pytest.raises(error):
            pg_repo.fork_to_file("pg", out, scope, entry_id, position, id="never")
    with pytest.raises(SessionNotFoundError):
        pg_repo.fork_to_file("missing", out, id="never")
    assert list(out.iterdir()) == []


# --- forks inside PostgreSQL -------------------------------------------------------------------


FORKS: list[tuple[ForkScope, str | None, ForkPosition]] = [
    ("branch", None, "at"),
    ("branch", "c14", "before"),
    ("branch", "a", "before"),
    ("tree", None, "at"),
]


def test_pg_fork_streams_in_chunks_and_equals_the_plan(
    flavour: Flavour, files: SessionRepository, pg_dsn: str, schema: str
) -> None:
    """A fork inside PostgreSQL goes through the chunked writer (chunks of 3)
    and writes what `plan_fork` plans; with a one-connection pool it takes
    the one-transaction path, with the same result."""
    repo = flavour.repo(renew_interval=None, import_chunk_entries=3)
    with repo.import_file(source_file(files), id="pg"):
        pass
    snapshot = repo.snapshot("pg")
    with flavour.store(min_size=1, max_size=1) as single:
        one = flavour.repo(single, renew_interval=None)
        for n, (scope, entry_id, position) in enumerate(FORKS):
            plan = plan_fork(snapshot, "pg", scope, entry_id, position)
            with repo.fork("pg", scope, entry_id, position, id=f"f{n}") as fork:
                assert fork.stats().entry_count == len(plan.entries)
            with one.fork("pg", scope, entry_id, position, id=f"g{n}"):
                pass
            for copy in (f"f{n}", f"g{n}"):
                got = repo.snapshot(copy)
                assert got.entries == plan.entries
                assert by_key(got.registers) == by_key(plan.registers)
                assert repo.info(copy).parent_session_id == "pg"
            assert index_rows(pg_dsn, schema, f"f{n}") == index_rows(pg_dsn, schema, f"g{n}")
    with pytest.raises(SessionExistsError):
        repo.fork("pg", id="f0")
    with pytest.raises(UnknownEntryError):
        repo.fork("pg", "branch", "nope", id="never")
    assert leftover_rows(pg_dsn, schema, "never")["sessions"] == 0


async def test_async_pg_fork_streams_in_chunks(
    apg_store: AsyncPostgresStore, files: SessionRepository, pg_dsn: str, schema: str
) -> None:
    repo = AsyncPostgresSessionRepository(apg_store, renew_interval=None, import_chunk_entries=4)
    await (await repo.import_file(source_file(files), id="pg")).close()
    snapshot = await repo.snapshot("pg")
    for n, (scope, entry_id, position) in enumerate(FORKS):
        plan = plan_fork(snapshot, "pg", scope, entry_id, position)
        fork = await repo.fork("pg", scope, entry_id, position, id=f"f{n}")
        await fork.close()
        got = await repo.snapshot(f"f{n}")
        assert got.entries == plan.entries
        assert by_key(got.registers) == by_key(plan.registers)
    with pytest.raises(UnknownEntryError):
        await repo.fork("pg", "branch", "nope", id="never")
    with pytest.raises(SessionNotFoundError):
        await repo.fork("missing", id="never")
    assert leftover_rows(pg_dsn, schema, "never")["sessions"] == 0


def test_an_import_taken_over_by_a_cleanup_stops_and_shows_nothing(
    pg_store: PostgresStore,
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    """A cleanup with a too-short stale limit removes a live import: the
    importer's next transaction finds its token gone and says so."""
    path = source_file(files)
    # Blocking on either flavour: it runs inside the importer's on_progress.
    eager = PostgresSessionRepository(pg_store, renew_interval=None, import_stale_after=0)
    removed: list[list[str]] = []

    def cleanup(written: int) -> None:
        if not removed:
            removed.append(eager.cleanup_imports())

    with pytest.raises(SessionError, match="was removed while it ran"):
        pg_repo.import_file(path, id="imp", chunk_entries=5, on_progress=cleanup)
    assert removed == [["imp"]]
    assert set(leftover_rows(pg_dsn, schema, "imp").values()) == {0}
    assert not pg_repo.exists("imp")
