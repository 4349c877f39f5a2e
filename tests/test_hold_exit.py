"""Leaving a `hold` block after the lease was lost raises `LeaseLostError`.

Takeovers either pretend a day passed (`now=` on the rival's claim) or happen
for real: the holder's keeper cannot reach the database, its trust window
closes, and a rival claims once the ttl ran out by the database clock.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest

from pglease import AsyncPostgresStore, LeaseLostError, Owner, PostgresStore
from pglease.fleet import AsyncKeeper, Keeper, acquire, acquire_async, hold, hold_async

A = Owner("host", "a")
B = Owner("host", "b")
FAR = datetime.now(UTC) + timedelta(days=1)
#: Nothing listens there: a keeper pointed at it never renews.
DEAD_DSN = "postgresql://nobody@127.0.0.1:9/none?connect_timeout=1"


class _Dead:
    """Where a keeper that cannot reach its database looks."""

    dsn = DEAD_DSN

    def __init__(self, schema: str) -> None:
        self.schema = schema


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
    with pytest.raises(LeaseLostError) as caught, hold(pg_store, "run", "x3", A, 0.9) as lease:
        assert pg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
        assert lease.lost.wait(10)
        lease.check()
    assert caught.value is lease.lost_error
    assert not getattr(caught.value, "__notes__", None)


def test_real_expiry_and_takeover_raises(pg_store: PostgresStore) -> None:
    """No pretend clock: the keeper cannot renew, the trust window closes, and a
    rival claims after the real ttl; the holder's body then ends."""
    ttl = 1.0
    with (
        Keeper(_Dead(pg_store.schema), connect_timeout=1) as dead,
        pytest.raises(LeaseLostError, match="trust window") as caught,
        hold(pg_store, "run", "x4", A, ttl, keeper=dead) as lease,
    ):
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
    keeper = Keeper(_Dead(pg_store.schema), connect_timeout=1)
    keeper.close()  # stopped: neither renews nor watches
    keeper._closed = False  # accepts the lease all the same
    with (
        pytest.raises(LeaseLostError, match="trust window"),
        hold(pg_store, "run", "x5", A, 0.6, keeper=keeper) as lease,
    ):
        end = time.monotonic() + 30
        while time.monotonic() < lease.deadline and time.monotonic() < end:
            time.sleep(0.05)
        assert lease.lost_error is None  # no thread noticed
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
    with pytest.raises(LeaseLostError, match="left after the loss"):
        async with hold_async(apg_store, "run", "y2", A, 0.9) as lease:
            assert await apg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
            assert await lease.wait_lost(10)


async def test_async_body_error_wins_over_the_loss(apg_store: AsyncPostgresStore) -> None:
    boom = KeyError("body")
    with pytest.raises(KeyError) as caught:
        async with hold_async(apg_store, "run", "y3", A, 30) as lease:
            assert await apg_store.claim(lease.resource_id, B, 60, now=FAR) is not None
            raise boom
    assert caught.value is boom
    assert any("is lost" in note for note in getattr(boom, "__notes__", []))


async def test_async_real_expiry_and_takeover_raises(apg_store: AsyncPostgresStore) -> None:
    dead = AsyncKeeper(_Dead(apg_store.schema), connect_timeout=1)
    try:
        with pytest.raises(LeaseLostError, match="trust window"):
            async with hold_async(apg_store, "run", "y4", A, 1.0, keeper=dead) as lease:
                assert await lease.wait_lost(30)
                rival = await acquire_async(apg_store, "run", "y4", B, 60, timeout=30)
                assert rival.generation == lease.generation + 1
    finally:
        await dead.aclose()


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
