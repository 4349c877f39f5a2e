"""The fleet runtime on a `FakeClock`, against real PostgreSQL.

The clock decides (due times, lateness, trust windows, acquire deadlines,
room linger); waits stay real. Each test moves the fake clock by hand and
then waits, with a generous real bound, for the component to act at its next
wake-up (`FAKE_CLOCK_TICK`). No test depends on how fast the host is: the
database leases are long, and nothing happens until the test moves the clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pglease import AcquireTimeoutError, LeaseLostError, Owner, PostgresStore
from pglease.clock import FakeClock
from pglease.runtime import Keeper, Timing, acquire, elect, hold
from pglease.runtime._rooms import LINGER, RoomCore, _sync_rooms

from ._runtime_stores import queued, store

__all__ = ["store"]  # a fixture: the tests taking `store` run on PostgreSQL and SQLite

A = Owner("host", "a")
B = Owner("host", "b")
FAR = datetime.now(UTC) + timedelta(days=1)
TTL = 30.0  # interval 10, margin 3: the trust window closes 27 s after the claim
TIMING = Timing.of(TTL)


def _eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def keeper(pg_store: PostgresStore, clock: FakeClock) -> Iterator[Keeper]:
    with Keeper(pg_store, clock=clock) as k:
        yield k


@pytest.fixture
def rkeeper(store: Any, clock: FakeClock) -> Iterator[Keeper]:
    """A keeper on the fake clock for `store` (PostgreSQL or SQLite)."""
    with Keeper(store, clock=clock) as k:
        yield k


# --------------------------------------------------------------------------- trust window


def test_trust_window_closes_on_the_fake_clock(
    store: Any, clock: FakeClock, rkeeper: Keeper
) -> None:
    """Lost (event, callback, check) once the fake clock passes ttl - margin,
    while the database lease still has most of its real ttl left."""
    seen: list[LeaseLostError] = []
    with (
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(store, "run", "tw", A, TTL, keeper=rkeeper, on_lost=seen.append) as lease,
    ):
        assert lease.clock is clock
        assert lease.deadline == pytest.approx(clock.monotonic() + TTL - TIMING.margin)
        time.sleep(0.2)  # real time passes (several wake-ups), the clock does not
        assert not lease.lost.is_set() and seen == []
        lease.check()
        # One jump to the close: no beat could run in between (a stalled host).
        clock.advance(TTL - TIMING.margin)
        assert lease.lost.wait(30)
        assert len(seen) == 1 and "trust window" in str(seen[0])
        assert lease.lost_at is not None and lease.lost_at >= lease.deadline
        with pytest.raises(LeaseLostError, match="trust window"):
            lease.check()
        # The database would have kept it for most of the real ttl.
        assert lease.expires_at > datetime.now(UTC) + timedelta(seconds=TTL / 2)
    assert rkeeper.stats.renewed == 0


def test_row_locked_until_the_window_closes_is_lost_locally(
    pg_store: PostgresStore, clock: FakeClock, keeper: Keeper
) -> None:
    """Beats find the row locked ('busy') and are retried; the trust window then
    closes at its instant on the clock, although the database still has it."""
    with (
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(pg_store, "run", "busy", A, TTL, keeper=keeper) as lease,
        psycopg.connect(pg_store.dsn) as blocker,
    ):
        blocker.execute(
            f'SELECT 1 FROM "{pg_store.schema}".leases WHERE resource_id = %s FOR UPDATE',
            [lease.resource_id],
        )
        before = keeper.stats.beats
        clock.advance(TIMING.interval)
        _eventually(lambda: keeper.stats.beats > before)  # answered 'busy'
        assert lease.renewals == 0 and not lease.lost.is_set()
        clock.advance(TTL - TIMING.margin - TIMING.interval)
        assert lease.lost.wait(30)
        assert lease.lost_at is not None and lease.lost_at >= lease.deadline
        blocker.rollback()
        with pytest.raises(LeaseLostError, match="trust window"):
            lease.check()


def test_takeover_is_reported_by_the_next_beat(
    store: Any, clock: FakeClock, rkeeper: Keeper
) -> None:
    with (
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(store, "run", "take", A, TTL, keeper=rkeeper) as lease,
    ):
        assert store.claim(lease.resource_id, B, 60, now=FAR) is not None
        time.sleep(0.2)  # the clock stands still: no beat, nobody knows
        assert not lease.lost.is_set()
        clock.advance(TIMING.interval)
        assert lease.lost.wait(30)
        with pytest.raises(LeaseLostError, match="no longer has it"):
            lease.check()
    state = store.get(lease.resource_id)
    assert state.lease.owner == B and state.lease.generation == 2


# --------------------------------------------------------------------------- beats


def test_beats_follow_the_clock_and_keep_the_revision(
    store: Any, clock: FakeClock, rkeeper: Keeper
) -> None:
    with hold(store, "run", "hb", A, TTL, keeper=rkeeper) as lease:
        rid, revision = lease.resource_id, lease.claim.revision
        expiries = [lease.expires_at]
        for n in range(1, 4):
            clock.advance(TIMING.interval)
            _eventually(lambda n=n: lease.renewals >= n)  # type: ignore[misc]
            expiries.append(lease.expires_at)
        assert expiries == sorted(expiries) and len(set(expiries)) == 4
        # Each renewal moved the window: three intervals later it is still open.
        lease.check()
        assert lease.deadline == pytest.approx(clock.monotonic() + TTL - TIMING.margin)
        state = store.get(rid)
        assert state.lease.held and state.revision == revision
        assert [e.type for e in store.events(rid)] == ["lease.claimed"]
        result = store.mutate(lease.permit(revision), "run.step", payload={"n": 1})
        assert result.revision == revision + 1
    assert not store.get(rid).lease.held
    assert rkeeper.stats.late_beats == 0


def test_late_beat_is_counted_and_logged(
    store: Any,
    clock: FakeClock,
    rkeeper: Keeper,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pglease.runtime")
    with hold(store, "run", "late", A, TTL, keeper=rkeeper) as lease:
        # Due at +10; seen at +16: 6 s late, past late_after (5 s) and still
        # inside the trust window (27 s).
        clock.advance(TIMING.interval + TIMING.late_after + 1.0)
        _eventually(lambda: lease.renewals == 1)
        assert rkeeper.stats.late_beats == 1
        late = [r for r in caplog.records if "heartbeat late by" in r.getMessage()]
        assert len(late) == 1 and "late by 6.000s" in late[0].getMessage()
        # An on-time beat afterwards is not late.
        clock.advance(TIMING.interval)
        _eventually(lambda: lease.renewals == 2)
        assert rkeeper.stats.late_beats == 1
        lease.check()


def test_one_round_trip_renews_many(store: Any, clock: FakeClock, rkeeper: Keeper) -> None:
    rkeeper.connect()
    leases = []
    for i in range(50):
        rid = store.ensure_resource("job", f"j{i}")
        claim = store.claim(rid, Owner("host", f"w{i % 3}"), TTL)
        assert claim is not None
        leases.append(rkeeper.add(claim, TIMING, clock.monotonic()))
    for n in (1, 2):
        clock.advance(TIMING.interval)
        _eventually(lambda n=n: rkeeper.stats.renewed == 50 * n)  # type: ignore[misc]
        # Due at the same instant: one beat for all fifty.
        assert rkeeper.stats.beats == n and rkeeper.stats.last_beat_size == 50
    assert all(lease.lost_error is None for lease in leases)


def test_keeper_reconnects_after_its_backend_is_terminated(
    pg_store: PostgresStore, clock: FakeClock, keeper: Keeper
) -> None:
    from pglease.postgres.runtime import application_name

    def backends() -> list[int]:
        with pg_store.connection() as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                [application_name(pg_store.schema)],
            ).fetchall()
        return [int(r[0]) for r in rows]

    with hold(pg_store, "run", "kill", A, TTL, keeper=keeper) as lease:
        clock.advance(TIMING.interval)
        _eventually(lambda: lease.renewals == 1)
        [pid] = backends()
        with pg_store.connection() as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", [pid])
        _eventually(lambda: pid not in backends())
        clock.advance(TIMING.interval)
        # The beat on the dead connection fails; its retry is due a moment later
        # on the clock, and runs on a new connection.
        end = time.monotonic() + 30
        errors = 0
        while lease.renewals < 2:
            assert time.monotonic() < end, "never renewed again"
            if keeper.stats.errors > errors:
                errors = keeper.stats.errors
                clock.advance(1.0)  # the retry is due
            time.sleep(0.02)
        assert lease.lost_error is None
        lease.check()
        now = backends()
        assert len(now) == 1 and now[0] != pid
    state = pg_store.get(lease.resource_id)
    assert not state.lease.held and state.lease.generation == 1


# --------------------------------------------------------------------------- acquire


@pytest.mark.parametrize(("fair", "use_watcher"), [(False, True), (True, True), (False, False)])
def test_acquire_times_out_on_the_fake_clock(
    store: Any, clock: FakeClock, fair: bool, use_watcher: bool
) -> None:
    rid = store.ensure_resource("run", "wait")
    holder = store.claim(rid, A, 600)
    assert holder is not None
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            acquire(store, "run", "wait", B, 5, timeout=5, fair=fair,
                    use_watcher=use_watcher, clock=clock)  # fmt: skip
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    if fair:
        _eventually(lambda: queued(store) == 1)
    time.sleep(0.3)  # real time passes, the fake clock does not: still waiting
    assert t.is_alive()
    clock.advance(5.0)
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], AcquireTimeoutError), errors
    assert queued(store) == 0
    assert store.get(rid).lease.owner == A


def test_held_lease_trusts_from_the_claim_on_the_acquire_clock(
    store: Any, clock: FakeClock, rkeeper: Keeper
) -> None:
    clock.advance(123.0)
    with hold(store, "run", "start", A, TTL, keeper=rkeeper) as lease:
        assert lease.deadline == pytest.approx(1123.0 + TTL - TIMING.margin)
        assert lease.next_due == pytest.approx(1123.0 + TIMING.interval)


def test_hold_refuses_a_clock_other_than_its_keepers(store: Any, rkeeper: Keeper) -> None:
    from pglease import ValidationError

    with (
        pytest.raises(ValidationError, match="keeper's clock"),
        hold(store, "run", "x", A, TTL, keeper=rkeeper, clock=FakeClock()),
    ):
        pass
    assert store.list_resources() == []


# --------------------------------------------------------------------------- rooms


def test_room_core_lingers_on_its_clock() -> None:
    clock = FakeClock()
    core = RoomCore(clock)
    member = core.join(threading.Event(), fair=False)
    clock.advance(LINGER * 10)
    assert not core.retire_due()  # has a member
    core.leave(member, won=True)
    clock.advance(LINGER - 0.01)
    assert not core.retire_due()
    clock.advance(0.02)
    assert core.retire_due()


def test_room_lingers_until_the_fake_clock_moves(pg_store: PostgresStore, clock: FakeClock) -> None:
    rid = pg_store.ensure_resource("linger", "k")
    holder = pg_store.claim(rid, A, 60)
    assert holder is not None
    got: list[int] = []
    t = threading.Thread(
        target=lambda: got.append(
            acquire(pg_store, "linger", "k", B, 5, timeout=60, clock=clock).generation
        ),
        daemon=True,
    )
    t.start()
    _eventually(lambda: any(k[3] == rid and k[4] is clock for k in _sync_rooms))
    pg_store.release(holder)
    t.join(30)
    assert got == [holder.generation + 1]
    # Empty now. Real time passes (more than LINGER, several of the room's
    # wake-ups) but its clock does not: it stays subscribed.
    time.sleep(LINGER * 1.5)
    assert any(k[3] == rid and k[4] is clock for k in _sync_rooms)
    clock.advance(LINGER)
    _eventually(lambda: not any(k[3] == rid for k in _sync_rooms))


# --------------------------------------------------------------------------- election


def test_election_deposed_when_the_window_closes_then_reelected(
    store: Any, clock: FakeClock, rkeeper: Keeper
) -> None:
    log: list[str] = []
    election = elect(
        store, "sched", A, ttl=TTL, keeper=rkeeper,
        on_elected=lambda lease: log.append(f"+{lease.generation}"),
        on_deposed=lambda lease: log.append(f"-{lease.generation}"),
    )  # fmt: skip
    try:
        assert election.wait_elected(30)
        assert log == ["+1"]
        clock.advance(TTL)  # no beat got through in time: the window closed
        # Deposed; the keeper gives the lost lease back, and the candidate,
        # campaigning again, wins the next term.
        _eventually(lambda: log == ["+1", "-1", "+2"])
        assert election.is_leader
    finally:
        election.stop()
    assert log == ["+1", "-1", "+2", "-2"]
