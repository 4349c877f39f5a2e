"""The SQLite runtime driver (pglease/sqlite/runtime.py) on real files: the
heartbeat's judgements, the fair queue, a busy file, the schema upgrade, and
two real processes sharing one file."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from pglease import Owner, SqliteStore, StoreBusyError, StoreClosedError, resource_id
from pglease.driver import ClaimRequest, HeartbeatItem, LeaveQueue

from .test_errors_sqlite import write_lock_held

A = Owner("host", "a")
B = Owner("host", "b")
C = Owner("host", "c")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    with SqliteStore(tmp_path / "rt.sqlite") as s:
        yield s


def test_heartbeat_judges_each_lease_and_writes_no_event(store: SqliteStore) -> None:
    now = datetime.now(UTC)
    live_rid = store.ensure_resource("run", "live")
    live = store.claim(live_rid, A, 30)
    gone_rid = store.ensure_resource("run", "gone")
    gone = store.claim(gone_rid, A, 30)
    late_rid = store.ensure_resource("run", "late")
    late = store.claim(late_rid, A, 1, now=now - timedelta(seconds=10))
    assert live is not None and gone is not None and late is not None
    store.release(gone)
    assert store.claim(gone_rid, B, 30) is not None  # generation 2 now
    missing = gone.__class__(resource_id("run", "never"), A, gone.token, 1, now, 1)
    before = {rid: store.get(rid).revision for rid in (live_rid, gone_rid, late_rid)}

    line = store.runtime_driver().heartbeat_channel(1.0)
    line.connect()
    results = line.heartbeat(
        [HeartbeatItem(c, 60.0) for c in (live, gone, late, missing)]  # any order
    )
    by_rid = {r.resource_id: r for r in results}
    assert by_rid[live_rid].status == "renewed"
    renewed_to = by_rid[live_rid].expires_at
    assert renewed_to is not None and renewed_to > live.expires_at
    assert by_rid[gone_rid].status == "lost" and by_rid[gone_rid].generation == 2
    assert by_rid[late_rid].status == "expired" and by_rid[late_rid].expires_at is None
    assert by_rid[missing.resource_id].status == "unknown"
    # Only the expiry moved: revisions and the log are as before.
    assert {rid: store.get(rid).revision for rid in before} == before
    assert store.get(live_rid).lease.expires_at == renewed_to
    assert [e.type for e in store.events(live_rid)] == ["lease.claimed"]


def test_fair_queue_orders_waiters_and_leave_removes_the_entry(store: SqliteStore) -> None:
    rid = store.ensure_resource("run", "q")
    held = store.claim(rid, A, 30)
    assert held is not None
    driver = store.runtime_driver()

    def attempt(owner: Owner, waiter: str) -> object:
        return driver.attempt_claim(ClaimRequest(rid, owner, f"tok-{waiter}", 30.0, waiter, 5.0))

    b = attempt(B, "wb")
    c = attempt(C, "wc")
    assert b is not None and c is not None
    assert not b.claimed and b.position == 0 and b.holder == A  # type: ignore[attr-defined]
    assert b.expires_at == held.expires_at  # type: ignore[attr-defined]
    assert not c.claimed and c.position == 1  # type: ignore[attr-defined]
    assert c.head_expires_at is not None  # type: ignore[attr-defined]
    store.release(held)
    # The lease is free, but C is not the head: refused for its place.
    c = attempt(C, "wc")
    assert c is not None and not c.claimed and c.position == 1  # type: ignore[attr-defined]
    driver.leave_queue(LeaveQueue(rid, "wb"))
    won = attempt(C, "wc")
    assert won is not None and won.claimed and won.generation == 2  # type: ignore[attr-defined]
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("SELECT count(*) FROM lease_waiters").fetchone() == (0,)


def test_a_claim_on_a_busy_file_is_busy_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "busy.sqlite"
    with SqliteStore(path, busy_timeout=0.2) as store:
        rid = store.ensure_resource("run", "b")
        request = ClaimRequest(rid, A, "tok", 30.0)
        with write_lock_held(path):
            assert store.runtime_driver().attempt_claim(request) is None
            # A beat waiting out busy_timeout fails as a whole (the keeper retries).
            line = store.runtime_driver().heartbeat_channel(1.0)
            with pytest.raises(StoreBusyError):
                line.heartbeat([])
        assert store.get(rid).lease.generation == 0


def test_hold_on_a_closed_store_fails_before_claiming(tmp_path: Path) -> None:
    path = tmp_path / "closed.sqlite"
    store = SqliteStore(path)
    store.close()
    with pytest.raises(StoreClosedError), store.hold("run", "x", A, 5):
        pytest.fail("the body must not run")
    with SqliteStore(path) as reopened:
        assert reopened.list_resources() == []


def test_an_older_file_gets_the_queue_table(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    SqliteStore(path).close()
    with sqlite3.connect(path) as conn:  # as a file written before migration 0002
        conn.execute("DROP TABLE lease_waiters")
        conn.execute("DELETE FROM schema_migrations WHERE version = 2")
    with SqliteStore(path, auto_migrate=False) as store:
        assert store.migrate() == ["0002_fleet"]
        assert store.acquire("run", "x", A, 5, timeout=1, fair=True).generation == 1


def test_an_older_file_gets_the_expiry_marker_and_the_prune_horizon(tmp_path: Path) -> None:
    from pglease.watch import prune, reap_once

    path = tmp_path / "old.sqlite"
    with SqliteStore(path) as store:
        rid = store.ensure_resource("run", "x")
        assert store.claim(rid, A, 1.0, now=datetime.now(UTC) - timedelta(hours=1)) is not None
    with sqlite3.connect(path) as conn:  # as a file written before migration 0003
        conn.execute("DROP TABLE event_horizon")
        conn.execute("DROP INDEX leases_to_reap")
        conn.execute("ALTER TABLE leases DROP COLUMN expired_generation")
        conn.execute("DELETE FROM schema_migrations WHERE version = 3")
    with SqliteStore(path, auto_migrate=False) as store:
        assert store.migrate() == ["0003_maintenance"]
        assert reap_once(store) == 1
        assert reap_once(store) == 0
        assert [e.type for e in store.events(rid)] == ["lease.claimed", "lease.expired"]
        assert prune(store, 0) == 2
        assert store.events(rid) == []


_HOLDER = """
import sys
from pglease import Owner, SqliteStore
with SqliteStore(sys.argv[1]) as store:
    with store.hold("run", "shared", Owner("host", "p1"), 600) as lease:
        print(lease.generation, flush=True)
        sys.stdin.readline()  # the test says when to let go
"""

_WAITER = """
import sys
from pglease import Owner, SqliteStore
with SqliteStore(sys.argv[1]) as store:
    me = Owner("host", "p2")
    rid = store.ensure_resource("run", "shared")
    print("refused" if store.claim(rid, me, 60) is None else "free", flush=True)
    claim = store.acquire("run", "shared", me, 60, timeout=120, fair=sys.argv[2] == "fair")
    print(claim.generation, flush=True)
"""


@pytest.mark.parametrize("mode", ["unfair", "fair"])
def test_second_process_acquires_after_the_first_releases(tmp_path: Path, mode: str) -> None:
    path = str(tmp_path / "shared.sqlite")
    SqliteStore(path).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    waiter = None
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "1"
        waiter = subprocess.Popen(
            [sys.executable, "-c", _WAITER, path, mode], stdout=subprocess.PIPE, text=True
        )
        assert waiter.stdout is not None
        assert waiter.stdout.readline().strip() == "refused"  # it waits while p1 holds
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(60) == 0
        # p1's lease had 600 s to run and p2 waits at most 120 s: only the release
        # (seen in the file by p2's watcher) lets it in.
        assert waiter.stdout.readline().strip() == "2"
        assert waiter.wait(60) == 0
    finally:
        for proc in (holder, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    with SqliteStore(path) as store:
        rid = resource_id("run", "shared")
        events = [(e.type, e.actor.id if e.actor else None) for e in store.events(rid)]
        assert events == [
            ("lease.claimed", "p1"),
            ("lease.released", "p1"),
            ("lease.claimed", "p2"),
        ]


_CANDIDATE = """
import sys
from pglease import Owner, SqliteStore
with SqliteStore(sys.argv[1]) as store:
    election = store.elect("sched", Owner("host", sys.argv[2]), ttl=600)
    print("candidate", flush=True)
    assert election.wait_elected(120)
    print("elected", election.lease.generation, flush=True)
    sys.stdin.readline()  # the test says when to resign
    election.stop(resign=True)
"""


def test_an_election_across_processes_hands_over_on_resignation(tmp_path: Path) -> None:
    path = str(tmp_path / "elect.sqlite")
    SqliteStore(path).close()
    procs: list[subprocess.Popen[str]] = []

    def candidate(name: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CANDIDATE, path, name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "candidate"
        return proc

    try:
        p1 = candidate("p1")
        assert p1.stdout is not None and p1.stdout.readline().strip() == "elected 1"
        p2 = candidate("p2")
        with SqliteStore(path) as store:
            leader = store.leader("sched")
            assert leader is not None and leader.owner == Owner("host", "p1")
            assert p1.stdin is not None
            p1.stdin.write("\n")
            p1.stdin.flush()
            assert p1.wait(60) == 0
            # The lease had 600 s to run: p2 was elected by p1's resignation.
            assert p2.stdout is not None and p2.stdout.readline().strip() == "elected 2"
            leader = store.leader("sched")
            assert leader is not None and leader.owner == Owner("host", "p2")
            assert p2.stdin is not None
            p2.stdin.write("\n")
            p2.stdin.flush()
            assert p2.wait(60) == 0
            assert store.leader("sched") is None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
