"""`hold` and `acquire` keep their timeout on a stalled path (issue 31 item 4).

Each test puts the store behind the fault-injecting proxy (tests/_stall_proxy.py):
a path that stops forwarding bytes (`pause`), or one that lets a claim reach
the server and holds its answer (`hold_replies_after`). The timeout covers the
keeper's connect, ensuring the resource, the waiting room and each claim round
trip; a step may outlast it by `STEP_GRACE`, then its connection is shut down.
Nothing claimed by then: `AcquireTimeoutError`. A claim sent and unanswered:
`CommitOutcomeUnknownError` with the claim's token. A claim answered after its
trust window is never handed out.

The bounds below are liveness bounds with room for a busy machine: before
this change each of these calls waited for the whole stall.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from pglease import (
    AcquireTimeoutError,
    AsyncPostgresStore,
    Claim,
    CommitOutcomeUnknownError,
    Owner,
    PostgresStore,
)
from pglease.runtime.acquire import STEP_GRACE

from ._stall_proxy import StallProxy

#: How long a stall lasts when a test lifts it itself (the old code waited it out).
_STALL = 8.0
#: Slack on top of timeout + STEP_GRACE for a busy 2-core machine.
_SLACK = 2.0
#: A piece of the runtime's claim statement (`FleetQueries.claim`): the request
#: whose answer the proxy holds. Not the store's own claim, which every new
#: pooled connection prepares.
_CLAIM = b"clock_timestamp() FROM"


def _options(schema: str) -> dict[str, Any]:
    return {"schema": schema, "min_size": 1, "max_size": 4, "connect_timeout": 3}


@contextmanager
def _later(seconds: float, action: Callable[[], object]) -> Iterator[None]:
    """Run `action` `seconds` from now (a timer thread), and at the latest on exit."""
    done = threading.Event()

    def run() -> None:
        if not done.wait(seconds):
            action()

    timer = threading.Thread(target=run, daemon=True)
    timer.start()
    try:
        yield
    finally:
        done.set()
        timer.join()
        action()


def _events(dsn: str, schema: str, rid: str) -> list[tuple[str, int | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT type, lease_generation FROM {schema}.events"
            " WHERE resource_id = %s ORDER BY revision",
            [rid],
        ).fetchall()
    return [(str(t), g) for t, g in rows]


def _wait_for(predicate: Callable[[], bool], within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


# --------------------------------------------------------- a path gone dark


def test_sync_hold_times_out_on_a_stalled_path(stall_proxy: StallProxy, schema: str) -> None:
    owner = Owner("host", "a")
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        with store.hold("job", "dark", owner, ttl=2):
            pass  # the keeper's line and a pooled connection are open: a warm host
        stall_proxy.pause()
        with _later(_STALL, stall_proxy.resume):
            started = time.monotonic()
            with (
                pytest.raises(AcquireTimeoutError, match="within 1s"),
                store.hold("job", "dark", owner, ttl=2, timeout=1),
            ):
                pytest.fail("a lease on a stalled path")
            took = time.monotonic() - started
        assert took < 1 + STEP_GRACE + _SLACK, took
        # The path healed: the same host holds the lease again.
        with store.hold("job", "dark", owner, ttl=2, timeout=10) as lease:
            lease.check()


async def test_async_hold_times_out_connecting_its_keeper_on_a_stalled_path(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        await store.ensure_resource("job", "cold")
        stall_proxy.pause()  # the keeper has no line yet: its connect stalls
        with _later(_STALL, stall_proxy.resume):
            started = time.monotonic()
            with pytest.raises(AcquireTimeoutError, match="within 1s"):
                async with store.hold("job", "cold", owner, ttl=2, timeout=1):
                    pytest.fail("a lease on a stalled path")
            took = time.monotonic() - started
        assert took < 1 + STEP_GRACE + _SLACK, took
        async with store.hold("job", "cold", owner, ttl=2, timeout=10) as lease:
            lease.check()


async def test_async_acquire_times_out_on_a_stalled_path(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = await store.ensure_resource("job", "acquire")
        stall_proxy.pause()
        with _later(_STALL, stall_proxy.resume):
            started = time.monotonic()
            with pytest.raises(AcquireTimeoutError):
                await store.acquire("job", "acquire", owner, ttl=2, timeout=1.5)
            took = time.monotonic() - started
        assert took < 1.5 + STEP_GRACE + _SLACK, took
        # Nothing was claimed.
        assert not (await store.get(rid)).lease.held


# ------------------------------------------- the claim lands, its answer does not


def test_sync_acquire_claim_unanswered_by_the_deadline_is_outcome_unknown(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = store.ensure_resource("job", "unknown")
        stall_proxy.hold_replies_after(_CLAIM)
        with _later(_STALL, stall_proxy.release_replies):
            started = time.monotonic()
            with pytest.raises(CommitOutcomeUnknownError) as caught:
                store.acquire("job", "unknown", owner, ttl=30, timeout=1)
            took = time.monotonic() - started
        assert took < 1 + STEP_GRACE + _SLACK, took
        error = caught.value
        assert error.operation == "claim" and error.resource_id == rid
        assert error.token is not None
        # Healed: the claim did commit, and the error's token gives it back.
        lease = store.get(rid).lease
        assert lease.owner == owner
        assert lease.generation is not None and lease.expires_at is not None
        claim = Claim(rid, owner, error.token, lease.generation, lease.expires_at, 0)
        store.release(claim)
        assert not store.get(rid).lease.held


async def test_async_hold_claim_unanswered_by_the_deadline_is_outcome_unknown(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = await store.ensure_resource("job", "unknown")
        async with store.hold("job", "other", owner, ttl=5):
            pass  # the keeper's line is open
        stall_proxy.hold_replies_after(_CLAIM)
        with _later(_STALL, stall_proxy.release_replies):
            started = time.monotonic()
            with pytest.raises(CommitOutcomeUnknownError) as caught:
                async with store.hold("job", "unknown", owner, ttl=30, timeout=1):
                    pytest.fail("a lease whose claim was never answered")
            took = time.monotonic() - started
        assert took < 1 + STEP_GRACE + _SLACK, took
        token = caught.value.token
        assert token is not None
        lease = (await store.get(rid)).lease
        assert lease.owner == owner
        assert lease.generation is not None and lease.expires_at is not None
        await store.release(Claim(rid, owner, token, lease.generation, lease.expires_at, 0))
        assert not (await store.get(rid)).lease.held


# ------------------------------------- answered after the trust window: a loss


def test_sync_hold_never_hands_out_a_claim_answered_after_its_trust_window(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    owner = Owner("host", "a")
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = store.ensure_resource("job", "late")
        with store.hold("job", "other", owner, ttl=2):
            pass  # the keeper's line is open
        # ttl 2: the trust window closes 1.8 s after the request; the answer comes at 3 s.
        stall_proxy.hold_replies_after(_CLAIM)
        with (
            _later(3.0, stall_proxy.release_replies),
            store.hold("job", "late", owner, ttl=2, timeout=15) as lease,
        ):
            lease.check()  # a lease handed out is one the holder may trust
            assert lease.time_left() > 0
            generation = lease.generation
        events = _events(pg_dsn, schema, rid)
        claims = [g for t, g in events if t == "lease.claimed"]
        assert len(claims) >= 2 and generation == claims[-1], events
        assert generation > claims[0]  # not the late one


async def test_async_hold_never_hands_out_a_claim_answered_after_its_trust_window(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    owner = Owner("host", "a")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = await store.ensure_resource("job", "late")
        async with store.hold("job", "other", owner, ttl=2):
            pass
        stall_proxy.hold_replies_after(_CLAIM)
        with _later(3.0, stall_proxy.release_replies):
            async with store.hold("job", "late", owner, ttl=2, timeout=15) as lease:
                lease.check()
                assert lease.time_left() > 0
                generation = lease.generation
        claims = [g for t, g in _events(pg_dsn, schema, rid) if t == "lease.claimed"]
        assert len(claims) >= 2 and generation == claims[-1] and generation > claims[0]


def test_sync_acquire_never_returns_a_claim_answered_after_its_trust_window(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    owner = Owner("host", "a")
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = store.ensure_resource("job", "late")
        stall_proxy.hold_replies_after(_CLAIM)
        with _later(3.0, stall_proxy.release_replies):
            claim = store.acquire("job", "late", owner, ttl=2, timeout=15)
        claims = [g for t, g in _events(pg_dsn, schema, rid) if t == "lease.claimed"]
        assert len(claims) >= 2 and claim.generation == claims[-1] > claims[0]
        store.renew(claim, ttl=2)  # current: the database still has it
        store.release(claim)


async def test_async_hold_late_answer_past_the_timeout_times_out_and_is_released(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    owner = Owner("host", "a")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = await store.ensure_resource("job", "late")
        async with store.hold("job", "other", owner, ttl=2):
            pass
        # ttl 8: trust 7.2 s; the answer comes at 7.5 s, after the 7 s timeout.
        stall_proxy.hold_replies_after(_CLAIM)
        with _later(7.5, stall_proxy.release_replies), pytest.raises(AcquireTimeoutError):
            async with store.hold("job", "late", owner, ttl=8, timeout=7):
                pytest.fail("a lease answered after its trust window")
        # The late claim is given back by the keeper, before its expiry at ~8 s.
        assert _wait_for(
            lambda: ("lease.released", 1) in _events(pg_dsn, schema, rid), within=10
        ), _events(pg_dsn, schema, rid)
