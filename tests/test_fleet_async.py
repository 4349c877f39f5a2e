"""Asyncio twins of the fleet runtime, on real PostgreSQL (and SQLite where a
test takes `astore`)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pglease import AcquireTimeoutError, AsyncPostgresStore, LeaseLostError, Owner
from pglease.clock import FakeClock
from pglease.errors import InvalidTimingError
from pglease.runtime import AsyncKeeper, acquire_async, elect_async, hold_async, leader_async

from ._pg_where import PgWhere
from ._runtime_stores import astore, queued

__all__ = ["astore"]  # a fixture: the tests taking `astore` run on PostgreSQL and SQLite

A = Owner("host", "a")
B = Owner("host", "b")
FAR = datetime.now(UTC) + timedelta(days=1)


async def test_hold_async_heartbeats_and_releases(astore: Any) -> None:
    # Real time, ttl 6 s: a stall of a loaded host for a few seconds must not lose it.
    async with hold_async(astore, "run", "r1", A, 6.0) as lease:
        revision = lease.claim.revision
        end = time.monotonic() + 60
        while lease.renewals < 1:
            assert time.monotonic() < end and not lease.lost.is_set()
            await asyncio.sleep(0.05)
        lease.check()
        state = await astore.get(lease.resource_id)
        assert state.lease.held and state.revision == revision
    state = await astore.get(lease.resource_id)
    assert not state.lease.held
    assert lease.lost.is_set()


async def test_hold_async_takeover_signals(astore: Any) -> None:
    seen: list[LeaseLostError] = []
    clock = FakeClock()
    keeper = AsyncKeeper(astore, clock=clock)
    try:
        with pytest.raises(LeaseLostError, match="left after the loss"):
            async with hold_async(
                astore, "run", "r2", A, 30, on_lost=seen.append, keeper=keeper
            ) as lease:
                assert await astore.claim(lease.resource_id, B, 60, now=FAR) is not None
                clock.advance(lease.timing.interval)  # the next beat is due
                assert await lease.wait_lost(30)
                with pytest.raises(LeaseLostError, match="no longer has it"):
                    lease.check()
    finally:
        await keeper.aclose()
    assert len(seen) == 1


async def test_async_trust_window_closes_on_the_fake_clock(
    astore: Any,
) -> None:
    clock = FakeClock()
    seen: list[LeaseLostError] = []
    keeper = AsyncKeeper(astore, clock=clock)
    try:
        with pytest.raises(LeaseLostError, match="trust window"):
            async with hold_async(
                astore, "run", "tw", A, 30, on_lost=seen.append, keeper=keeper
            ) as lease:
                await asyncio.sleep(0.2)  # real time only: still trusted
                lease.check()
                clock.advance(30 - lease.timing.margin)  # in one jump: no beat between
                assert await lease.wait_lost(30)
                assert lease.lost_at is not None and lease.lost_at >= lease.deadline
                # The database would have kept it for most of the real ttl (the
                # keeper then gives the locally lost lease back).
                assert lease.expires_at > datetime.now(UTC) + timedelta(seconds=15)
                lease.check()
    finally:
        await keeper.aclose()
    assert len(seen) == 1 and lease.renewals == 0


async def test_async_trust_window_closes_without_database(apg_store: AsyncPostgresStore) -> None:
    rid = await apg_store.ensure_resource("run", "r3")
    claim = await apg_store.claim(rid, A, 1.0)
    assert claim is not None

    from pglease.runtime import Timing

    dead = PgWhere(
        "postgresql://nobody@127.0.0.1:9/none?connect_timeout=1", apg_store.schema, is_async=True
    )
    keeper = AsyncKeeper(dead, connect_timeout=1)
    try:
        lease = keeper.add(claim, Timing.of(1.0), time.monotonic())
        assert await lease.wait_lost(10)
        with pytest.raises(LeaseLostError, match="trust window"):
            lease.check()
    finally:
        await keeper.aclose()


async def test_bad_timing_async(astore: Any) -> None:
    with pytest.raises(InvalidTimingError):
        async with hold_async(astore, "run", "t", A, 1.0, margin=0.5):
            pass


@pytest.mark.parametrize("fair", [False, True])
async def test_acquire_async_timeout_and_cancel_leave_nothing(astore: Any, fair: bool) -> None:
    async with hold_async(astore, "run", "busy", A, 30) as lease:
        before = await astore.get(lease.resource_id)
        with pytest.raises(AcquireTimeoutError):
            await acquire_async(astore, "run", "busy", B, 5, timeout=0.5, fair=fair)
        assert queued(astore) == 0
        task = asyncio.ensure_future(acquire_async(astore, "run", "busy", B, 5, fair=fair))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert queued(astore) == 0
        after = await astore.get(lease.resource_id)
        assert after.revision == before.revision and after.lease.owner == A


async def test_acquire_async_wakes_on_release(astore: Any) -> None:
    async with hold_async(astore, "run", "rel", A, 60) as lease:
        waiter = asyncio.ensure_future(acquire_async(astore, "run", "rel", B, 5, timeout=30))
        await asyncio.sleep(0.5)
        released_at = time.monotonic()
    claim = await waiter
    assert claim.generation == lease.generation + 1
    assert time.monotonic() - released_at < 20  # the release woke it, not the 60 s expiry


@pytest.mark.parametrize("release_on_cancel", [False, True])
async def test_cancelled_holder(astore: Any, release_on_cancel: bool) -> None:
    entered = asyncio.Event()
    leases = []

    async def body() -> None:
        async with hold_async(
            astore, "run", "c", A, 2.0, release_on_cancel=release_on_cancel
        ) as lease:
            leases.append(lease)
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.ensure_future(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    lease = leases[0]
    assert lease.lost.is_set()
    state = await astore.get(lease.resource_id)
    # Opt-in release; otherwise the lease is abandoned and runs out by itself.
    assert state.lease.held is (not release_on_cancel)


async def test_async_election(astore: Any) -> None:
    log: list[str] = []
    e1 = await elect_async(
        astore, "sched", A, ttl=6.0,
        on_elected=lambda x: log.append(f"a+{x.generation}"),
        on_deposed=lambda x: log.append(f"a-{x.generation}"),
    )  # fmt: skip
    assert await e1.wait_elected(20)
    e2 = await elect_async(
        astore, "sched", B, ttl=6.0,
        on_elected=lambda x: log.append(f"b+{x.generation}"),
        on_deposed=lambda x: log.append(f"b-{x.generation}"),
    )  # fmt: skip
    await asyncio.sleep(1.2)
    assert e1.is_leader and not e2.is_leader
    await e1.stop()
    assert await e2.wait_elected(20)
    now = await leader_async(astore, "sched")
    assert now is not None and now.owner == B and now.generation == 2
    await e2.stop()
    assert await leader_async(astore, "sched") is None
    assert log == ["a+1", "a-1", "b+2", "b-2"]


@pytest.mark.parametrize("fair", [False, True])
async def test_acquire_async_ends_when_its_stop_event_is_set(astore: Any, fair: bool) -> None:
    # The stop flag elections campaign with: the wait ends with
    # AcquireTimeoutError, leaving no queue entry and the holder untouched.
    from pglease.runtime.acquire import _acquire_async

    async with hold_async(astore, "run", "stopped", A, 30) as lease:
        before = await astore.get(lease.resource_id)
        stop = asyncio.Event()
        waiter = asyncio.ensure_future(
            _acquire_async(astore, "run", "stopped", B, 5, None, fair, True, stop=stop)
        )
        await asyncio.sleep(0.3)
        assert not waiter.done()
        stop.set()
        with pytest.raises(AcquireTimeoutError, match="acquire stopped"):
            await asyncio.wait_for(waiter, 30)
        assert queued(astore) == 0
        after = await astore.get(lease.resource_id)
        assert after.revision == before.revision and after.lease.owner == A


async def test_async_election_start_is_idempotent_and_stop_ends_a_campaign(
    astore: Any,
) -> None:
    e = await elect_async(astore, "twice", A, ttl=6.0)
    assert await e.start() is e  # a second start starts no second campaign
    assert await e.wait_elected(20)
    e2 = await elect_async(astore, "twice", B, ttl=6.0, fair=True)
    await asyncio.sleep(0.3)
    assert not e2.is_leader
    await e2.stop(timeout=20)  # still campaigning: the wait ends, its queue entry goes
    assert queued(astore) == 0
    now = await leader_async(astore, "twice")
    assert e.is_leader and now is not None and now.owner == A
    await e.stop()
    assert await leader_async(astore, "twice") is None
