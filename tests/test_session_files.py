"""The per-session SQLite file layer, on real files in tmp_path."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pglease.errors import PgleaseError, ValidationError
from pglease.sessions import (
    AddUsage,
    AppendEntry,
    DeleteRegister,
    DuplicateIdError,
    Entry,
    InvalidSessionIdError,
    InvalidSessionWriteError,
    LaneValidationError,
    SessionAlreadyClaimedError,
    SessionBusyError,
    SessionClosedError,
    SessionCorruptError,
    SessionError,
    SessionExistsError,
    SessionNotFoundError,
    SessionRepository,
    SessionVersionError,
    SetRegister,
    UnknownEntryError,
    WriterLeaseLostError,
    sum_usage,
    uuid7,
)
from pglease.sessions.schema import SCHEMA_SQL

# The DDL of SESSION_FORMAT.md, typed out independently of pglease/sessions/schema.py.
SPEC_DDL = """
CREATE TABLE IF NOT EXISTS entries (
  id TEXT PRIMARY KEY, parent_id TEXT, seq INTEGER NOT NULL, type TEXT NOT NULL,
  custom_type TEXT, timestamp INTEGER NOT NULL, payload TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ix_entry_parent ON entries(parent_id);
CREATE INDEX IF NOT EXISTS ix_entry_seq ON entries(seq, type);
CREATE TABLE IF NOT EXISTS registers (
  namespace TEXT, key TEXT, seq INTEGER NOT NULL, value TEXT NOT NULL,
  PRIMARY KEY (namespace, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS usage_ledger (
  id TEXT PRIMARY KEY, seq INTEGER NOT NULL, entry_id TEXT,
  adjustment INTEGER NOT NULL, usage TEXT NOT NULL, details TEXT
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ix_usage_seq ON usage_ledger(seq);
CREATE TABLE IF NOT EXISTS branch_entries (
  branch_id TEXT, entry_id TEXT, entry_seq INTEGER NOT NULL, entry_type TEXT NOT NULL,
  PRIMARY KEY (branch_id, entry_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ix_be_seq ON branch_entries(branch_id, entry_seq, entry_id, entry_type);
CREATE INDEX IF NOT EXISTS ix_be_type ON branch_entries(branch_id, entry_type, entry_seq, entry_id);
CREATE INDEX IF NOT EXISTS ix_be_entry ON branch_entries(entry_id);
CREATE TABLE IF NOT EXISTS branch_meta (
  branch_id TEXT PRIMARY KEY, tip_entry_id TEXT NOT NULL, tip_seq INTEGER NOT NULL,
  base_branch_id TEXT, base_seq INTEGER
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS ix_bm_tip ON branch_meta(tip_entry_id);
CREATE TABLE IF NOT EXISTS session (
  created_at INTEGER NOT NULL, parent_session_id TEXT, storage_version INTEGER NOT NULL,
  metadata TEXT, message_count INTEGER NOT NULL, usage_payload TEXT NOT NULL,
  next_seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS writer_lease (
  owner_id TEXT NOT NULL, fence INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL
);
"""

EMPTY_USAGE = (
    '{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"totalTokens":0,'
    '"cost":{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"total":0}}'
)
IDLE: dict[str, Any] = {"currentOperationId": None, "pendingNextRun": []}


class Clock:
    """A settable millisecond clock."""

    def __init__(self, start: int = 1_700_000_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def repo(tmp_path: Path, clock: Clock) -> Iterator[SessionRepository]:
    with SessionRepository(tmp_path, renew_interval=None, now_ms=clock) as repository:
        yield repository


def raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def compaction_payload() -> dict[str, Any]:
    return {"summary": "s", "retainedTail": [], "tokensBefore": 10, "fromHook": False}


def normalise(sql: str) -> str:
    sql = re.sub(r"\s+", " ", sql).strip().rstrip(";").strip()
    sql = re.sub(r"\bIF NOT EXISTS ", "", sql)
    return re.sub(r"\s*([(),])\s*", r"\1", sql)


# --- schema and new sessions --------------------------------------------------------------


def test_schema_matches_spec(repo: SessionRepository) -> None:
    with repo.create("s1"):
        pass
    conn = raw(repo.path_for("s1"))
    stored = sorted(
        normalise(sql)
        for (sql,) in conn.execute("SELECT sql FROM sqlite_schema WHERE sql IS NOT NULL")
    )
    spec = sorted(normalise(s) for s in SPEC_DDL.split(";") if s.strip())
    assert stored == spec
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for table in ("entries", "registers", "usage_ledger", "session", "writer_lease"):
        assert conn.execute(f"PRAGMA foreign_key_list({table})").fetchall() == []
    conn.close()


def test_schema_module_is_the_spec_text() -> None:
    spec_file = Path(__file__).resolve().parent.parent / "pglease" / "sessions" / "FORMAT.md"
    block = re.search(r"```sql\n(.*?)```", spec_file.read_text(), re.S)
    assert block is not None
    assert block.group(1) == SCHEMA_SQL


def test_new_session_layout(repo: SessionRepository, clock: Clock) -> None:
    with repo.create("new", parent_session_id="origin") as session:
        stats = session.stats()
        assert stats.next_seq == 3
        assert stats.message_count == 0
        assert stats.parent_session_id == "origin"
        assert stats.created_at == clock.now
        leaf = session.get_register("lane.leaf", "main")
        state = session.get_register("lane.state", "main")
        assert leaf is not None and (leaf.seq, leaf.value_json) == (1, "null")
        assert state is not None and state.seq == 2 and state.value == IDLE
        assert session.get_register("lane.config", "main") is None
        conn = raw(session.path)
        row = conn.execute("SELECT * FROM session").fetchall()
        assert row == [(clock.now, "origin", 1, None, 0, EMPTY_USAGE, 3)]
        lease = conn.execute("SELECT owner_id, fence, expires_at_ms FROM writer_lease").fetchall()
        assert lease == [(session.owner_id, 1, clock.now + 30_000)]
        conn.close()
    conn = raw(repo.path_for("new"))
    # Released: no holder, long expired, the fence kept for the next claim.
    assert conn.execute("SELECT * FROM writer_lease").fetchall() == [("", 1, 0)]
    conn.close()


def test_default_ids_are_uuid7(repo: SessionRepository) -> None:
    with repo.create() as session:
        assert re.fullmatch(
            r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", session.id
        )
        entry = session.append_message(None, msg("hi"))
        assert re.fullmatch(r"[0-9a-f-]{36}", entry.id) and entry.id[14] == "7"
    ids = [uuid7() for _ in range(1000)]
    assert ids == sorted(ids) and len(set(ids)) == 1000


# Ids are file names: only what no file name can be is refused (any other name,
# "a b", ".hidden", "é", is accepted: see test_session_seed_parity.py).
@pytest.mark.parametrize(
    "bad", ["", ".", "..", "../x", "a/b", "a\x00b", "x" * 245, "é" * 123, "\udcff"]
)
def test_invalid_session_ids(repo: SessionRepository, bad: str) -> None:
    with pytest.raises(InvalidSessionIdError, match="session id"):
        repo.create(bad)
    with pytest.raises(InvalidSessionIdError):
        repo.open(bad)
    assert issubclass(InvalidSessionIdError, ValidationError)


def test_create_existing_fails_and_keeps_file(repo: SessionRepository) -> None:
    with repo.create("dup") as session:
        session.append_message(None, msg("keep me"))
    before = repo.path_for("dup").read_bytes()
    with pytest.raises(SessionExistsError, match="already exists"):
        repo.create("dup")
    assert repo.path_for("dup").read_bytes() == before
    assert sorted(p.name for p in repo.directory.iterdir()) == ["dup.sqlite"]


def test_error_hierarchy() -> None:
    for error in (
        SessionVersionError,
        SessionCorruptError,
        LaneValidationError,
        UnknownEntryError,
        WriterLeaseLostError,
        SessionAlreadyClaimedError,
        SessionNotFoundError,
        SessionExistsError,
        SessionClosedError,
    ):
        assert issubclass(error, SessionError)
        assert issubclass(error, PgleaseError)


# --- commits --------------------------------------------------------------------------------


def test_commit_shares_seq_counter_and_timestamp(repo: SessionRepository, clock: Clock) -> None:
    with repo.create("c") as session:
        clock.advance(5)
        result = session.commit(
            [
                AppendEntry("message", None, {"message": msg("a")}, id="e1"),
                AppendEntry("message", "e1", {"message": msg("b"), "terminate": True}, id="e2"),
                SetRegister("lane.leaf", "main", "e2"),
                AddUsage({"input": 1, "output": 2, "totalTokens": 3}, entry_id="e2", id="u1"),
                DeleteRegister("lane.state", "main"),
            ]
        )
        assert (result.first_seq, result.next_seq) == (3, 8)
        assert result.ids == ("e1", "e2", None, "u1", None)
        assert result.timestamp == clock.now
        e1, e2 = session.get_entry("e1"), session.get_entry("e2")
        assert e1 is not None and e2 is not None
        assert (e1.seq, e2.seq) == (3, 4)
        assert e1.timestamp == e2.timestamp == clock.now
        leaf = session.get_register("lane.leaf", "main")
        assert leaf is not None and (leaf.seq, leaf.value) == (5, "e2")
        assert session.get_register("lane.state", "main") is None
        (usage,) = session.usage_rows()
        assert (usage.seq, usage.entry_id, usage.adjustment) == (6, "e2", False)
        assert session.stats().next_seq == 8
        assert session.stats().message_count == 2
        # a register delete of a missing key still takes a seq
        assert session.delete_register("nothing", "here") == 8
        assert session.set_register("fact.name", "", "named") == 9
        assert session.stats().next_seq == 10


def test_payload_holds_type_specific_fields_only(repo: SessionRepository) -> None:
    with repo.create("p") as session:
        session.commit(
            [
                AppendEntry(
                    "message",
                    None,
                    {
                        "id": "x",
                        "parentId": None,
                        "seq": 99,
                        "timestamp": 1,
                        "type": "message",
                        "message": msg("a"),
                    },
                    id="m",
                ),
                AppendEntry(
                    "compaction", "m", {**compaction_payload(), "details": {"k": 1}}, id="c"
                ),
                AppendEntry(
                    "branch_summary", "c", {"fromId": "m", "summary": "t", "fromHook": True}, id="b"
                ),
                AppendEntry("custom", "b", {}, custom_type="note", id="x1"),
                AppendEntry(
                    "custom",
                    "x1",
                    {"data": [1, "é"], "customType": "ignored"},
                    custom_type="note",
                    id="x2",
                ),
            ]
        )
        conn = raw(session.path)
        rows = dict(conn.execute("SELECT id, payload FROM entries").fetchall())
        conn.close()
    assert rows == {
        "m": '{"message":{"role":"user","content":"a"}}',
        "c": '{"summary":"s","retainedTail":[],"tokensBefore":10,"fromHook":false,'
        '"details":{"k":1}}',
        "b": '{"fromId":"m","summary":"t","fromHook":true}',
        "x1": "{}",
        "x2": '{"data":[1,"é"]}',
    }


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (AppendEntry("note", None, {}), "entry type"),
        (AppendEntry("message", None, {}), "missing field"),
        (AppendEntry("message", None, {"message": {}, "extra": 1}), "unknown field"),
        (AppendEntry("compaction", None, {"summary": "s"}), "missing field"),
        (AppendEntry("branch_summary", None, {"summary": "s", "fromHook": False}), "fromId"),
        (AppendEntry("custom", None, {}), "custom_type"),
        (AppendEntry("message", None, {"message": {}}, custom_type="x"), "custom_type"),
        (AppendEntry("message", None, {"message": float("nan")}), "not JSON"),
        (AppendEntry("message", None, {"message": {}}, id=""), "entry id"),
        (AddUsage({"input": "3"}), "number"),
        (AddUsage({"input": True}), "number"),
        (AddUsage({"cost": 3}), "cost"),
        (SetRegister("", "k", 1), "namespace"),
        (SetRegister("ns", "k", {1, 2}), "not JSON"),
    ],
)
def test_invalid_writes_change_nothing(repo: SessionRepository, write: Any, match: str) -> None:
    with repo.create("v") as session:
        with pytest.raises(InvalidSessionWriteError, match=match):
            session.commit([SetRegister("fact.name", "", "first"), write])
        assert session.stats().next_seq == 3
        assert session.get_register("fact.name", "") is None


def test_parent_must_exist_and_ids_are_unique(repo: SessionRepository) -> None:
    with repo.create("u") as session:
        with pytest.raises(UnknownEntryError, match="parent entry 'ghost'"):
            session.commit(
                [
                    AppendEntry("message", None, {"message": msg("a")}, id="a"),
                    AppendEntry("message", "ghost", {"message": msg("b")}),
                ]
            )
        assert session.get_entry("a") is None  # whole commit rolled back
        assert session.stats().next_seq == 3
        session.append_message(None, msg("a"), id="a")
        with pytest.raises(DuplicateIdError, match="'a'"):
            session.append_message(None, msg("again"), id="a")
        with pytest.raises(DuplicateIdError):
            session.add_usage({"input": 1}, id="a")  # one id space for entries and usage
        with pytest.raises(InvalidSessionWriteError, match="at least one"):
            session.commit([])
        assert session.stats().entry_count == 1


def test_usage_summing(repo: SessionRepository) -> None:
    with repo.create("money") as session:
        row: dict[str, Any] = {
            "input": 10,
            "output": 5,
            "cacheRead": 2,
            "cacheWrite": 1,
            "totalTokens": 18,
            "cost": {"input": 0.25, "output": 0.5, "cacheRead": 0, "cacheWrite": 0, "total": 0.75},
        }
        session.add_usage(row, details={"model": "m"})
        conn = raw(session.path)
        assert conn.execute("SELECT usage_payload FROM session").fetchone()[0] == (
            '{"input":10,"output":5,"cacheRead":2,"cacheWrite":1,"totalTokens":18,'
            '"cost":{"input":0.25,"output":0.5,"cacheRead":0,"cacheWrite":0,"total":0.75}}'
        )
        session.add_usage(
            {**row, "reasoning": 7, "cost": {**row["cost"], "cacheWrite1h": 0.5}}, adjustment=True
        )
        session.add_usage({**row, "cacheWrite1h": 3})
        usage = session.stats().usage
        assert usage["input"] == 30 and usage["totalTokens"] == 54
        assert usage["reasoning"] == 7 and usage["cacheWrite1h"] == 3
        assert usage["cost"]["total"] == 2.25 and usage["cost"]["cacheWrite1h"] == 0.5
        ledger = conn.execute("SELECT seq, adjustment, details FROM usage_ledger ORDER BY seq")
        assert ledger.fetchall() == [(3, 0, '{"model":"m"}'), (4, 1, None), (5, 0, None)]
        conn.close()
    assert "reasoning" not in sum_usage(json.loads(EMPTY_USAGE), {"input": 1})


def test_registers_listing_by_prefix(repo: SessionRepository) -> None:
    with repo.create("r") as session:
        for key in ["op1:b:2", "op1:a:1", "op2:a:0", "op1:a:10", "op10:x"]:
            session.set_register("op.tool_args", key, {"k": key})
        session.set_register("op.meta", "op1", 1)
        keys = [r.key for r in session.list_registers("op.tool_args", "op1:")]
        assert keys == ["op1:a:1", "op1:a:10", "op1:b:2"]
        assert len(session.list_registers("op.tool_args")) == 5
        assert session.list_registers("op.tool_args", "zz") == []
        session.set_register("op.tool_args", "op1:a:1", None)
        reg = session.get_register("op.tool_args", "op1:a:1")
        assert reg is not None and reg.value_json == "null" and reg.seq == 9


def test_reads(repo: SessionRepository) -> None:
    with repo.create("reads") as session:
        a = session.append_message(None, msg("a"))
        b = session.append_entry("custom", a.id, {"data": 1}, custom_type="t")
        c = session.append_message(b.id, msg("c"))
        assert session.get_entry(b.id) == b
        assert b.payload == {"data": 1} and b.custom_type == "t"
        assert session.get_entry("missing") is None
        assert [e.id for e in session.scan_entries()] == [a.id, b.id, c.id]
        assert [e.id for e in session.scan_entries(after_seq=a.seq, limit=1)] == [b.id]
        assert [e.id for e in session.scan_entries(types=["message"])] == [a.id, c.id]
        assert [e.id for e in session.scan_branch(c.id)] == [c.id, b.id, a.id]
        with pytest.raises(UnknownEntryError):
            session.scan_branch("nope")
        snap = session.snapshot()
        assert [e.id for e in snap.entries] == [a.id, b.id, c.id]


# --- branch index structure ---------------------------------------------------------------------


def _meta(path: Path) -> dict[str, tuple[Any, ...]]:
    conn = raw(path)
    rows = conn.execute(
        "SELECT branch_id, tip_entry_id, tip_seq, base_branch_id, base_seq FROM branch_meta"
    ).fetchall()
    conn.close()
    return {r[0]: r[1:] for r in rows}


def _rows(path: Path, branch_id: str) -> list[str]:
    conn = raw(path)
    rows = conn.execute(
        "SELECT entry_id FROM branch_entries WHERE branch_id = ? ORDER BY entry_seq", (branch_id,)
    ).fetchall()
    conn.close()
    return [r[0] for r in rows]


def test_branch_index_rules(repo: SessionRepository) -> None:
    with repo.create("idx") as s:
        s.append_message(None, msg("1"), id="r")  # rule 1: root segment
        s.append_message("r", msg("2"), id="a")  # rule 2: extend tip
        s.append_entry("compaction", "a", compaction_payload(), id="k")
        s.append_message("k", msg("4"), id="b")
        s.append_message("b", msg("5"), id="c")
        meta = _meta(s.path)
        assert meta == {"r": ("c", 7, None, None)}
        # rule 3 with a compaction on the path: based at (r, seq of k)
        s.append_message("b", msg("6"), id="d")
        assert _meta(s.path)["d"] == ("d", 8, "r", 5)
        assert _rows(s.path, "d") == ["b", "d"]
        # rule 3 without compaction: copies the path from the root
        s.append_message("r", msg("7"), id="e")
        assert _meta(s.path)["e"] == ("e", 9, None, None)
        assert _rows(s.path, "e") == ["r", "e"]
        # divergence inside a derived segment: the chain follows bases
        s.append_message("d", msg("8"), id="f")  # extends d
        s.append_message("d", msg("9"), id="g")  # diverges at d, compaction in base
        assert _meta(s.path)["g"] == ("g", 11, "r", 5)
        assert _rows(s.path, "g") == ["b", "d", "g"]
        assert [e.id for e in s.scan_branch("g")] == ["g", "d", "b", "k", "a", "r"]
        assert [e.id for e in s.scan_branch("c", newest_first=False)] == ["r", "a", "k", "b", "c"]
        assert [e.id for e in s.scan_branch("e")] == ["e", "r"]


def ids(entries: list[Entry]) -> list[str]:
    return [e.id for e in entries]


def test_branch_scan_options(repo: SessionRepository) -> None:
    with repo.create("opts") as s:
        s.append_message(None, msg("1"), id="r")
        s.append_entry("custom", "r", {"data": 1}, custom_type="x", id="x1")
        s.append_entry("compaction", "x1", compaction_payload(), id="k")
        s.append_entry("custom", "k", {}, custom_type="y", id="y1")
        s.append_message("y1", msg("2"), id="m")
        s.append_entry("custom", "m", {}, custom_type="x", id="x2")
        assert ids(s.scan_branch("x2", stop_type="compaction")) == ["x2", "m", "y1", "k"]
        assert ids(s.scan_branch("x2", stop_type="compaction", newest_first=False)) == [
            "k",
            "y1",
            "m",
            "x2",
        ]
        # the stop applies before filters: the stop entry itself may be filtered out
        assert ids(s.scan_branch("x2", stop_type="compaction", types=["custom"])) == ["x2", "y1"]
        assert ids(s.scan_branch("x2", stop_id="y1", types=["message"])) == ["m"]
        assert ids(s.scan_branch("x2", custom_type="x")) == ["x2", "x1"]
        assert ids(s.scan_branch("x2", cursor=7)) == ["y1", "k", "x1", "r"]
        assert ids(s.scan_branch("x2", cursor=5, newest_first=False)) == ["y1", "m", "x2"]
        assert ids(s.scan_branch("x2", limit=2)) == ["x2", "m"]
        assert ids(s.scan_branch("x2", types=["custom"], cursor=8, limit=1)) == ["y1"]
        assert ids(s.scan_branch("x2", limit=0)) == []
        with pytest.raises(InvalidSessionWriteError):
            s.scan_branch("x2", limit=-1)


# --- lease ---------------------------------------------------------------------------------------


def test_lease_claim_takeover_and_loss(tmp_path: Path, clock: Clock) -> None:
    lost: list[str] = []
    first_repo = SessionRepository(
        tmp_path, renew_interval=None, now_ms=clock, on_lost=lambda h: lost.append(h.owner_id)
    )
    second_repo = SessionRepository(tmp_path, renew_interval=None, now_ms=clock)
    first = first_repo.create("L")
    first.append_message(None, msg("a"), id="a")
    with pytest.raises(
        SessionAlreadyClaimedError, match=f"already claimed by writer {first.owner_id}"
    ):
        second_repo.open("L")
    with pytest.raises(SessionAlreadyClaimedError):
        first_repo.open("L")  # every handle is a fresh owner
    clock.advance(29_000)
    first.renew()  # renewal extends the lease by 30 s from now
    clock.advance(29_000)
    with pytest.raises(SessionAlreadyClaimedError):
        second_repo.open("L")
    clock.advance(1_001)
    second = second_repo.open("L")
    assert second.fence == first.fence + 1 and second.owner_id != first.owner_id
    with pytest.raises(WriterLeaseLostError, match="writer lease was lost"):
        first.append_message("a", msg("late"))
    assert first.lost.is_set()
    assert lost == [first.owner_id]
    with pytest.raises(WriterLeaseLostError):
        first.get_entry("a")  # the handle refuses all further work
    with pytest.raises(WriterLeaseLostError):
        first.renew()
    first.close()  # a stale owner cannot delete its successor's lease
    conn = raw(tmp_path / "L.sqlite")
    assert conn.execute("SELECT owner_id, fence FROM writer_lease").fetchall() == [
        (second.owner_id, 2)
    ]
    second.append_message("a", msg("b"))
    assert [e.seq for e in second.scan_entries()] == [3, 4]
    second.close()
    assert conn.execute("SELECT owner_id, fence FROM writer_lease").fetchall() == [("", 2)]
    conn.close()
    with pytest.raises(SessionClosedError):
        second.append_message(None, msg("closed"))
    third = second_repo.open("L")
    assert third.fence == 3  # a release keeps the fence: the next claim takes the next one
    third.close()


def test_commit_checks_fence_in_its_own_transaction(tmp_path: Path, clock: Clock) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None, now_ms=clock)
    session = repo.create("F")
    conn = raw(session.path)
    conn.execute("UPDATE writer_lease SET fence = fence + 1")  # someone else took over
    with pytest.raises(WriterLeaseLostError):
        session.append_message(None, msg("x"))
    assert conn.execute("SELECT count(*) FROM entries").fetchone()[0] == 0
    assert conn.execute("SELECT next_seq FROM session").fetchone()[0] == 3
    conn.close()
    session.close()


def test_background_renewal_keeps_lease(tmp_path: Path) -> None:
    import time

    # A lease of 2 s: with 0.6 s, one stall of a loaded CI host (a renewal
    # 1.3 s late) let the other repository take the session.
    holder = SessionRepository(tmp_path, lease_seconds=2, renew_interval=0.2)
    other = SessionRepository(tmp_path, lease_seconds=2, renew_interval=0.2)
    session = holder.create("bg")
    time.sleep(2.5)
    with pytest.raises(SessionAlreadyClaimedError):
        other.open("bg")
    session.append_message(None, msg("still mine"))
    session.close()
    other.open("bg").close()
    with pytest.raises(InvalidSessionWriteError):
        SessionRepository(tmp_path, lease_seconds=1, renew_interval=2)


def test_dropped_handle_stops_renewing(tmp_path: Path) -> None:
    import gc

    from pglease.clock import FakeClock

    clock = FakeClock()
    holder = SessionRepository(tmp_path, lease_seconds=0.5, renew_interval=0.1, clock=clock)
    session = holder.create("dropped")
    keeper = holder.keeper
    assert keeper is not None and len(keeper) == 1
    del session
    gc.collect()
    clock.advance(0.1)  # the next beat finds the file gone: the keeper lets the lease go
    deadline = time.monotonic() + 10
    while len(keeper) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(keeper) == 0
    with sqlite3.connect(tmp_path / "dropped.sqlite") as conn:
        (expires,) = conn.execute("SELECT expires_at_ms FROM writer_lease").fetchone()
    clock.advance(1.0)  # beats would be due again for a lease still held
    # At its recorded expiry the lease is free: nothing extended it meanwhile.
    later = SessionRepository(tmp_path, renew_interval=None, now_ms=lambda: int(expires))
    with later.open("dropped") as again:
        assert again.fence == 2


# --- repository -----------------------------------------------------------------------------------


def test_list_orders_and_reports_problems(repo: SessionRepository, clock: Clock) -> None:
    for name in ["old", "mid", "new"]:
        repo.create(name).close()
        clock.advance(1000)
    (repo.directory / "garbage.sqlite").write_bytes(b"this is not sqlite" * 100)
    with repo.create("future") as s:
        pass
    conn = raw(s.path)
    conn.execute("UPDATE session SET storage_version = 2")
    conn.close()
    (repo.directory / "notes.txt").write_text("ignored")
    (repo.directory / ".x.1234.tmp").write_bytes(b"")
    listing = repo.list()
    assert listing.ids() == ["new", "mid", "old"]
    problems = {p.id: p.error for p in listing.problems}
    assert set(problems) == {"garbage", "future"}
    assert isinstance(problems["future"], SessionVersionError)
    assert isinstance(problems["garbage"], SessionCorruptError)
    assert listing.sessions[0].lease is None and listing.sessions[0].next_seq == 3


def test_open_checks(repo: SessionRepository) -> None:
    with pytest.raises(SessionNotFoundError):
        repo.open("absent")
    assert not repo.path_for("absent").exists()
    repo.create("v").close()
    conn = raw(repo.path_for("v"))
    conn.execute("UPDATE session SET storage_version = 2")
    with pytest.raises(SessionVersionError, match="newer than 1"):
        repo.open("v")
    conn.execute("UPDATE session SET storage_version = 0")
    with pytest.raises(SessionVersionError, match="requires migrations"):
        repo.open("v")
    conn.execute("UPDATE session SET storage_version = 1")
    conn.execute("INSERT INTO session SELECT * FROM session")
    with pytest.raises(SessionCorruptError, match="exactly one session row"):
        repo.open("v")
    conn.execute("DELETE FROM session")
    with pytest.raises(SessionCorruptError, match="exactly one session row"):
        repo.open("v")
    # not claimed: still the row its create's close released
    assert conn.execute("SELECT * FROM writer_lease").fetchall() == [("", 1, 0)]
    conn.close()


def test_corrupt_rows_are_reported(repo: SessionRepository) -> None:
    with repo.create("bad") as s:
        s.append_message(None, msg("a"), id="a")
        s.append_message("a", msg("b"), id="b")
        conn = raw(s.path)
        conn.execute("INSERT INTO entries VALUES ('c', 'b', 99, 'custom', NULL, 0, '{}')")
        with pytest.raises(SessionCorruptError, match="custom entry c has no custom_type"):
            s.get_entry("c")
        conn.execute("DELETE FROM entries WHERE id = 'c'")
        conn.execute("DELETE FROM branch_meta")
        with pytest.raises(SessionCorruptError, match="corrupt branch index"):
            s.scan_branch("b")
        conn.close()


def test_delete(tmp_path: Path, clock: Clock) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None, now_ms=clock)
    other = SessionRepository(tmp_path, renew_interval=None, now_ms=clock)
    with pytest.raises(SessionNotFoundError):
        repo.delete("missing")
    session = repo.create("d")
    session.append_message(None, msg("x"))
    with pytest.raises(SessionBusyError, match="open"):
        repo.delete("d")
    with pytest.raises(SessionBusyError, match="leased by writer"):
        other.delete("d")
    clock.advance(31_000)  # the lease of the (still open) handle expired
    other.delete("d")
    session.close()
    assert not any(tmp_path.iterdir())
    repo.create("e").close()
    reader = raw(repo.path_for("e"))
    reader.execute("PRAGMA journal_mode = WAL")
    reader.execute("SELECT * FROM session").fetchall()  # keeps -wal/-shm around
    assert (tmp_path / "e.sqlite-wal").exists() or (tmp_path / "e.sqlite-shm").exists()
    repo.delete("e")
    reader.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("e.sqlite")]
