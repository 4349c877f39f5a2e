"""PostgreSQL sessions: lease and event behaviour, on both flavours, blocking
and asyncio (the asyncio one through `tests/_blocking.py`). The behaviour every
backend shares is in tests/conformance/test_sessions.py."""

from __future__ import annotations

import contextlib
import socket
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
    InvalidSessionWriteError,
    PostgresSessionRepository,
    SessionAlreadyClaimedError,
    SessionBusyError,
    SessionNotFoundError,
    SessionVersionError,
    SetRegister,
    UnknownEntryError,
    WriterLeaseLostError,
)

from ._blocking import FLAVOURS, Flavour, open_flavour, unwrap
from ._fleet_proxy import FreezingProxy
from .conformance.test_sessions import Clock, msg


class Partition(FreezingProxy):
    """A proxy that cuts its clients off: open connections freeze, new ones are refused."""

    def cut(self) -> None:
        self._stop.set()
        # shutdown, not just close: it wakes the blocked accept() and stops
        # listening at once (a plain close leaves the accepting thread's socket up).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.freeze()


@pytest.fixture
def clock() -> Clock:
    return Clock()


flavour = pytest.fixture(params=FLAVOURS)(open_flavour)


@pytest.fixture
def pg_repo(flavour: Flavour, clock: Clock) -> Iterator[PostgresSessionRepository]:
    with flavour.repo(renew_interval=None, now_ms=clock) as repo:
        yield repo


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
        keeper = unwrap(session)._lease.keeper  # the store's, shared with hold()
        assert keeper is not None and len(keeper) == 1
        time.sleep(2.5)
        assert not session.lost.is_set()
        assert session.held.renewals >= 1  # renewed by the keeper, past the first ttl
        session.append_message(None, msg("still mine"))
        assert session.revision == pg_store.get(session.resource_id).revision
    assert len(keeper) == 0  # closing took it out of the keeper
    assert flavour.renewers() == []  # and no renewer of its own ever ran


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
    """Renewals that keep failing (here: the database is cut off, the keeper's
    connection and the pool's alike) are retried only until the lease may have
    run out; then the handle gives up."""
    lost = threading.Event()
    proxy = Partition(flavour.dsn)
    store = flavour.store(max_size=2, dsn=proxy.dsn)
    repo = flavour.repo(store, lease_seconds=0.6, renew_interval=0.1, on_lost=lambda h: lost.set())
    session = repo.create("s")
    proxy.cut()
    assert lost.wait(5)
    assert session.lost.is_set()
    with pytest.raises(WriterLeaseLostError, match="could not be renewed"):
        session.append_message(None, msg("late"))
    session.close()
    # nobody released it: the lease simply expires, then another writer takes over
    time.sleep(0.7)
    with flavour.repo(renew_interval=None).open("s") as again:
        assert again.fence == 2
    store.close()
    proxy.close()


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
