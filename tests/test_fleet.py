"""Fleet runtime on real PostgreSQL: hold, keeper, blocking acquire, election.

Timing is generous throughout (a loaded 2-core machine must pass): tests assert
what happened, never how fast.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pglease import (
    AcquireTimeoutError,
    InvalidTimingError,
    LeaseLostError,
    Owner,
    PostgresStore,
)
from pglease.fleet import Keeper, Timing, acquire, elect, hold, leader

A = Owner("host", "a")
B = Owner("host", "b")
FAR = datetime.now(UTC) + timedelta(days=1)


def _waiters(store: PostgresStore) -> int:
    with store.connection() as conn:
        row = conn.execute(f'SELECT count(*) FROM "{store.schema}".lease_waiters').fetchone()
    assert row is not None
    return int(row[0])


def _takeover(store: PostgresStore, rid: str) -> None:
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


def test_bad_timing_claims_nothing(pg_store: PostgresStore) -> None:
    with pytest.raises(InvalidTimingError), hold(pg_store, "run", "t", A, 3.0, interval=2.9):
        pass
    assert pg_store.list_resources() == []


# --------------------------------------------------------------------------- hold + keeper


def test_hold_heartbeat_keeps_revision_and_releases(pg_store: PostgresStore) -> None:
    # ttl 1.5 s rather than less: with a shorter one, a single stall of the
    # shared CI host (a heartbeat statement past its limit) lost the lease.
    with hold(pg_store, "run", "r1", A, 1.5) as lease:
        rid = lease.resource_id
        first_expiry = lease.expires_at
        revision = lease.claim.revision
        assert lease.generation == 1
        # Several ttls pass: only the keeper keeps it alive.
        time.sleep(4.0)
        lease.check()
        assert not lease.lost.is_set()
        assert lease.renewals >= 2
        assert lease.expires_at > first_expiry
        state = pg_store.get(rid)
        assert state.lease.held and state.lease.generation == 1
        # Heartbeats are not resource changes: no revision bump, no event, so
        # the holder's cached revision is still good for a fenced write.
        assert state.revision == revision
        assert [e.type for e in pg_store.events(rid)] == ["lease.claimed"]
        result = pg_store.mutate(lease.permit(revision), "run.step", payload={"n": 1})
        assert result.revision == revision + 1
    state = pg_store.get(rid)
    assert not state.lease.held
    assert [e.type for e in pg_store.events(rid)][-1] == "lease.released"
    with pytest.raises(LeaseLostError):
        lease.check()


def test_takeover_is_immediate_loss(pg_store: PostgresStore) -> None:
    seen: list[LeaseLostError] = []
    # Leaving the block after the loss raises: the body did not finish under its lease.
    with (
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(pg_store, "run", "r2", A, 0.9, on_lost=seen.append) as lease,
    ):
        _takeover(pg_store, lease.resource_id)
        assert lease.lost.wait(10), "the next beat must report the takeover"
        with pytest.raises(LeaseLostError, match="no longer has it"):
            lease.check()
        with pytest.raises(LeaseLostError):
            lease.permit(2)
    assert len(seen) == 1
    # The newer holder was not disturbed by the old holder's exit.
    state = pg_store.get(lease.resource_id)
    assert state.lease.owner == B and state.lease.generation == 2


def test_row_locked_past_trust_window_is_lost_locally(pg_store: PostgresStore) -> None:
    """Beats keep failing (the row is locked: 'busy'), so the trust window
    closes and the lease is lost locally, although the database still has it."""
    with (
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(pg_store, "run", "r3", A, 1.2) as lease,
    ):
        lost_at: list[float] = []
        lease.on_lost(lambda _e: lost_at.append(time.monotonic()))
        with psycopg.connect(pg_store.dsn) as blocker:
            blocker.execute(
                f'SELECT 1 FROM "{pg_store.schema}".leases WHERE resource_id = %s FOR UPDATE',
                [lease.resource_id],
            )
            assert lease.lost.wait(10)
            deadline = lease.deadline
            blocker.rollback()
        assert lost_at and lost_at[0] >= deadline - 0.01
        with pytest.raises(LeaseLostError, match="trust window"):
            lease.check()


@dataclass
class _Where:
    dsn: str
    schema: str


def test_unreachable_database_closes_trust_window(pg_store: PostgresStore) -> None:
    """A keeper that cannot reach its database loses its leases on its own clock."""
    rid = pg_store.ensure_resource("run", "r4")
    claim = pg_store.claim(rid, A, 1.0)
    assert claim is not None
    dead = _Where("postgresql://nobody@127.0.0.1:9/none?connect_timeout=1", pg_store.schema)
    with Keeper(dead, connect_timeout=1) as keeper:
        lease = keeper.add(claim, Timing.of(1.0), time.monotonic())
        assert lease.lost.wait(10)
        assert keeper.stats.errors >= 1
    with pytest.raises(LeaseLostError, match="trust window"):
        lease.check()


def test_one_round_trip_renews_many(pg_store: PostgresStore) -> None:
    with Keeper(pg_store) as keeper:
        leases = []
        for i in range(50):
            rid = pg_store.ensure_resource("job", f"j{i}")
            claim = pg_store.claim(rid, Owner("host", f"w{i % 3}"), 1.5)
            assert claim is not None
            leases.append(keeper.add(claim, Timing.of(1.5), time.monotonic()))
        time.sleep(2.5)
        assert all(lease.lost_error is None for lease in leases)
        assert keeper.stats.last_beat_size == 50
        assert keeper.stats.renewed >= 100
        # Coalesced: far fewer beats than renewals.
        assert keeper.stats.beats <= keeper.stats.renewed / 10


# --------------------------------------------------------------------------- acquire


@pytest.mark.parametrize("fair", [False, True])
def test_acquire_timeout_leaves_nothing(pg_store: PostgresStore, fair: bool) -> None:
    with hold(pg_store, "run", "busy", A, 30) as lease:
        before = pg_store.get(lease.resource_id)
        with pytest.raises(AcquireTimeoutError, match="within"):
            acquire(pg_store, "run", "busy", B, 5, timeout=0.5, fair=fair)
        after = pg_store.get(lease.resource_id)
        assert after.revision == before.revision
        assert after.lease.owner == A
        assert _waiters(pg_store) == 0
        with pytest.raises(AcquireTimeoutError):
            acquire(pg_store, "run", "busy", B, 5, timeout=0, fair=fair)
        assert _waiters(pg_store) == 0


@pytest.mark.parametrize("use_watcher", [True, False])
def test_acquire_wakes_on_release(pg_store: PostgresStore, use_watcher: bool) -> None:
    got: list[tuple[int, float]] = []
    with hold(pg_store, "run", "rel", A, 60) as lease:

        def wait() -> None:
            c = acquire(pg_store, "run", "rel", B, 5, timeout=30, use_watcher=use_watcher)
            got.append((c.generation, time.monotonic()))

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.5)
        released_at = time.monotonic()
    t.join(40)
    assert got and got[0][0] == lease.generation + 1
    # Woken by the release, not by the 60 s expiry.
    assert got[0][1] - released_at < 20


def test_acquire_wakes_at_expiry(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "exp")
    holder = pg_store.claim(rid, A, 1.0)
    assert holder is not None
    claim = acquire(pg_store, "run", "exp", B, 5, timeout=30)
    assert claim.generation == holder.generation + 1
    state = pg_store.get(rid)
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
                while _waiters(stores[0]) < n and time.monotonic() < end:
                    time.sleep(0.02)
            assert _waiters(stores[0]) == 4
            assert first.generation == 1
        for t in threads:
            t.join(60)
        assert order == [1, 2, 3, 4]
        assert _waiters(stores[0]) == 0
    finally:
        for s in stores:
            s.close()


# --------------------------------------------------------------------------- election


def test_election_hand_over_and_query(pg_dsn: str, schema: str) -> None:
    log: list[str] = []
    with PostgresStore(pg_dsn, schema=schema) as s1, PostgresStore(pg_dsn, schema=schema) as s2:
        assert leader(s1, "sched") is None
        e1 = elect(
            s1, "sched", A, ttl=1.0,
            on_elected=lambda lease: log.append(f"a+{lease.generation}"),
            on_deposed=lambda lease: log.append(f"a-{lease.generation}"),
        )  # fmt: skip
        assert e1.wait_elected(20)
        now = leader(s1, "sched")
        assert now is not None and now.owner == A and now.generation == 1
        e2 = elect(
            s2, "sched", B, ttl=1.0,
            on_elected=lambda lease: log.append(f"b+{lease.generation}"),
            on_deposed=lambda lease: log.append(f"b-{lease.generation}"),
        )  # fmt: skip
        time.sleep(1.5)  # several ttls: a's keeper keeps it leader
        assert e1.is_leader and not e2.is_leader
        e1.stop()  # resigns: b is elected at once (woken by the release)
        assert e2.wait_elected(20)
        now = leader(s2, "sched")
        assert now is not None and now.owner == B and now.generation == 2
        e2.stop()
        assert leader(s2, "sched") is None
    assert log == ["a+1", "a-1", "b+2", "b-2"]
