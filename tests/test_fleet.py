"""Fleet runtime on real PostgreSQL: hold, keeper, blocking acquire, election.

Timing is generous throughout (a loaded 2-core machine must pass): tests assert
what happened, never how fast. The keeper's own timing (late beats, trust
windows closing, batching) is driven by a fake clock in test_fleet_clock.py;
here real time runs, with ttls long enough that a stalled host keeps its lease.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pglease import (
    AcquireTimeoutError,
    DatabaseUnavailableError,
    InvalidTimingError,
    LeaseLostError,
    Owner,
    PostgresStore,
)
from pglease.clock import FakeClock
from pglease.runtime import Keeper, Timing, acquire, elect, hold, leader

from ._pg_where import PgWhere
from ._runtime_stores import queued, store

__all__ = ["store"]  # a fixture: the tests taking `store` run on PostgreSQL and SQLite

A = Owner("host", "a")
B = Owner("host", "b")
FAR = datetime.now(UTC) + timedelta(days=1)


def _takeover(store: Any, rid: str) -> None:
    """Another owner claims as if the holder's lease had run out (a day from now)."""
    assert store.claim(rid, B, 60, now=FAR) is not None


# --------------------------------------------------------------------------- timing


@pytest.mark.parametrize(
    ("ttl", "interval", "margin"),
    [(3.0, 2.0, None), (3.0, 1.0, 1.0), (3.0, 1.0, 1.5), (3.0, -1.0, None), (3.0, 1.0, 0),
     (0, None, None), (3.0, float("nan"), None), (3.0, True, None)],
)  # fmt: skip
def test_bad_timing_is_refused(ttl: float, interval: float | None, margin: float | None) -> None:
    with pytest.raises((InvalidTimingError, ValueError)):
        Timing.of(ttl, interval, margin)


def test_default_timing() -> None:
    t = Timing.of(9.0)
    assert t.interval == pytest.approx(3.0)
    assert 0 < t.margin < t.interval


def test_bad_timing_claims_nothing(store: Any) -> None:
    with pytest.raises(InvalidTimingError), hold(store, "run", "t", A, 3.0, interval=2.9):
        pass
    assert store.list_resources() == []


# --------------------------------------------------------------------------- hold + keeper


def test_hold_heartbeat_keeps_revision_and_releases(store: Any) -> None:
    """End to end in real time: ttl 6 s (a beat every 2 s, trusted 5.4 s), so a
    host stalled for a few seconds still keeps the lease."""
    with hold(store, "run", "r1", A, 6.0) as lease:
        rid = lease.resource_id
        first_expiry = lease.expires_at
        revision = lease.claim.revision
        assert lease.generation == 1
        end = time.monotonic() + 60
        while lease.renewals < 1:  # the first beat, whenever it comes
            assert time.monotonic() < end and not lease.lost.is_set()
            time.sleep(0.05)
        lease.check()
        assert not lease.lost.is_set()
        assert lease.expires_at > first_expiry
        state = store.get(rid)
        assert state.lease.held and state.lease.generation == 1
        # Heartbeats are not resource changes: no revision bump, no event, so
        # the holder's cached revision is still good for a fenced write.
        assert state.revision == revision
        assert [e.type for e in store.events(rid)] == ["lease.claimed"]
        result = store.mutate(lease.permit(revision), "run.step", payload={"n": 1})
        assert result.revision == revision + 1
    state = store.get(rid)
    assert not state.lease.held
    assert [e.type for e in store.events(rid)][-1] == "lease.released"
    with pytest.raises(LeaseLostError):
        lease.check()


def test_takeover_is_immediate_loss(store: Any) -> None:
    seen: list[LeaseLostError] = []
    clock = FakeClock()  # the next beat comes when the test says so
    # Leaving the block after the loss raises: the body did not finish under its lease.
    with (
        Keeper(store, clock=clock) as keeper,
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(store, "run", "r2", A, 30, on_lost=seen.append, keeper=keeper) as lease,
    ):
        _takeover(store, lease.resource_id)
        clock.advance(lease.timing.interval)
        assert lease.lost.wait(30), "the next beat must report the takeover"
        with pytest.raises(LeaseLostError, match="no longer has it"):
            lease.check()
        with pytest.raises(LeaseLostError):
            lease.permit(2)
    assert len(seen) == 1
    # The newer holder was not disturbed by the old holder's exit.
    state = store.get(lease.resource_id)
    assert state.lease.owner == B and state.lease.generation == 2


def test_unreachable_database_closes_trust_window(pg_store: PostgresStore) -> None:
    """A keeper that cannot reach its database loses its leases on its own clock
    (`hold` would have refused to claim: `connect` fails at once)."""
    rid = pg_store.ensure_resource("run", "r4")
    claim = pg_store.claim(rid, A, 1.0)
    assert claim is not None
    dead = PgWhere("postgresql://nobody@127.0.0.1:9/none?connect_timeout=1", pg_store.schema)
    with Keeper(dead, connect_timeout=1) as keeper:
        with pytest.raises(DatabaseUnavailableError, match="keeper: cannot connect"):
            keeper.connect()
        lease = keeper.add(claim, Timing.of(1.0), time.monotonic())  # no I/O: accepted
        assert lease.lost.wait(30)
        assert keeper.stats.errors >= 1
    with pytest.raises(LeaseLostError, match="trust window"):
        lease.check()


# --------------------------------------------------------------------------- acquire


@pytest.mark.parametrize("fair", [False, True])
def test_acquire_timeout_leaves_nothing(store: Any, fair: bool) -> None:
    with hold(store, "run", "busy", A, 30) as lease:
        before = store.get(lease.resource_id)
        with pytest.raises(AcquireTimeoutError, match="within"):
            acquire(store, "run", "busy", B, 5, timeout=0.5, fair=fair)
        after = store.get(lease.resource_id)
        assert after.revision == before.revision
        assert after.lease.owner == A
        assert queued(store) == 0
        with pytest.raises(AcquireTimeoutError):
            acquire(store, "run", "busy", B, 5, timeout=0, fair=fair)
        assert queued(store) == 0


@pytest.mark.parametrize("use_watcher", [True, False])
def test_acquire_wakes_on_release(store: Any, use_watcher: bool) -> None:
    got: list[tuple[int, float]] = []
    with hold(store, "run", "rel", A, 60) as lease:

        def wait() -> None:
            c = acquire(store, "run", "rel", B, 5, timeout=30, use_watcher=use_watcher)
            got.append((c.generation, time.monotonic()))

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.5)
        released_at = time.monotonic()
    t.join(40)
    assert got and got[0][0] == lease.generation + 1
    # Woken by the release, not by the 60 s expiry.
    assert got[0][1] - released_at < 20


def test_acquire_wakes_at_expiry(store: Any) -> None:
    rid = store.ensure_resource("run", "exp")
    holder = store.claim(rid, A, 1.0)
    assert holder is not None
    claim = acquire(store, "run", "exp", B, 5, timeout=30)
    assert claim.generation == holder.generation + 1
    state = store.get(rid)
    assert state.lease.owner == B


def test_fair_waiters_served_in_arrival_order(pg_dsn: str, schema: str) -> None:
    stores = [PostgresStore(pg_dsn, schema=schema, max_size=2) for _ in range(5)]
    try:
        order: list[int] = []
        lock = threading.Lock()
        with hold(stores[0], "hot", "k", A, 60) as first:

            def waiter(n: int) -> None:
                owner = Owner("host", f"w{n}")
                c = acquire(stores[n], "hot", "k", owner, 30, timeout=60, fair=True)
                with lock:
                    order.append(n)
                time.sleep(0.2)
                stores[n].release(c)

            threads = []
            for n in range(1, 5):
                t = threading.Thread(target=waiter, args=(n,))
                t.start()
                threads.append(t)
                # Each waiter enqueues before the next one starts.
                end = time.monotonic() + 20
                while queued(stores[0]) < n and time.monotonic() < end:
                    time.sleep(0.02)
            assert queued(stores[0]) == 4
            assert first.generation == 1
        for t in threads:
            t.join(60)
        assert order == [1, 2, 3, 4]
        assert queued(stores[0]) == 0
    finally:
        for s in stores:
            s.close()


# --------------------------------------------------------------------------- election


def test_election_start_twice_is_one_campaign(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema) as store:
        e = elect(store, "twice", A, ttl=6.0)
        try:
            assert e.start() is e  # running already: no second thread, no error
            assert e.wait_elected(20)
        finally:
            e.stop()
        assert leader(store, "twice") is None


def test_election_hand_over_and_query(pg_dsn: str, schema: str) -> None:
    log: list[str] = []
    with PostgresStore(pg_dsn, schema=schema) as s1, PostgresStore(pg_dsn, schema=schema) as s2:
        assert leader(s1, "sched") is None
        # ttl 6: a's keeper keeps it leader through the 1.5 s below, on a busy host too.
        e1 = elect(
            s1, "sched", A, ttl=6.0,
            on_elected=lambda lease: log.append(f"a+{lease.generation}"),
            on_deposed=lambda lease: log.append(
                f"a-{lease.generation} while {getattr(leader(s1, 'sched'), 'owner', None)}"
            ),
        )  # fmt: skip
        assert e1.wait_elected(20)
        now = leader(s1, "sched")
        assert now is not None and now.owner == A and now.generation == 1
        e2 = elect(
            s2, "sched", B, ttl=6.0,
            on_elected=lambda lease: log.append(f"b+{lease.generation}"),
            on_deposed=lambda lease: log.append(f"b-{lease.generation}"),
        )  # fmt: skip
        time.sleep(1.5)  # b campaigns meanwhile: a stays leader
        assert e1.is_leader and not e2.is_leader
        e1.stop()  # resigns: b is elected at once (woken by the release)
        assert e2.wait_elected(20)
        now = leader(s2, "sched")
        assert now is not None and now.owner == B and now.generation == 2
        e2.stop()
        assert leader(s2, "sched") is None
    # On resignation a is deposed while it still holds the lease: b cannot be
    # elected before a's on_deposed has returned.
    assert log == ["a+1", f"a-1 while {A}", "b+2", "b-2"]
