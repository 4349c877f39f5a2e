"""Sessions on both backends: the key behaviours run on SQLite files and on
PostgreSQL tables alike; PostgreSQL-specific lease and event behaviour after.
Every PostgreSQL test runs on both flavours, blocking and asyncio (the asyncio
one through `tests/_blocking.py`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pglease import PostgresStore, ValidationError
from pglease.ids import resource_id
from pglease.sessions import (
    AddUsage,
    AppendEntry,
    AsyncPostgresSession,
    BranchQuery,
    DeleteRegister,
    DuplicateIdError,
    Entry,
    InvalidSessionWriteError,
    PostgresSession,
    PostgresSessionRepository,
    SessionAlreadyClaimedError,
    SessionBackend,
    SessionBusyError,
    SessionClosedError,
    SessionExistsError,
    SessionHandle,
    SessionNotFoundError,
    SessionRepository,
    SessionVersionError,
    SetRegister,
    SqliteSession,
    UnknownEntryError,
    WriterLeaseLostError,
    sum_usage,
)

from ._blocking import FLAVOURS, Flavour, open_flavour, unwrap
from .test_session_branch_index import reference

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


flavour = pytest.fixture(params=FLAVOURS)(open_flavour)


@pytest.fixture
def pg_repo(flavour: Flavour, clock: Clock) -> Iterator[PostgresSessionRepository]:
    with flavour.repo(renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture(params=["sqlite", "postgres", "postgres-async"])
def backend(request: pytest.FixtureRequest, clock: Clock) -> Iterator[SessionBackend]:
    """The same session tests on a directory of files and on PostgreSQL (both flavours)."""
    repo: SessionBackend
    flavours: list[Flavour] = []
    if request.param == "sqlite":
        repo = SessionRepository(
            request.getfixturevalue("tmp_path"), renew_interval=None, now_ms=clock
        )
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


def test_both_handles_satisfy_the_protocol(backend: SessionBackend) -> None:
    handle: SessionHandle = backend.create("p")
    assert isinstance(unwrap(handle), SqliteSession | PostgresSession | AsyncPostgresSession)
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
        # the file format deletes its lease row on release (the fence restarts);
        # pglease generations never go back
        assert again.fence == (1 if isinstance(again, SqliteSession) else 2)
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


# --- PostgreSQL only ------------------------------------------------------------------------


def events(store: PostgresStore, session_id: str) -> list[tuple[str, Any]]:
    return [(e.type, e.payload) for e in store.events(resource_id("session", session_id))]


def test_each_commit_is_one_fenced_mutation(
    pg_repo: PostgresSessionRepository, pg_store: PostgresStore
) -> None:
    with pg_repo.create("s") as session:
        rid = session.resource_id
        assert rid == resource_id("session", "s")
        state = pg_store.get(rid)
        assert state.lease.owner == session.owner and state.lease.generation == session.fence
        assert session.owner.type == "session"
        session.commit(
            [AppendEntry("message", None, {"message": 1}, id="a"), SetRegister("n", "k", 1)]
        )
        revision = session.revision
        expires_at = pg_store.get(rid).lease.expires_at
        assert expires_at is not None
        session.renew()  # a heartbeat: the expiry moves on, the revision and the log do not
        assert session.revision == revision == pg_store.get(rid).revision
        renewed = pg_store.get(rid).lease.expires_at
        assert renewed is not None and renewed > expires_at
        session.append_message("a", msg("b"))
        assert pg_store.get(rid).revision == session.revision
    types = events(pg_store, "s")
    assert [t for t, _ in types] == [
        "lease.claimed",
        "session.created",
        "session.commit",
        "session.commit",
        "lease.released",
    ]
    assert types[1][1] == {"session": "s", "parent_session_id": None, "entries": 0, "next_seq": 3}
    assert types[2][1] == {
        "session": "s",
        "first_seq": 3,
        "next_seq": 5,
        "entries": 1,
        "usage": 0,
        "registers": 1,
    }


def test_an_idle_session_writes_no_event(
    pg_repo: PostgresSessionRepository, pg_store: PostgresStore
) -> None:
    with pg_repo.create("s") as session:
        rid = session.resource_id
        revision = pg_store.get(rid).revision
        for _ in range(5):  # what the background renewer does every renew_interval
            session.renew()
        assert pg_store.get(rid).revision == revision == session.revision
        assert [t for t, _ in events(pg_store, "s")] == ["lease.claimed", "session.created"]
        assert session.append_message(None, msg("after")).seq == 3  # the lease still fences


def test_failed_commit_leaves_no_revision_or_event(
    pg_repo: PostgresSessionRepository, pg_store: PostgresStore
) -> None:
    with pg_repo.create("s") as session:
        session.append_message(None, msg("a"), id="a")
        before = pg_store.get(session.resource_id).revision
        count = len(events(pg_store, "s"))
        with pytest.raises(UnknownEntryError):
            session.commit(
                [
                    AppendEntry("message", "a", {"message": 1}, id="b"),
                    AddUsage({"input": 3}),
                    SetRegister("x", "y", 1),
                    AppendEntry("message", "ghost", {"message": 2}),
                ]
            )
        assert pg_store.get(session.resource_id).revision == before
        assert len(events(pg_store, "s")) == count
        assert session.get_entry("b") is None and session.usage_rows() == []
        assert session.get_register("x", "y") is None
        assert session.append_message("a", msg("c")).seq == 4


def test_revision_moved_under_the_handle_is_adopted(
    pg_repo: PostgresSessionRepository, pg_store: PostgresStore
) -> None:
    with pg_repo.create("s") as session:
        # a renew whose reply the handle never saw (the claim object is ours)
        pg_store.renew(session._claim, 30)
        assert session.append_message(None, msg("a")).seq == 3
        assert session.revision == pg_store.get(session.resource_id).revision
        # a commit that went through although its reply was lost: both the
        # revision and next_seq the handle knows are stale
        session.append_message(None, msg("b"))
        session._revision -= 1
        session._next_seq -= 1
        entry = session.append_message(None, msg("c"))
        assert entry.seq == 5 and session.stats().next_seq == 6
        assert session.revision == pg_store.get(session.resource_id).revision


def test_takeover_after_expiry_fences_the_old_holder(
    pg_store: PostgresStore, flavour: Flavour
) -> None:
    lost: list[str] = []
    first_repo = flavour.repo(
        lease_seconds=0.5, renew_interval=None, on_lost=lambda h: lost.append(h.id)
    )
    first = first_repo.create("s")
    first.append_message(None, msg("a"), id="a")
    with flavour.store(max_size=2) as other_store:
        other = flavour.repo(other_store, renew_interval=None)
        with pytest.raises(SessionAlreadyClaimedError, match="already held by session:"):
            other.open("s")
        time.sleep(0.7)
        second = other.open("s")
        assert second.fence == first.fence + 1
        with pytest.raises(WriterLeaseLostError, match="writer lease was lost"):
            first.append_message("a", msg("late"))
        assert lost == ["s"]
        assert first.lost.is_set()
        with pytest.raises(WriterLeaseLostError):
            first.get_entry("a")
        first.close()  # must not release the successor's lease
        assert pg_store.get(second.resource_id).lease.owner == second.owner
        entry = second.append_message("a", msg("mine"))
        assert [e.id for e in second.scan_branch(entry.id)] == [entry.id, "a"]
        second.close()


def test_expired_lease_cannot_renew(flavour: Flavour) -> None:
    repo = flavour.repo(lease_seconds=0.3, renew_interval=None)
    session = repo.create("s")
    time.sleep(0.4)
    with pytest.raises(WriterLeaseLostError):
        session.renew()
    with pytest.raises(WriterLeaseLostError):
        session.commit([SetRegister("a", "b", 1)])
    session.close()
    with repo.open("s") as again:
        assert again.fence == 2


def test_background_renewal_keeps_the_lease(pg_store: PostgresStore, flavour: Flavour) -> None:
    # 2 s rather than less: one stall of a loaded host must not lose it.
    repo = flavour.repo(lease_seconds=2, renew_interval=0.25)
    with repo.create("s") as session:
        time.sleep(2.5)
        assert not session.lost.is_set()
        session.append_message(None, msg("still mine"))
        assert session.revision == pg_store.get(session.resource_id).revision
    assert flavour.renewers() == []


def test_wait_for_the_lease(flavour: Flavour) -> None:
    repo = flavour.repo(lease_seconds=5, renew_interval=None)
    holder = repo.create("s")
    timer = threading.Timer(0.3, holder.close)
    timer.start()
    started = time.monotonic()
    with repo.open("s", wait=5) as waited:
        assert waited.fence == 2
    assert 0.25 < time.monotonic() - started < 3
    timer.join()
    holder2 = repo.open("s")
    with pytest.raises(SessionAlreadyClaimedError):
        repo.open("s", wait=0.2)
    holder2.close()


def test_waiting_for_the_lease_is_checked_and_bounded(flavour: Flavour) -> None:
    repo = flavour.repo(lease_seconds=30, renew_interval=None)
    with repo.create("s") as holder:
        for bad in (-1, "soon", True, float("nan")):
            with pytest.raises(ValidationError, match="wait must"):
                repo.open("s", wait=bad)
        with pytest.raises(ValidationError):
            repo.open("s/x", wait=1)
        started = time.monotonic()
        with pytest.raises(
            SessionAlreadyClaimedError, match=f"already claimed by writer {holder.owner_id}"
        ):
            repo.open("s", wait=0.3)
        assert time.monotonic() - started >= 0.3  # it did wait, then gave up
        holder.append_message(None, msg("still mine"))  # the waiter took nothing


def test_list_info_and_delete(
    pg_repo: PostgresSessionRepository, pg_store: PostgresStore, clock: Clock
) -> None:
    with pg_repo.create("old") as old:
        old.append_message(None, msg("x"))
        old.add_usage({"input": 7})
    clock.now += 10
    live = pg_repo.create("new", parent_session_id="old")
    listing = pg_repo.list()
    assert listing.ids() == ["new", "old"] and listing.problems == []
    new_info, old_info = listing.sessions
    assert new_info.lease is not None and new_info.lease.owner_id == live.owner_id
    assert new_info.lease.fence == 1 and new_info.parent_session_id == "old"
    assert old_info.lease is None
    assert (old_info.message_count, old_info.next_seq, old_info.usage["input"]) == (1, 5, 7)
    assert pg_repo.info("old") == old_info
    with pytest.raises(SessionNotFoundError):
        pg_repo.info("zzz")
    with pytest.raises(SessionBusyError, match="leased"):
        pg_repo.delete("new")
    live.close()
    pg_repo.delete("new")
    assert pg_repo.list().ids() == ["old"]
    with pytest.raises(SessionNotFoundError):
        pg_repo.delete("new")
    assert events(pg_store, "new")[-1][0] == "session.deleted"
    # a re-created session continues the lease generations of the resource
    with pg_repo.create("new") as again:
        assert again.fence == 2 and again.stats().entry_count == 0


def test_newer_storage_version_is_refused(
    pg_repo: PostgresSessionRepository, pg_dsn: str, schema: str
) -> None:
    pg_repo.create("v").close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{schema}".sessions SET storage_version = 2')
    with pytest.raises(SessionVersionError, match="newer than 1"):
        pg_repo.open("v")
    with pytest.raises(SessionVersionError):
        pg_repo.snapshot("v")
    listing = pg_repo.list()
    assert listing.sessions == [] and [p.id for p in listing.problems] == ["v"]


def test_long_branch_pages_and_diverges(pg_repo: PostgresSessionRepository) -> None:
    """More rows than one scan page, a divergence deep in the chain, cursors."""
    with pg_repo.create("long") as session:
        writes = [AppendEntry("message", None, {"message": 0}, id="n0")]
        writes += [
            AppendEntry("message", f"n{i - 1}", {"message": i}, id=f"n{i}") for i in range(1, 1300)
        ]
        session.commit(writes[:700])
        session.commit(writes[700:])
        side = session.append_message("n100", msg("side"), id="side")
        full = session.scan_branch("n1299")
        assert [e.id for e in full] == [f"n{i}" for i in range(1299, -1, -1)]
        assert [e.id for e in session.scan_branch("n1299", newest_first=False, limit=3)] == [
            "n0",
            "n1",
            "n2",
        ]
        page = session.scan_branch("n1299", cursor=full[600].seq, limit=600)
        assert [e.id for e in page] == [e.id for e in full[601:1201]]
        assert [e.id for e in session.scan_branch(side.id)] == ["side"] + [
            f"n{i}" for i in range(100, -1, -1)
        ]


def test_repository_argument_checks(flavour: Flavour, tmp_path: Path) -> None:
    with pytest.raises(InvalidSessionWriteError):
        flavour.repo(lease_seconds=0)
    with pytest.raises(InvalidSessionWriteError):
        flavour.repo(lease_seconds=10, renew_interval=10)
    repo = flavour.repo(renew_interval=None)
    with pytest.raises(ValueError, match="session id"):
        repo.create("../x")
    with pytest.raises(ValueError, match="session id"):
        repo.open("a/b")
    with pytest.raises(InvalidSessionWriteError):
        repo.create("ok", parent_session_id=5)  # type: ignore[arg-type]


def test_unreachable_database_closes_the_trust_window(flavour: Flavour) -> None:
    """Renewals that keep failing (here: the handle's pool is gone) are retried
    only until the lease may have run out; then the handle gives up."""
    lost = threading.Event()
    store = flavour.store(max_size=2)
    repo = flavour.repo(store, lease_seconds=0.6, renew_interval=0.1, on_lost=lambda h: lost.set())
    session = repo.create("s")
    store.close()
    assert lost.wait(5)
    assert session.lost.is_set()
    with pytest.raises(WriterLeaseLostError, match="could not be renewed"):
        session.append_message(None, msg("late"))
    session.close()
    # nobody released it: the lease simply expires, then another writer takes over
    time.sleep(0.7)
    with flavour.repo(renew_interval=None).open("s") as again:
        assert again.fence == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"limit": -1}, {"limit": "5"}, {"limit": True}, {"after_seq": "0"}, {"types": [1]}],
)
def test_scan_arguments_are_checked(pg_repo: PostgresSessionRepository, kwargs: Any) -> None:
    with pg_repo.create("s") as session:
        with pytest.raises(InvalidSessionWriteError):
            session.scan_entries(**kwargs)
        root = session.append_message(None, msg("r"))
        if "limit" in kwargs:
            with pytest.raises(InvalidSessionWriteError):
                session.scan_branch(root.id, limit=kwargs["limit"])
