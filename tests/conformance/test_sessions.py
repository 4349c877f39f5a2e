"""Session conformance: the same session behaviour on every backend and flavour
(files and PostgreSQL, blocking and asyncio; the asyncio repositories run
through a blocking view, `tests/_blocking.py`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from pglease.sessions import (
    AddUsage,
    AppendEntry,
    AsyncPostgresSession,
    AsyncSessionRepository,
    AsyncSqliteSession,
    BranchQuery,
    DeleteRegister,
    DuplicateIdError,
    Entry,
    InvalidSessionWriteError,
    PostgresSession,
    SessionAlreadyClaimedError,
    SessionBackend,
    SessionClosedError,
    SessionExistsError,
    SessionHandle,
    SessionNotFoundError,
    SessionRepository,
    SetRegister,
    SqliteSession,
    UnknownEntryError,
    sum_usage,
)

from .._blocking import Blocking, Flavour, LoopThread, unwrap
from ..test_session_branch_index import reference

EMPTY_USAGE: dict[str, Any] = json.loads(
    '{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"totalTokens":0,'
    '"cost":{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"total":0}}'
)
IDLE: dict[str, Any] = {"currentOperationId": None, "pendingNextRun": []}


class Clock:
    """A settable millisecond clock (timestamps only; PG leases use the DB clock)."""

    def __init__(self, start: int = 1_700_000_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def compaction() -> dict[str, Any]:
    return {"summary": "s", "retainedTail": [], "tokensBefore": 10, "fromHook": False}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", "sqlite-async", "postgres", "postgres-async"])
def backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[SessionBackend]:
    """The same session tests on a directory of files and on PostgreSQL, each in
    both flavours (the asyncio ones through a blocking view, `tests/_blocking.py`)."""
    repo: SessionBackend
    flavours: list[Flavour] = []
    loops: list[LoopThread] = []
    if request.param == "sqlite":
        repo = SessionRepository(
            request.getfixturevalue("tmp_path"), renew_interval=None, now_ms=clock
        )
    elif request.param == "sqlite-async":
        loops.append(LoopThread())
        directory = request.getfixturevalue("tmp_path")

        async def make() -> AsyncSessionRepository:
            return AsyncSessionRepository(directory, renew_interval=None, now_ms=clock)

        repo = Blocking(loops[0].run(make()), loops[0])
    else:
        name = "async" if request.param == "postgres-async" else "sync"
        flavours.append(
            Flavour(
                name,
                request.getfixturevalue("pg_dsn"),
                request.getfixturevalue("schema"),
                request.getfixturevalue("pg_store"),
            )
        )
        repo = flavours[0].repo(renew_interval=None, now_ms=clock)
    try:
        yield repo
    finally:
        repo.close()
        for made in flavours:
            made.close()
        for loop in loops:
            loop.close()


def test_both_handles_satisfy_the_protocol(backend: SessionBackend) -> None:
    handle: SessionHandle = backend.create("p")
    kinds = SqliteSession | AsyncSqliteSession | PostgresSession | AsyncPostgresSession
    assert isinstance(unwrap(handle), kinds)
    handle.close()


# --- shared behaviour --------------------------------------------------------------------


def test_new_session_layout(backend: SessionBackend, clock: Clock) -> None:
    with backend.create("new", parent_session_id="origin") as session:
        stats = session.stats()
        assert (stats.next_seq, stats.message_count, stats.entry_count) == (3, 0, 0)
        assert stats.parent_session_id == "origin"
        assert stats.created_at == clock.now
        assert stats.usage == EMPTY_USAGE
        leaf = session.get_register("lane.leaf", "main")
        state = session.get_register("lane.state", "main")
        assert leaf is not None and (leaf.seq, leaf.value_json) == (1, "null")
        assert state is not None and state.seq == 2 and state.value == IDLE
        assert session.get_register("lane.config", "main") is None
        assert session.fence == 1
    with pytest.raises(SessionExistsError):
        backend.create("new")


def test_commit_shares_seq_counter_and_timestamp(backend: SessionBackend, clock: Clock) -> None:
    with backend.create("s") as session:
        result = session.commit(
            [
                AppendEntry("message", None, {"message": msg("a")}, id="e1"),
                AppendEntry("custom", "e1", {"data": {"k": [1, 2]}}, custom_type="note", id="e2"),
                SetRegister("fact.name", "", "Named"),
                AddUsage({"input": 5, "totalTokens": 5, "cost": {"total": 0.5}}, entry_id="e1"),
                DeleteRegister("lane.state", "main"),
            ]
        )
        assert (result.first_seq, result.next_seq, result.timestamp) == (3, 8, clock.now)
        assert result.ids[:2] == ("e1", "e2") and result.ids[2] is None
        assert result.ids[3] is not None and result.ids[4] is None
        entries = session.scan_entries()
        assert [(e.id, e.parent_id, e.seq, e.type, e.custom_type) for e in entries] == [
            ("e1", None, 3, "message", None),
            ("e2", "e1", 4, "custom", "note"),
        ]
        assert all(e.timestamp == clock.now for e in entries)
        assert entries[1].payload_json == '{"data":{"k":[1,2]}}'
        name = session.get_register("fact.name", "")
        assert name is not None and (name.seq, name.value) == (5, "Named")
        assert session.get_register("lane.state", "main") is None
        (usage,) = session.usage_rows()
        assert (usage.seq, usage.entry_id, usage.adjustment) == (6, "e1", False)
        stats = session.stats()
        assert (stats.next_seq, stats.message_count, stats.entry_count) == (8, 1, 2)
        assert stats.usage == sum_usage(EMPTY_USAGE, usage.usage)
        clock.now += 5
        entry = session.append_message("e2", msg("b"), terminate=True)
        assert (entry.seq, entry.timestamp, entry.parent_id) == (8, clock.now, "e2")
        assert entry.payload == {"message": msg("b"), "terminate": True}
        assert session.get_entry(entry.id) == entry
        row = session.add_usage({"output": 2}, adjustment=True, details={"why": "fix"})
        assert (row.seq, row.adjustment, row.details) == (9, True, {"why": "fix"})
        assert session.set_register("fact.custom", "k", {"v": 1}) == 10
        assert session.delete_register("fact.custom", "k") == 11
        assert [e.id for e in session.scan_entries(after_seq=3, types=["message"])] == [entry.id]
        assert [e.id for e in session.scan_entries(limit=1)] == ["e1"]


@pytest.mark.parametrize(
    ("writes", "error", "match"),
    [
        ([], InvalidSessionWriteError, "at least one write"),
        ([AppendEntry("bogus", None)], InvalidSessionWriteError, "not one of"),
        ([AppendEntry("message", None, {})], InvalidSessionWriteError, "missing field"),
        ([AppendEntry("custom", None)], InvalidSessionWriteError, "custom_type"),
        ([AddUsage({"input": "x"})], InvalidSessionWriteError, "must be a number"),
        ([SetRegister("", "k", 1)], InvalidSessionWriteError, "namespace"),
        ([SetRegister("n", "k", float("nan"))], InvalidSessionWriteError, "JSON"),
        (
            [
                AppendEntry("message", None, {"message": 1}, id="ok"),
                AppendEntry("message", "ghost", {"message": 2}),
            ],
            UnknownEntryError,
            "ghost",
        ),
        (
            [
                AppendEntry("message", None, {"message": 1}, id="same"),
                AddUsage({"input": 1}, id="same"),
            ],
            DuplicateIdError,
            "same",
        ),
    ],
)
def test_failed_commits_change_nothing(
    backend: SessionBackend, writes: list[Any], error: type[Exception], match: str
) -> None:
    with backend.create("s") as session:
        session.append_message(None, msg("root"), id="root")
        before = (session.stats(), session.snapshot(), session.usage_rows())
        with pytest.raises(error, match=match):
            session.commit(writes)
        assert (session.stats(), session.snapshot(), session.usage_rows()) == before
        # still usable afterwards
        assert session.append_message("root", msg("next")).seq == 4


def test_ids_are_unique_across_entries_and_usage(backend: SessionBackend) -> None:
    with backend.create("s") as session:
        session.append_message(None, msg("a"), id="x")
        session.add_usage({"input": 1}, id="u")
        with pytest.raises(DuplicateIdError, match="'x'"):
            session.append_message("x", msg("b"), id="x")
        with pytest.raises(DuplicateIdError, match="'x'"):
            session.add_usage({"input": 1}, id="x")
        with pytest.raises(DuplicateIdError, match="'u'"):
            session.append_message("x", msg("b"), id="u")
        with pytest.raises(UnknownEntryError, match="'u'"):
            session.append_message("u", msg("b"))
        assert session.stats().next_seq == 5


def test_registers_listing_by_prefix_in_byte_order(backend: SessionBackend) -> None:
    with backend.create("s") as session:
        for key in ["b", "a/2", "A", "a/10", "é", "a", "ab"]:
            session.set_register("fact.custom", key, key)
        keys = [r.key for r in session.list_registers("fact.custom")]
        assert keys == sorted(keys, key=lambda k: k.encode())
        assert [r.key for r in session.list_registers("fact.custom", "a/")] == ["a/10", "a/2"]
        assert [r.key for r in session.list_registers("fact.custom", "a")] == [
            "a",
            "a/10",
            "a/2",
            "ab",
        ]
        assert session.list_registers("nothing") == []


def build_tree(session: SessionHandle) -> dict[str, Entry]:
    """A tree with chains, divergences and compactions (ids are letters)."""
    spec = [
        ("a", None, "message"),
        ("b", "a", "message"),
        ("c", "b", "compaction"),
        ("d", "c", "message"),
        ("e", "d", "custom"),
        ("f", "b", "message"),  # divergence before the compaction
        ("g", "d", "message"),  # divergence after it
        ("h", "g", "compaction"),
        ("i", "h", "message"),
        ("j", "e", "message"),
        ("k", "i", "branch_summary"),
        ("l", "c", "message"),
    ]
    writes = []
    for entry_id, parent, type_ in spec:
        payload: dict[str, Any]
        if type_ == "message":
            payload = {"message": msg(entry_id)}
        elif type_ == "compaction":
            payload = compaction()
        elif type_ == "branch_summary":
            payload = {"fromId": "a", "summary": "x", "fromHook": True}
        else:
            payload = {"data": entry_id}
        custom = "note" if type_ == "custom" else None
        writes.append(AppendEntry(type_, parent, payload, custom, entry_id))
    # two commits: the index must work across and within commits
    session.commit(writes[:5])
    session.commit(writes[5:])
    return {e.id: e for e in session.scan_entries()}


QUERIES = [
    BranchQuery(),
    BranchQuery(newest_first=False),
    BranchQuery(stop_type="compaction"),
    BranchQuery(stop_type="compaction", newest_first=False),
    BranchQuery(stop_id="b"),
    BranchQuery(types=frozenset({"message"})),
    BranchQuery(custom_type="note"),
    BranchQuery(cursor=6),
    BranchQuery(cursor=6, newest_first=False, limit=2),
    BranchQuery(limit=2),
    BranchQuery(limit=0),
]


def test_branch_scans_match_a_parent_walk(backend: SessionBackend) -> None:
    with backend.create("s") as session:
        entries = build_tree(session)
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
                assert [e.id for e in got] == reference(entries, leaf, query), (leaf, query)
                assert all(e == entries[e.id] for e in got)
        with pytest.raises(UnknownEntryError):
            session.scan_branch("nope")


def test_second_writer_is_refused_and_closed_handle_refuses(backend: SessionBackend) -> None:
    session = backend.create("s")
    with pytest.raises(
        SessionAlreadyClaimedError, match=f"already claimed by writer {session.owner_id}"
    ):
        backend.open("s")
    session.close()
    session.close()  # idempotent
    with pytest.raises(SessionClosedError):
        session.append_message(None, msg("late"))
    with pytest.raises(SessionClosedError):
        session.stats()
    with backend.open("s") as again:
        assert again.fence == 2  # a release keeps the generation, in every backend
    with pytest.raises(SessionNotFoundError):
        backend.open("missing")


def test_fork_within_backend(backend: SessionBackend) -> None:
    with backend.create("src") as session:
        build_tree(session)
        session.set_register("lane.leaf", "main", "k")
        session.set_register("fact.label", "b", "label b")
        session.set_register("fact.label", "f", "label f")
        # the source stays leased by its writer: forking does not need the lease
        with backend.fork("src", id="br") as fork:
            entries = fork.scan_entries()
            assert [e.id for e in entries] == ["a", "b", "c", "d", "g", "h", "i", "k"]
            assert fork.snapshot().parent_session_id == "src"
            labels = fork.list_registers("fact.label")
            assert [(r.key, r.value) for r in labels] == [("b", "label b")]
            leaf = fork.get_register("lane.leaf", "main")
            assert leaf is not None and leaf.value == "k"
            assert fork.stats().next_seq == leaf.seq + 3  # then state, label b
            assert [e.id for e in fork.scan_branch("k", stop_type="compaction")] == [
                "k",
                "i",
                "h",
            ]
        with backend.fork("src", entry_id="d", position="before", id="bd") as fork:
            assert [e.id for e in fork.scan_entries()] == ["a", "b", "c"]
        with backend.fork("src", scope="tree", id="tr") as fork:
            assert fork.snapshot().entries == session.snapshot().entries
        with pytest.raises(UnknownEntryError):
            backend.fork("src", entry_id="zz", id="bad")
        with pytest.raises(InvalidSessionWriteError):
            backend.fork("src", scope="tree", entry_id="a", id="bad")
        with pytest.raises(SessionExistsError):
            backend.fork("src", id="tr")
        with pytest.raises(SessionNotFoundError):
            backend.fork("nope", id="bad2")
