"""Forking across stores: PostgreSQL session -> session file, file -> PostgreSQL, round trips."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pglease import PostgresStore
from pglease.sessions import (
    AppendEntry,
    BranchQuery,
    InvalidSessionWriteError,
    LaneValidationError,
    PostgresSessionRepository,
    SessionCorruptError,
    SessionExistsError,
    SessionHandle,
    SessionNotFoundError,
    SessionRepository,
    SessionSnapshot,
    SessionVersionError,
    SetRegister,
    UnknownEntryError,
    plan_fork,
)

from .conformance.test_sessions import QUERIES, Clock, build_tree, msg
from .test_session_branch_index import reference
from .test_session_files import SPEC_DDL, normalise

IDLE_JSON = '{"currentOperationId":null,"pendingNextRun":[]}'
CONFIG = {"model": {"provider": "p", "modelId": "m"}, "thinkingLevel": "low", "activeToolNames": []}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pg_repo(pg_store: PostgresStore, clock: Clock) -> Iterator[PostgresSessionRepository]:
    with PostgresSessionRepository(pg_store, renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture
def files(tmp_path: Path, clock: Clock) -> Iterator[SessionRepository]:
    directory = tmp_path / "files"
    directory.mkdir()
    with SessionRepository(directory, renew_interval=None, now_ms=clock) as repo:
        yield repo


def populate(session: SessionHandle) -> None:
    """Entries, two lanes, facts, and everything a fork must not copy."""
    build_tree(session)
    session.append_message(
        "k", {"text": "é ☃ \u2028", "n": 1.5e300, "k": [True, None], "z": 0.1}, id="u1"
    )
    session.commit(
        [
            SetRegister("lane.leaf", "main", "u1"),
            SetRegister("lane.config", "main", CONFIG),
            SetRegister("lane.state", "main", {"currentOperationId": "op1", "pendingNextRun": []}),
            SetRegister("lane.lastResult", "main", {"ok": True}),
            SetRegister("lane.leaf", "side", "f"),
            SetRegister("lane.config", "side", CONFIG),
            SetRegister("lane.state", "side", {"currentOperationId": None, "pendingNextRun": []}),
            SetRegister("fact.name", "", "The session"),
            SetRegister("fact.custom", "color", {"v": "blue"}),
            SetRegister("fact.label", "b", "on b"),
            SetRegister("fact.label", "f", "on f"),
            SetRegister("op.meta", "op1", {"x": 1}),
            SetRegister("pending.entry", "reserved", {"y": 2}),
        ]
    )
    session.add_usage({"input": 10, "totalTokens": 10})


def check_file_format(path: Path) -> None:
    """What the file-format tests check on files the SQLite layer writes."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        stored = sorted(
            normalise(sql)
            for (sql,) in conn.execute("SELECT sql FROM sqlite_schema WHERE sql IS NOT NULL")
        )
        assert stored == sorted(normalise(s) for s in SPEC_DDL.split(";") if s.strip())
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        (row,) = conn.execute("SELECT storage_version, metadata FROM session").fetchall()
        assert row == (1, None)
        assert conn.execute("SELECT count(*) FROM writer_lease").fetchone()[0] == 0
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    assert not Path(str(path) + "-wal").exists() or Path(str(path) + "-wal").stat().st_size == 0


def file_rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return {
            table: sorted(conn.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
            for table in ("entries", "registers", "usage_ledger", "branch_entries", "branch_meta")
        } | {
            "session": conn.execute(
                "SELECT parent_session_id, message_count, usage_payload, next_seq FROM session"
            ).fetchall()
        }
    finally:
        conn.close()


def regs(snapshot: SessionSnapshot) -> dict[tuple[str, str], str]:
    return {(r.namespace, r.key): r.value_json for r in snapshot.registers}


@pytest.mark.parametrize(
    ("scope", "entry_id", "position"),
    [
        ("branch", None, "at"),
        ("branch", "i", "at"),
        ("branch", "i", "before"),
        ("branch", "a", "before"),
        ("tree", None, "at"),
    ],
)
def test_pg_to_file_equals_the_same_fork_of_a_file(
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    scope: Any,
    entry_id: str | None,
    position: Any,
) -> None:
    """The same source built on both backends, forked into a file each way:
    the files hold identical rows (entries, registers, branch index, session)."""
    with pg_repo.create("src") as pg_src, files.create("src") as file_src:
        populate(pg_src)
        populate(file_src)
        assert pg_src.snapshot() == file_src.snapshot()
    from_pg = pg_repo.fork_to_file("src", files.directory, scope, entry_id, position, id="from-pg")
    files.fork("src", scope, entry_id, position, id="from-file").close()
    assert from_pg == files.path_for("from-pg")
    check_file_format(from_pg)
    assert file_rows(from_pg) == file_rows(files.path_for("from-file"))
    # the file is a working session: open it, scan it, write to it
    with files.open("from-pg") as session:
        entries = {e.id: e for e in session.scan_entries()}
        for leaf in entries:
            for query in QUERIES:
                got = session.scan_branch(
                    leaf,
                    newest_first=query.newest_first,
                    stop_type=query.stop_type,
                    stop_id=query.stop_id,
                    types=query.types,
                    custom_type=query.custom_type,
                    cursor=query.cursor,
                    limit=query.limit,
                )
                assert [e.id for e in got] == reference(entries, leaf, query)
        session.append_message(None, msg("local work"))


def test_round_trip_keeps_entries_lanes_and_facts(
    pg_repo: PostgresSessionRepository, files: SessionRepository
) -> None:
    with pg_repo.create("orig") as source:
        populate(source)
    original = pg_repo.snapshot("orig")
    path = pg_repo.export_to_file("orig", files.directory, id="local")
    check_file_format(path)
    with pg_repo.import_file(path, id="back") as back:
        imported = back.snapshot()
        stats = back.stats()
        assert back.usage_rows() == []
        leaf = back.get_register("lane.leaf", "main")
        assert leaf is not None
        assert [e.id for e in back.scan_branch(leaf.value)][:3] == ["u1", "k", "i"]
        back.append_message(leaf.value, msg("continued on PG"))
    # entries: ids, parents, seqs, types, custom types, timestamps, payload bytes
    assert imported.entries == original.entries
    assert imported.parent_session_id == "local"
    assert files.snapshot("local").parent_session_id == "orig"
    assert stats.message_count == sum(1 for e in original.entries if e.type == "message")
    assert stats.usage["input"] == 0  # the ledger is never copied
    before, after = regs(original), regs(imported)
    # lanes: leaves and configs kept, states reset to idle, lastResult dropped
    for lane in ("main", "side"):
        assert after[("lane.leaf", lane)] == before[("lane.leaf", lane)]
        assert after[("lane.config", lane)] == before[("lane.config", lane)]
        assert after[("lane.state", lane)] == IDLE_JSON
    # facts kept (labels of copied entries); op.*, pending.entry, lastResult dropped
    assert {k: v for k, v in after.items() if k[0].startswith("fact.")} == {
        k: v for k, v in before.items() if k[0].startswith("fact.")
    }
    assert not [k for k in after if k[0].startswith(("op.", "pending.", "lane.lastResult"))]
    # seqs: fresh register seqs after the last entry, in plan order
    plan = plan_fork(files.snapshot("local"), "local", "tree")
    assert imported.registers == tuple(sorted(plan.registers, key=lambda r: (r.namespace, r.key)))
    assert stats.next_seq == plan.next_seq


def test_branch_fork_round_trip_keeps_the_path(
    pg_repo: PostgresSessionRepository, files: SessionRepository
) -> None:
    with pg_repo.create("orig") as source:
        populate(source)
    path = pg_repo.fork_to_file("orig", files.directory, "branch", "h", "at", id="h-branch")
    with pg_repo.import_file(path) as back:
        entries = back.scan_entries()
        assert [e.id for e in entries] == ["a", "b", "c", "d", "g", "h"]
        assert back.list_registers("fact.label") == [
            r for r in back.list_registers("fact.label") if r.key == "b"
        ]
        assert [r.key for r in back.list_registers("lane.leaf")] == ["main"]
        original = {e.id: e for e in pg_repo.snapshot("orig").entries}
        assert all(e == original[e.id] for e in entries)
        query = BranchQuery()
        got = back.scan_branch("h")
        assert [e.id for e in got] == reference({e.id: e for e in entries}, "h", query)


def test_fork_to_file_errors_leave_no_file(
    pg_repo: PostgresSessionRepository, files: SessionRepository, tmp_path: Path
) -> None:
    with pg_repo.create("src") as source:
        populate(source)
    before = sorted(p.name for p in files.directory.iterdir())
    with pytest.raises(SessionNotFoundError):
        pg_repo.fork_to_file("missing", files.directory)
    with pytest.raises(UnknownEntryError):
        pg_repo.fork_to_file("src", files.directory, entry_id="nope")
    with pytest.raises(InvalidSessionWriteError):
        pg_repo.fork_to_file("src", files.directory, scope="everything")  # type: ignore[arg-type]
    with pytest.raises(InvalidSessionWriteError):
        pg_repo.fork_to_file("src", files.directory, "tree", entry_id="a")
    with pytest.raises(ValueError, match="session id"):
        pg_repo.fork_to_file("src", files.directory, id="../escape")
    pg_repo.fork_to_file("src", files.directory, id="taken")
    with pytest.raises(SessionExistsError):
        pg_repo.fork_to_file("src", files.directory, id="taken")
    assert sorted(p.name for p in files.directory.iterdir()) == sorted([*before, "taken.sqlite"])
    with pytest.raises(SessionNotFoundError):
        pg_repo.fork_to_file("missing", tmp_path / "no-such-dir")
    assert not (tmp_path / "no-such-dir").exists()  # a refused fork creates no directory
    made = pg_repo.fork_to_file("src", tmp_path / "no-such-dir" / "deeper", id="made")
    assert made == tmp_path / "no-such-dir" / "deeper" / "made.sqlite" and made.is_file()


def test_import_errors_create_nothing(
    pg_repo: PostgresSessionRepository,
    pg_store: PostgresStore,
    files: SessionRepository,
    tmp_path: Path,
) -> None:
    with files.create("good") as good:
        good.append_message(None, msg("x"))
    with pytest.raises(InvalidSessionWriteError, match=r"\.sqlite"):
        pg_repo.import_file(tmp_path / "good.db")
    with pytest.raises(SessionNotFoundError):
        pg_repo.import_file(files.directory / "absent.sqlite")
    garbage = files.directory / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all" * 100)
    with pytest.raises(SessionCorruptError):
        pg_repo.import_file(garbage)
    # a lane without its state register
    with files.create("bad-lane") as bad:
        bad.set_register("lane.leaf", "side", None)
    with pytest.raises(LaneValidationError, match="lane 'side'"):
        pg_repo.import_file(files.path_for("bad-lane"))
    newer = files.path_for("newer")
    files.create("newer").close()
    conn = sqlite3.connect(newer, isolation_level=None)
    conn.execute("UPDATE session SET storage_version = 2")
    conn.close()
    with pytest.raises(SessionVersionError, match="newer than 1"):
        pg_repo.import_file(newer)
    assert pg_repo.list().ids() == []
    # an id already used in PostgreSQL: refused, and the lease taken for it is released
    pg_repo.create("dup").close()
    with pytest.raises(SessionExistsError):
        pg_repo.import_file(files.path_for("good"), id="dup")
    with pg_repo.open("dup") as dup:
        assert dup.stats().entry_count == 0
    # an import keeps working when the file's session is open elsewhere
    with files.open("good"), pg_repo.import_file(files.path_for("good")) as imported:
        assert imported.stats().parent_session_id == "good"
    assert not pg_store.get(pg_store.ensure_resource("session", "dup")).lease.held


def test_plan_with_a_missing_parent_is_refused(pg_repo: PostgresSessionRepository) -> None:
    with pg_repo.create("src") as source:
        source.commit(
            [
                AppendEntry("message", None, {"message": 1}, id="r"),
                AppendEntry("message", "r", {"message": 2}, id="c"),
            ]
        )
    plan = plan_fork(pg_repo.snapshot("src"), "src", "tree")
    broken = type(plan)(plan.entries[1:], plan.registers, 1, plan.next_seq, "src")
    with pytest.raises(UnknownEntryError, match="missing parent"):
        pg_repo.create_from_plan(broken, id="broken")
    assert pg_repo.list().ids() == ["src"]
