"""The fleet runtime's conformance suite: hold, acquire (fair too), elect and
leader behave alike on every store, PostgreSQL and SQLite, sync and asyncio.

The runtime reaches a backend only through its runtime driver
(`store.runtime_driver()`), so one set of test bodies runs against the four
stores. Real PostgreSQL, real SQLite files; time that decides an outcome is
driven by a `FakeClock` where it can be, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from pglease import (
    AcquireTimeoutError,
    InvalidTTLError,
    LeaseLostError,
    Owner,
    resource_id,
)
from pglease.clock import FakeClock

from .._runtime_stores import astore, queued, store

__all__ = ["astore", "store"]  # fixtures, used by name

A = Owner("host", "a")
B = Owner("host", "b")
C = Owner("host", "c")
D = Owner("host", "d")


def eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


async def aeventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- sync


def test_hold_renews_without_changing_the_resource_and_releases(store: Any) -> None:
    clock = FakeClock()
    rid = resource_id("run", "beat")
    with store.hold("run", "beat", A, 3.0, clock=clock) as lease:
        before = store.get(rid)
        assert before.lease.owner == A and before.lease.generation == lease.generation == 1
        clock.advance(1.1)  # past the renew interval (ttl/3)
        eventually(lambda: lease.renewals >= 1)
        after = store.get(rid)
        # A heartbeat extends the expiry only: no revision bump, no event.
        assert after.revision == before.revision
        assert after.lease.generation == 1 and after.lease.held
        assert after.lease.expires_at is not None and before.lease.expires_at is not None
        assert after.lease.expires_at > before.lease.expires_at
        lease.check()
    state = store.get(rid)
    assert not state.lease.held and state.lease.generation == 1
    assert [e.type for e in store.events(rid)] == ["lease.claimed", "lease.released"]


def test_hold_is_lost_when_its_lease_expires_and_is_taken_over(store: Any) -> None:
    clock = FakeClock()  # frozen: no beat is due, so the lease runs out in the database
    with (
        pytest.raises(LeaseLostError, match="no longer has it"),
        store.hold("run", "exp", A, 1.0, clock=clock) as lease,
    ):
        # Woken at the holder's expiry (judged by the store's clock).
        rival = store.acquire("run", "exp", B, 60, timeout=30)
        assert rival.generation == lease.generation + 1
        clock.advance(0.4)  # a beat is due: the database says the lease is gone
        assert lease.lost.wait(30)
        with pytest.raises(LeaseLostError, match="current generation 2"):
            lease.check()
    state = store.get(resource_id("run", "exp"))
    assert state.lease.owner == B and state.lease.generation == 2  # untouched by A's exit


def test_hold_is_lost_when_its_trust_window_closes(store: Any) -> None:
    clock = FakeClock()
    with (
        pytest.raises(LeaseLostError, match="trust window"),
        store.hold("run", "trust", A, 30.0, interval=10.0, clock=clock) as lease,
    ):
        clock.advance(31.0)  # past ttl - margin without a renewal on the keeper's clock
        assert lease.lost.wait(30)


def test_acquire_is_woken_by_the_release(store: Any) -> None:
    rid = store.ensure_resource("run", "wake")
    first = store.claim(rid, A, 600)  # would run out long after the waiter's timeout
    assert first is not None
    got: list[Any] = []
    waiter = threading.Thread(
        target=lambda: got.append(store.acquire("run", "wake", B, 60, timeout=60))
    )
    waiter.start()
    eventually(lambda: store.get(rid).lease.owner == A)
    time.sleep(0.2)  # let the waiter reach its wait (the outcome does not depend on it)
    store.release(first)
    waiter.join(90)
    assert not waiter.is_alive() and got and got[0].generation == 2
    assert store.get(rid).lease.owner == B


def test_acquire_times_out_and_leaves_nothing(store: Any) -> None:
    rid = store.ensure_resource("run", "busy")
    assert store.claim(rid, A, 600) is not None
    with pytest.raises(AcquireTimeoutError, match=r"within 0\.3s"):
        store.acquire("run", "busy", B, 60, timeout=0.3)
    with pytest.raises(AcquireTimeoutError, match="fair queue entry removed"):
        store.acquire("run", "busy", B, 60, timeout=0.3, fair=True)
    assert queued(store, rid) == 0
    assert store.get(rid).lease.owner == A


def test_acquire_refuses_bad_input_before_writing(store: Any) -> None:
    with pytest.raises(InvalidTTLError):
        store.acquire("run", "bad", A, -1, timeout=1)
    assert store.list_resources() == []


def test_fair_acquire_serves_waiters_in_arrival_order(store: Any) -> None:
    rid = store.ensure_resource("run", "fair")
    first = store.claim(rid, A, 600)
    assert first is not None
    order: list[str] = []

    def wait(owner: Owner) -> None:
        claim = store.acquire("run", "fair", owner, 60, timeout=60, fair=True)
        order.append(owner.id)
        store.release(claim)

    threads = []
    for n, owner in enumerate([B, C, D], start=1):
        thread = threading.Thread(target=wait, args=(owner,))
        thread.start()
        threads.append(thread)
        eventually(lambda n=n: queued(store, rid) == n)  # type: ignore[misc]
    store.release(first)
    for thread in threads:
        thread.join(90)
    assert order == ["b", "c", "d"]
    assert queued(store, rid) == 0


def test_elect_leader_and_resign(store: Any) -> None:
    deposed: list[int] = []
    a = store.elect("sched", A, ttl=3, on_deposed=lambda lease: deposed.append(lease.generation))
    try:
        assert a.wait_elected(30)
        b = store.elect("sched", B, ttl=3)
        try:
            leader = store.leader("sched")
            assert leader is not None and leader.owner == A and leader.generation == 1
            assert not b.is_leader
            a.stop(resign=True)
            assert deposed == [1]
            assert b.wait_elected(30)
            leader = store.leader("sched")
            assert leader is not None and leader.owner == B and leader.generation == 2
        finally:
            b.stop()
    finally:
        a.stop()
    assert store.leader("sched") is None
    assert store.leader("never-held") is None


# --------------------------------------------------------------------------- asyncio


async def test_async_hold_renews_without_changing_the_resource(astore: Any) -> None:
    clock = FakeClock()
    rid = resource_id("run", "beat")
    async with astore.hold("run", "beat", A, 3.0, clock=clock) as lease:
        before = await astore.get(rid)
        clock.advance(1.1)
        await aeventually(lambda: lease.renewals >= 1)
        after = await astore.get(rid)
        assert after.revision == before.revision and after.lease.generation == 1
        assert after.lease.expires_at > before.lease.expires_at
    assert not (await astore.get(rid)).lease.held


async def test_async_hold_is_lost_when_its_lease_expires(astore: Any) -> None:
    clock = FakeClock()
    with pytest.raises(LeaseLostError, match="no longer has it"):
        async with astore.hold("run", "exp", A, 1.0, clock=clock) as lease:
            rival = await astore.acquire("run", "exp", B, 60, timeout=30)
            assert rival.generation == lease.generation + 1
            clock.advance(0.4)
            assert await lease.wait_lost(30)
    state = await astore.get(resource_id("run", "exp"))
    assert state.lease.owner == B and state.lease.generation == 2


async def test_async_acquire_is_woken_by_the_release(astore: Any) -> None:
    rid = await astore.ensure_resource("run", "wake")
    first = await astore.claim(rid, A, 600)
    assert first is not None
    waiter = asyncio.ensure_future(astore.acquire("run", "wake", B, 60, timeout=60))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await astore.release(first)
    claim = await asyncio.wait_for(waiter, 90)
    assert claim.generation == 2 and (await astore.get(rid)).lease.owner == B


async def test_async_acquire_times_out_and_leaves_nothing(astore: Any) -> None:
    rid = await astore.ensure_resource("run", "busy")
    assert await astore.claim(rid, A, 600) is not None
    with pytest.raises(AcquireTimeoutError):
        await astore.acquire("run", "busy", B, 60, timeout=0.3, fair=True)
    assert queued(astore, rid) == 0


async def test_async_fair_acquire_serves_waiters_in_arrival_order(astore: Any) -> None:
    rid = await astore.ensure_resource("run", "fair")
    first = await astore.claim(rid, A, 600)
    assert first is not None
    order: list[str] = []

    async def wait(owner: Owner) -> None:
        claim = await astore.acquire("run", "fair", owner, 60, timeout=60, fair=True)
        order.append(owner.id)
        await astore.release(claim)

    tasks = []
    for n, owner in enumerate([B, C, D], start=1):
        tasks.append(asyncio.ensure_future(wait(owner)))
        end = time.monotonic() + 30
        while queued(astore, rid) != n:
            assert time.monotonic() < end, "waiter not queued in time"
            await asyncio.sleep(0.02)
    await astore.release(first)
    await asyncio.wait_for(asyncio.gather(*tasks), 90)
    assert order == ["b", "c", "d"]


async def test_async_elect_leader_and_resign(astore: Any) -> None:
    deposed: list[int] = []
    a = await astore.elect("sched", A, ttl=3, on_deposed=lambda ls: deposed.append(ls.generation))
    b = None
    try:
        assert await a.wait_elected(30)
        b = await astore.elect("sched", B, ttl=3)
        leader = await astore.leader("sched")
        assert leader is not None and leader.owner == A and leader.generation == 1
        await a.stop(resign=True)
        assert deposed == [1]
        assert await b.wait_elected(30)
        leader = await astore.leader("sched")
        assert leader is not None and leader.owner == B and leader.generation == 2
    finally:
        if b is not None:
            await b.stop()
        await a.stop()
    assert await astore.leader("sched") is None
