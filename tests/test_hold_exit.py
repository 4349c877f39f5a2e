"""Leaving a `hold` block after the lease was lost raises `LeaseLostError`.

Takeovers either pretend a day passed (`now=` on the rival's claim) or happen
for real: the holder's keeper is cut off from the database (a partition: its
connection freezes, new ones are refused), its trust window closes, and a
rival claims once the ttl ran out by the database clock. Where the holder's
own timing matters, a `FakeClock` drives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from datetime import UTC, datetime, timedelta

import pytest

from pglease import AsyncPostgresStore, LeaseLostError, Owner, PostgresStore
from pglease.clock import FakeClock
from pglease.runtime import AsyncKeeper, Keeper, Timing, acquire, acquire_async, hold, hold_async

from ._fleet_proxy import FreezingProxy
from ._pg_where import PgWhere

A = Owner("host", "a")
B = Owner("host", "b")
FAR = datetime.now(UTC) + timedelta(days=1)
#: Fake-clock leases: interval 10 s, the trust window closes 27 s after a renewal.
TTL = 30.0


class _Partition(FreezingProxy):
    """A proxy that can cut its clients off: open connections freeze and new
    ones are refused (the port no longer listens)."""

    def __enter__(self) -> _Partition:
        return self

    def cut(self) -> None:
        self._stop.set()
        # shutdown, not just close: it wakes the blocked accept() and stops
        # listening at once (a plain close leaves the accepting thread's socket up).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.freeze()


# --------------------------------------------------------------------------- sync


def test_release_finding_the_lease_gone_raises(pg_store: PostgresStore) -> None:
    """Taken over between beats (ttl 30: the next beat is 10 s away), so only the
    release on exit finds out; that must not look like success."""
    with (
        pytest.raises(LeaseLostError, match="no longer had it at release") as caught,
        hold(pg_store, "run", "x1", A, 30) as lease,
    ):
        assert pg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
    assert isinstance(caught.value.__cause__, LeaseLostError)
    assert lease.lost.is_set()
    state = pg_store.get(lease.resource_id)
    assert state.lease.owner == B and state.lease.generation == 2


def test_body_error_wins_over_the_loss(pg_store: PostgresStore) -> None:
    boom = ValueError("the body's own failure")
    with pytest.raises(ValueError) as caught, hold(pg_store, "run", "x2", A, 30) as lease:
        assert pg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
        raise boom
    assert caught.value is boom
    assert any("is lost" in note for note in getattr(boom, "__notes__", []))


def test_body_reraising_the_loss_is_not_wrapped(pg_store: PostgresStore) -> None:
    clock = FakeClock()
    with (
        Keeper(pg_store, clock=clock) as keeper,
        pytest.raises(LeaseLostError) as caught,
        hold(pg_store, "run", "x3", A, TTL, keeper=keeper) as lease,
    ):
        assert pg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
        clock.advance(Timing.of(TTL).interval)  # the next beat finds it taken
        assert lease.lost.wait(30)
        lease.check()
    assert caught.value is lease.lost_error
    assert not getattr(caught.value, "__notes__", None)


def test_real_expiry_and_takeover_raises(pg_store: PostgresStore) -> None:
    """No pretend clock: the keeper is cut off, the trust window closes, and a
    rival claims after the real ttl; the holder's body then ends."""
    ttl = 1.0
    with (
        _Partition(pg_store.dsn) as proxy,
        Keeper(PgWhere(proxy.dsn, pg_store.schema), connect_timeout=1) as keeper,
        pytest.raises(LeaseLostError, match="trust window") as caught,
        hold(pg_store, "run", "x4", A, ttl, keeper=keeper) as lease,
    ):
        proxy.cut()
        assert lease.lost.wait(30), "the watchdog closes the trust window"
        # Woken at the expiry by the database clock; bounded, not timed.
        rival = acquire(pg_store, "run", "x4", B, 60, timeout=30)
        assert rival.generation == lease.generation + 1
    assert isinstance(caught.value.__cause__, LeaseLostError)
    assert pg_store.get(lease.resource_id).lease.owner == B


def test_trust_window_closed_unnoticed_raises_and_releases(pg_store: PostgresStore) -> None:
    """The body outlived its trust window and nobody looked (no keeper thread
    running): leaving still raises, and the lease, still in the database, is
    given back."""
    clock = FakeClock()
    keeper = Keeper(pg_store, clock=clock)
    keeper.close()  # stopped: neither renews nor watches
    keeper._closed = False  # accepts the lease all the same
    try:
        with (
            pytest.raises(LeaseLostError, match="trust window"),
            hold(pg_store, "run", "x5", A, TTL, keeper=keeper) as lease,
        ):
            clock.advance(TTL)
            time.sleep(0.2)  # a running keeper would have noticed by now
            assert lease.lost_error is None  # no thread noticed
    finally:
        keeper.close()
    assert not pg_store.get(lease.resource_id).lease.held


# --------------------------------------------------------------------------- asyncio


async def test_async_release_finding_the_lease_gone_raises(
    apg_store: AsyncPostgresStore,
) -> None:
    with pytest.raises(LeaseLostError, match="no longer had it at release"):
        async with hold_async(apg_store, "run", "y1", A, 30) as lease:
            assert await apg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
    assert lease.lost.is_set()


async def test_async_keeper_notices_takeover_then_exit_raises(
    apg_store: AsyncPostgresStore,
) -> None:
    clock = FakeClock()
    keeper = AsyncKeeper(apg_store, clock=clock)
    try:
        with pytest.raises(LeaseLostError, match="left after the loss"):
            async with hold_async(apg_store, "run", "y2", A, TTL, keeper=keeper) as lease:
                assert await apg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
                clock.advance(Timing.of(TTL).interval)
                assert await lease.wait_lost(30)
    finally:
        await keeper.aclose()


async def test_async_body_error_wins_over_the_loss(apg_store: AsyncPostgresStore) -> None:
    boom = KeyError("body")
    with pytest.raises(KeyError) as caught:
        async with hold_async(apg_store, "run", "y3", A, 30) as lease:
            assert await apg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
            raise boom
    assert caught.value is boom
    assert any("is lost" in note for note in getattr(boom, "__notes__", []))


async def test_async_real_expiry_and_takeover_raises(apg_store: AsyncPostgresStore) -> None:
    with _Partition(apg_store.dsn) as proxy:
        keeper = AsyncKeeper(PgWhere(proxy.dsn, apg_store.schema, is_async=True), connect_timeout=1)
        try:
            with pytest.raises(LeaseLostError, match="trust window"):
                async with hold_async(apg_store, "run", "y4", A, 1.0, keeper=keeper) as lease:
                    proxy.cut()
                    assert await lease.wait_lost(30)
                    rival = await acquire_async(apg_store, "run", "y4", B, 60, timeout=30)
                    assert rival.generation == lease.generation + 1
        finally:
            await keeper.aclose()


async def test_cancelled_holder_is_not_reported_lost(apg_store: AsyncPostgresStore) -> None:
    """Abandoning the lease on cancellation is the holder's choice, not a loss."""
    entered = asyncio.Event()

    async def body() -> None:
        async with hold_async(apg_store, "run", "y5", A, 5.0):
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.ensure_future(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    assert not getattr(caught.value, "__notes__", None)
