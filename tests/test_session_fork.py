"""Fork rules and lane validation on real session files."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pglease.sessions import (
    InvalidSessionWriteError,
    LaneValidationError,
    SessionExistsError,
    SessionNotFoundError,
    SessionRepository,
    SetRegister,
    UnknownEntryError,
    plan_fork,
)

IDLE = '{"currentOperationId":null,"pendingNextRun":[]}'
EMPTY_USAGE = (
    '{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"totalTokens":0,'
    '"cost":{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"total":0}}'
)
CONFIG_MAIN = {
    "model": {"provider": "p", "modelId": "m"},
    "thinkingLevel": "low",
    "activeToolNames": ["read"],
}
CONFIG_SIDE = {
    "model": {"provider": "p", "modelId": "s"},
    "thinkingLevel": "off",
    "activeToolNames": [],
}


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        self.now += 1
        return self.now


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[SessionRepository]:
    with SessionRepository(tmp_path, renew_interval=None, now_ms=Clock()) as repository:
        yield repository


def raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def build_source(repo: SessionRepository) -> None:
    """r(3) - a(4) - k(5, compaction) - b(6); a - c(7, custom). main leaf b, side leaf c."""
    with repo.create("src") as s:
        s.append_message(None, msg("r"), id="r")
        s.append_message("r", msg("a"), id="a")
        s.append_entry(
            "compaction",
            "a",
            {"summary": "sum", "retainedTail": ["a"], "tokensBefore": 9, "fromHook": False},
            id="k",
        )
        s.append_message("k", msg("b"), id="b", terminate=True)
        s.append_entry("custom", "a", {"data": {"x": 1}}, custom_type="ext", id="c")
        s.add_usage({"input": 5, "output": 5, "totalTokens": 10}, entry_id="b")
        s.commit(
            [
                SetRegister("lane.config", "main", CONFIG_MAIN),
                SetRegister("lane.leaf", "main", "b"),
                SetRegister(
                    "lane.state", "main", {"currentOperationId": "op1", "pendingNextRun": ["q"]}
                ),
                SetRegister("lane.lastResult", "main", {"ok": True}),
                SetRegister("lane.config", "side", CONFIG_SIDE),
                SetRegister("lane.leaf", "side", "c"),
                SetRegister(
                    "lane.state", "side", {"currentOperationId": None, "pendingNextRun": []}
                ),
                SetRegister("lane.lastResult", "side", {"ok": False}),
                SetRegister("op.meta", "op1", {"kind": "run"}),
                SetRegister("op.state", "op1", {"step": 2}),
                SetRegister("op.tool_args", "op1:s1:0", {"path": "/"}),
                SetRegister("op.preparation", "op1:t1", {"p": 1}),
                SetRegister("pending.entry", "e-reserved", {"message": msg("queued")}),
                SetRegister("fact.name", "", "My session"),
                SetRegister("fact.custom", "k1", [1, 2]),
                SetRegister("fact.custom", "k0", {"z": None}),
                SetRegister("fact.label", "c", "label c"),
                SetRegister("fact.label", "a", "label a"),
                SetRegister("fact.label", "gone", "label of a missing entry"),
            ]
        )


def registers(path: Path) -> list[tuple[str, str, int, str]]:
    conn = raw(path)
    rows = conn.execute("SELECT namespace, key, seq, value FROM registers ORDER BY seq").fetchall()
    conn.close()
    return rows


def entry_rows(path: Path) -> dict[str, tuple[Any, ...]]:
    conn = raw(path)
    rows = conn.execute("SELECT * FROM entries").fetchall()
    conn.close()
    return {r[0]: r for r in rows}


def session_row(path: Path) -> tuple[Any, ...]:
    conn = raw(path)
    (row,) = conn.execute("SELECT * FROM session").fetchall()
    conn.close()
    return row  # type: ignore[no-any-return]


def files(repo: SessionRepository) -> list[str]:
    return sorted(p.name for p in repo.directory.iterdir())


def quote(value: str) -> str:
    return f'"{value}"'


def test_branch_fork_of_main_leaf(repo: SessionRepository) -> None:
    build_source(repo)
    source_entries = entry_rows(repo.path_for("src"))
    with repo.fork("src", id="f") as fork:
        assert fork.fence == 1
        path = fork.path
        assert [e.id for e in fork.scan_branch("b")] == ["b", "k", "a", "r"]
    copied = entry_rows(path)
    assert copied == {k: source_entries[k] for k in ("r", "a", "k", "b")}  # byte-identical rows
    assert registers(path) == [
        (
            "lane.config",
            "main",
            7,
            '{"model":{"provider":"p","modelId":"m"},'
            '"thinkingLevel":"low","activeToolNames":["read"]}',
        ),
        ("lane.leaf", "main", 8, quote("b")),
        ("lane.state", "main", 9, IDLE),
        # facts in the source's seq order (k1 was set before k0)
        ("fact.name", "", 10, quote("My session")),
        ("fact.custom", "k1", 11, "[1,2]"),
        ("fact.custom", "k0", 12, '{"z":null}'),
        ("fact.label", "a", 13, quote("label a")),
    ]
    _created_at, parent, version, metadata, count, usage, next_seq = session_row(path)
    assert (parent, version, metadata, count, usage, next_seq) == (
        "src",
        1,
        None,
        3,
        EMPTY_USAGE,
        14,
    )
    conn = raw(path)
    assert conn.execute("SELECT count(*) FROM usage_ledger").fetchone()[0] == 0
    conn.close()


def test_branch_fork_at_entry_and_before(repo: SessionRepository) -> None:
    build_source(repo)
    with repo.fork("src", entry_id="c", id="at-c") as fork:
        assert [e.id for e in fork.scan_entries()] == ["r", "a", "c"]
        leaf = fork.get_register("lane.leaf", "main")
        assert leaf is not None and (leaf.value, leaf.seq) == ("c", 9)
        assert [r.key for r in fork.list_registers("fact.label")] == ["a", "c"]
        assert fork.stats().message_count == 2
        assert fork.stats().next_seq == 16
        assert fork.get_register("lane.leaf", "side") is None  # branch scope: main only
        # the fork is writable and continues its own seq counter
        entry = fork.append_message("c", msg("more"))
        assert entry.seq == 16
    with repo.fork("src", entry_id="b", position="before", id="before-b") as fork:
        assert [e.id for e in fork.scan_entries()] == ["r", "a", "k"]
        leaf = fork.get_register("lane.leaf", "main")
        assert leaf is not None and (leaf.value, leaf.seq) == ("k", 7)
    with repo.fork("src", position="before", id="before-leaf") as fork:  # main leaf is b
        assert [e.id for e in fork.scan_entries()] == ["r", "a", "k"]
    with repo.fork("src", entry_id="r", position="before", id="before-root") as fork:
        assert fork.scan_entries() == []
        regs = registers(fork.path)
        assert [(ns, key, seq) for ns, key, seq, _ in regs] == [
            ("lane.config", "main", 1),
            ("lane.leaf", "main", 2),
            ("lane.state", "main", 3),
            ("fact.name", "", 4),
            ("fact.custom", "k1", 5),
            ("fact.custom", "k0", 6),
        ]
        assert regs[1][3] == "null"
        stats = fork.stats()
        assert (stats.next_seq, stats.message_count) == (7, 0)


def test_tree_fork_copies_every_entry_and_lane(repo: SessionRepository) -> None:
    build_source(repo)
    source_entries = entry_rows(repo.path_for("src"))
    with repo.fork("src", scope="tree", id="t") as fork:
        assert [e.id for e in fork.scan_branch("c")] == ["c", "a", "r"]
        assert [e.id for e in fork.scan_branch("b", newest_first=False)] == ["r", "a", "k", "b"]
        path = fork.path
    assert entry_rows(path) == source_entries
    assert [(ns, key, seq) for ns, key, seq, _ in registers(path)] == [
        ("lane.config", "main", 8),
        ("lane.leaf", "main", 9),
        ("lane.state", "main", 10),
        ("lane.config", "side", 11),
        ("lane.leaf", "side", 12),
        ("lane.state", "side", 13),
        # facts in the source's seq order (k1 was set before k0, label c before a)
        ("fact.name", "", 14),
        ("fact.custom", "k1", 15),
        ("fact.custom", "k0", 16),
        ("fact.label", "c", 17),
        ("fact.label", "a", 18),
    ]
    values = {(ns, key): value for ns, key, _, value in registers(path)}
    assert values[("lane.leaf", "side")] == quote("c")
    assert values[("lane.state", "main")] == IDLE  # reset to idle
    row = session_row(path)
    assert (row[1], row[4], row[5], row[6]) == ("src", 3, EMPTY_USAGE, 19)


def test_fork_does_not_touch_the_source(repo: SessionRepository, tmp_path: Path) -> None:
    build_source(repo)
    holder = repo.open("src")  # a live writer on the source
    conn = raw(repo.path_for("src"))
    lease_before = conn.execute("SELECT * FROM writer_lease").fetchall()
    regs_before = registers(repo.path_for("src"))
    with repo.fork("src", scope="tree", id="copy"):
        pass
    assert conn.execute("SELECT * FROM writer_lease").fetchall() == lease_before
    assert registers(repo.path_for("src")) == regs_before
    conn.close()
    holder.append_message("b", msg("source keeps working"))
    holder.close()


def test_fork_argument_errors_leave_no_file(repo: SessionRepository) -> None:
    build_source(repo)
    before = files(repo)
    with pytest.raises(UnknownEntryError, match="fork entry 'nope'"):
        repo.fork("src", entry_id="nope", id="x")
    with pytest.raises(InvalidSessionWriteError, match="branch scope only"):
        repo.fork("src", scope="tree", entry_id="a", id="x")
    with pytest.raises(InvalidSessionWriteError, match="scope"):
        repo.fork("src", scope="forest", id="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidSessionWriteError, match="position"):
        repo.fork("src", position="after", id="x")  # type: ignore[arg-type]
    with pytest.raises(SessionNotFoundError):
        repo.fork("absent", id="x")
    with pytest.raises(SessionExistsError):
        repo.fork("src", id="src")
    assert files(repo) == before
    with repo.create("empty"):
        pass
    with repo.fork("empty", position="before", id="x") as fork:  # an empty session, as "at"
        assert fork.scan_entries() == [] and fork.stats().next_seq == 3
    with repo.fork("empty", id="empty-copy") as fork:
        assert fork.stats().next_seq == 3  # lane.leaf seq 1, lane.state seq 2


def test_fork_missing_parent(repo: SessionRepository) -> None:
    build_source(repo)
    conn = raw(repo.path_for("src"))
    conn.execute(
        "INSERT INTO entries VALUES ('orphan', 'ghost', 90, 'message', NULL, 1, '{\"message\":1}')"
    )
    conn.close()
    before = files(repo)
    with pytest.raises(UnknownEntryError, match="missing parent 'ghost'"):
        repo.fork("src", entry_id="orphan", id="x")
    with pytest.raises(UnknownEntryError, match="missing parent 'ghost'"):
        repo.fork("src", scope="tree", id="x")
    assert files(repo) == before


def test_fork_failing_while_writing_leaves_no_file(repo: SessionRepository) -> None:
    build_source(repo)
    conn = raw(repo.path_for("src"))
    # a corrupt source: a child with the same seq as its parent fails in the branch index,
    # i.e. after the new file was started
    conn.execute("INSERT INTO entries VALUES ('p1', NULL, 50, 'message', NULL, 1, '{}')")
    conn.execute("INSERT INTO entries VALUES ('p2', 'p1', 50, 'message', NULL, 1, '{}')")
    conn.close()
    before = files(repo)
    with pytest.raises(InvalidSessionWriteError, match="must come after its parent"):
        repo.fork("src", scope="tree", id="x")
    assert files(repo) == before
    assert [s.id for s in repo.list().sessions] == ["src"]


LANE_CASES: list[tuple[list[str], str]] = [
    (
        ["DELETE FROM registers WHERE namespace = 'lane.leaf' AND key = 'main'"],
        "lane 'main' is missing its lane.leaf",
    ),
    (
        ["INSERT INTO registers VALUES ('lane.config', 'x', 1, '{}')"],
        "lane 'x' has lane.config but is missing its lane.leaf",
    ),
    (
        ["INSERT INTO registers VALUES ('lane.lastResult', 'x', 1, '{}')"],
        "lane 'x' has lane.lastResult but is missing its lane.leaf",
    ),
    (
        ["INSERT INTO registers VALUES ('lane.state', 'x', 1, '{}')"],
        "lane 'x' has lane.state but is missing its lane.leaf",
    ),
    (
        [
            "INSERT INTO registers VALUES ('lane.leaf', 'x', 1, 'null')",
            "INSERT INTO registers VALUES ('lane.config', 'x', 1, '{}')",
        ],
        "lane 'x' is missing its lane.state",
    ),
    (
        ["DELETE FROM registers WHERE namespace = 'lane.state' AND key = 'main'"],
        "lane 'main' is missing its lane.state",
    ),
    (
        ["DELETE FROM registers WHERE namespace = 'lane.config' AND key = 'side'"],
        "lane 'side' is missing its lane.config",
    ),
    (
        [
            "UPDATE registers SET value = '\"nowhere\"'"
            " WHERE namespace = 'lane.leaf' AND key = 'side'"
        ],
        "lane 'side': lane.leaf points at entry 'nowhere', which does not exist",
    ),
    (
        ["UPDATE registers SET value = '42' WHERE namespace = 'lane.leaf' AND key = 'main'"],
        "lane 'main': lane.leaf must be an entry id or null",
    ),
]


@pytest.mark.parametrize(("statements", "message"), LANE_CASES)
def test_lane_validation(repo: SessionRepository, statements: list[str], message: str) -> None:
    build_source(repo)
    conn = raw(repo.path_for("src"))
    for statement in statements:
        conn.execute(statement)
    conn.close()
    before = files(repo)
    for scope in ("branch", "tree"):
        with pytest.raises(LaneValidationError, match=message.replace("(", r"\(")):
            repo.fork("src", scope=scope, entry_id="a" if scope == "branch" else None, id="x")
    assert files(repo) == before


def test_main_lane_without_config_is_fine(repo: SessionRepository) -> None:
    with repo.create("plain") as s:
        s.append_message(None, msg("hi"), id="h")
        s.set_register("lane.leaf", "main", "h")
        snap = s.snapshot()
    plan = plan_fork(snap, "plain")
    assert [(r.namespace, r.seq) for r in plan.registers] == [("lane.leaf", 4), ("lane.state", 5)]
    assert plan.next_seq == 6 and plan.parent_session_id == "plain"
