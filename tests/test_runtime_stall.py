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

import asyncio
import contextlib
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
    DatabaseUnavailableError,
    LeaseLostError,
    Owner,
    PgleaseError,
    PostgresStore,
)
from pglease.runtime.acquire import LEAVE_LIMIT, STEP_GRACE

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


def test_sync_fair_waiter_ends_on_a_stalled_path_and_leaves_no_entry(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    holder, waiter = Owner("host", "a"), Owner("host", "b")
    with (
        PostgresStore(pg_dsn, schema=schema) as direct,
        PostgresStore(stall_proxy.dsn, **_options(schema)) as store,
    ):
        rid = direct.ensure_resource("job", "queue")
        assert direct.claim(rid, holder, ttl=60) is not None
        outcome: list[BaseException] = []
        ended: list[float] = []

        def wait() -> None:
            try:
                store.acquire("job", "queue", waiter, ttl=5, timeout=2, fair=True)
            except BaseException as exc:
                outcome.append(exc)
            ended.append(time.monotonic())

        def queued() -> int:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                row = conn.execute(
                    f"SELECT count(*) FROM {schema}.lease_waiters WHERE resource_id = %s"
                    " AND expires_at > clock_timestamp()",
                    [rid],
                ).fetchone()
            return int(row[0]) if row else 0

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        assert _wait_for(lambda: queued() == 1, within=10)  # in the queue, waiting
        stall_proxy.pause()
        paused = time.monotonic()
        with _later(_STALL + 2, stall_proxy.resume):
            thread.join(30)
            assert ended, "the fair waiter did not end"
        # Its refresh (a claim: sent, so unknown) or its timeout, then at most
        # LEAVE_LIMIT for deleting its entry.
        assert ended[0] - paused < 2 + STEP_GRACE + LEAVE_LIMIT + _SLACK, ended[0] - paused
        assert len(outcome) == 1
        assert isinstance(outcome[0], (AcquireTimeoutError, CommitOutcomeUnknownError))
        # Healed: the entry was deleted, or ran out within its ttl (5 s).
        assert _wait_for(lambda: queued() == 0, within=8)
        assert direct.get(rid).lease.owner == holder


def test_sync_election_never_elects_on_a_claim_answered_after_its_trust_window(
    stall_proxy: StallProxy, schema: str
) -> None:
    me = Owner("host", "a")
    elected: list[tuple[int, bool]] = []

    def on_elected(lease: Any) -> None:
        elected.append((lease.generation, lease.lost_error is None and lease.time_left() > 0))

    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        with store.hold("job", "other", me, ttl=2):
            pass  # the keeper's line is open
        stall_proxy.hold_replies_after(_CLAIM)
        with (
            _later(3.0, stall_proxy.release_replies),
            store.elect("late", me, ttl=2, on_elected=on_elected) as election,
        ):
            assert election.wait_elected(timeout=20)
        # The first term's claim was answered after its trust window: never a term.
        assert elected and all(trusted for _, trusted in elected), elected
        assert elected[0][0] >= 2, elected


async def test_async_hold_does_not_wait_out_its_keepers_reconnect_on_a_stalled_path(
    stall_proxy: StallProxy, schema: str
) -> None:
    from pglease.runtime import AsyncKeeper

    me = Owner("host", "a")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        keeper = AsyncKeeper.for_store(store)
        # The held lease is lost in the stall: leaving its block says so.
        with pytest.raises(LeaseLostError):
            async with store.hold("job", "held", me, ttl=6):
                stall_proxy.pause()
                # The keeper's beat hangs, is cut off, and the keeper connects again
                # (up to its connect_timeout of 5 s) while the path stays dark.
                line: Any = keeper._channel
                end = time.monotonic() + 15
                while not line._lock.locked() or line._conn is not None:
                    assert time.monotonic() < end, "the keeper never reconnected"
                    await asyncio.sleep(0.05)
                with _later(_STALL, stall_proxy.resume):
                    started = time.monotonic()
                    with pytest.raises(AcquireTimeoutError):
                        async with store.hold("job", "next", me, ttl=2, timeout=1):
                            pytest.fail("a lease on a stalled path")
                    took = time.monotonic() - started
        assert took < 1 + STEP_GRACE + _SLACK, took


# ------------------------------------- one bound per step, whatever it waits on
#
# From a stall soak: a step that first waited (for a pooled connection, for
# another caller's keeper connect) then got the whole of its limit again for
# its round trip or its own connect, so a hold with timeout 3 took 5.5-7.5 s.


def test_sync_hold_checkout_wait_counts_against_the_step(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    options = {**_options(schema), "max_size": 1}
    with PostgresStore(stall_proxy.dsn, **options) as store:
        with store.hold("job", "busy-pool", owner, ttl=2):
            pass  # a warm host: the keeper's line and the pool's one connection open
        taken, give_back = threading.Event(), threading.Event()

        def borrow() -> None:
            with store._driver.connection():  # the pool's only connection, for a while
                taken.set()
                give_back.wait(15)

        borrower = threading.Thread(target=borrow, daemon=True)
        borrower.start()
        assert taken.wait(10)
        stall_proxy.pause()
        try:
            with _later(3.8, give_back.set), _later(_STALL + 4, stall_proxy.resume):
                started = time.monotonic()
                with (
                    pytest.raises(AcquireTimeoutError, match="within 3s"),
                    store.hold("job", "busy-pool", owner, ttl=2, timeout=3),
                ):
                    pytest.fail("a lease on a stalled path")
                took = time.monotonic() - started
        finally:
            give_back.set()
            borrower.join(15)
        assert took < 3 + STEP_GRACE + _SLACK, took


async def test_async_hold_checkout_wait_counts_against_the_step(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    options = {**_options(schema), "max_size": 1}
    async with AsyncPostgresStore(stall_proxy.dsn, **options) as store:
        async with store.hold("job", "busy-pool", owner, ttl=2):
            pass
        taken, give_back = asyncio.Event(), asyncio.Event()

        async def borrow() -> None:
            async with store._driver.connection():
                taken.set()
                await give_back.wait()

        borrower = asyncio.ensure_future(borrow())
        await asyncio.wait_for(taken.wait(), 10)
        stall_proxy.pause()
        asyncio.get_running_loop().call_later(3.8, give_back.set)
        try:
            with _later(_STALL + 4, stall_proxy.resume):
                started = time.monotonic()
                with pytest.raises(AcquireTimeoutError, match="within 3s"):
                    async with store.hold("job", "busy-pool", owner, ttl=2, timeout=3):
                        pytest.fail("a lease on a stalled path")
                took = time.monotonic() - started
        finally:
            give_back.set()
            await borrower
        assert took < 3 + STEP_GRACE + _SLACK, took


def test_sync_hold_waiting_for_another_keeper_connect_keeps_its_timeout(
    stall_proxy: StallProxy, schema: str
) -> None:
    first, second = Owner("host", "a"), Owner("host", "b")
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        store.ensure_resource("job", "cold")
        stall_proxy.pause()  # the keeper has no line yet: each connect stalls
        errors: list[BaseException] = []

        def other() -> None:
            try:
                with store.hold("job", "cold", first, ttl=2, timeout=3):
                    pass
            except BaseException as exc:
                errors.append(exc)

        with _later(_STALL + 4, stall_proxy.resume):
            thread = threading.Thread(target=other, daemon=True)
            thread.start()
            time.sleep(0.5)  # the other hold is connecting the keeper
            started = time.monotonic()
            with (
                pytest.raises((AcquireTimeoutError, DatabaseUnavailableError)),
                store.hold("job", "cold", second, ttl=2, timeout=3),
            ):
                pytest.fail("a lease on a stalled path")
            took = time.monotonic() - started
            thread.join(15)
        assert took < 3 + STEP_GRACE + _SLACK, took
        assert errors and isinstance(errors[0], (AcquireTimeoutError, DatabaseUnavailableError))


async def test_async_hold_waiting_for_another_keeper_connect_keeps_its_timeout(
    stall_proxy: StallProxy, schema: str
) -> None:
    first, second = Owner("host", "a"), Owner("host", "b")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        await store.ensure_resource("job", "cold")
        stall_proxy.pause()

        async def hold(owner: Owner) -> None:
            async with store.hold("job", "cold", owner, ttl=2, timeout=3):
                pytest.fail("a lease on a stalled path")

        with _later(_STALL + 4, stall_proxy.resume):
            other = asyncio.ensure_future(hold(first))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            with pytest.raises((AcquireTimeoutError, DatabaseUnavailableError)):
                await hold(second)
            took = time.monotonic() - started
            with pytest.raises((AcquireTimeoutError, DatabaseUnavailableError)):
                await other
        assert took < 3 + STEP_GRACE + _SLACK, took


def _failing(store: Any) -> bool:
    pool = store._driver._pool
    return bool(pool is not None and pool.failing)


def test_sync_acquire_probe_of_a_failing_pool_keeps_its_timeout(
    stall_proxy: StallProxy, schema: str
) -> None:
    # A pool that cannot connect makes a caller probe the server itself, within
    # the store's connect_timeout: an acquire's time left bounds that probe.
    owner = Owner("host", "a")
    options = {**_options(schema), "connect_timeout": 6}
    with PostgresStore(stall_proxy.dsn, **options) as store:
        rid = store.ensure_resource("job", "down")
        stall_proxy.pause()
        stall_proxy.reset()  # every connection gone; new ones never answered
        with _later(30, stall_proxy.resume):
            trigger = threading.Thread(target=lambda: _quietly(store.get, rid), daemon=True)
            trigger.start()
            assert _wait_for(lambda: _failing(store), within=20)
            started = time.monotonic()
            with pytest.raises((AcquireTimeoutError, DatabaseUnavailableError)):
                store.acquire("job", "down", owner, ttl=2, timeout=1, use_watcher=False)
            took = time.monotonic() - started
        trigger.join(30)
        assert took < 1 + STEP_GRACE + _SLACK, took


async def test_async_acquire_probe_of_a_failing_pool_keeps_its_timeout(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    options = {**_options(schema), "connect_timeout": 6}
    async with AsyncPostgresStore(stall_proxy.dsn, **options) as store:
        rid = await store.ensure_resource("job", "down")
        stall_proxy.pause()
        stall_proxy.reset()
        with _later(30, stall_proxy.resume):
            trigger = asyncio.ensure_future(store.get(rid))
            end = time.monotonic() + 20
            while not _failing(store):
                assert time.monotonic() < end, "the pool never failed"
                await asyncio.sleep(0.1)
            started = time.monotonic()
            with pytest.raises((AcquireTimeoutError, DatabaseUnavailableError)):
                await store.acquire("job", "down", owner, ttl=2, timeout=1, use_watcher=False)
            took = time.monotonic() - started
            with contextlib.suppress(PgleaseError):
                await trigger
        assert took < 1 + STEP_GRACE + _SLACK, took


def _quietly(call: Callable[..., object], *args: Any) -> None:
    with contextlib.suppress(PgleaseError):
        call(*args)


#: A piece of the keeper line's session setup (`SESSION_SETUP`), sent right
#: after its connect.
_SETUP = b"SET plan_cache_mode = force_custom_plan"


def test_sync_hold_keeper_setup_gets_what_its_connect_left(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        store.ensure_resource("job", "slow")
        stall_proxy.hold_replies_after(_SETUP)  # its setup goes unanswered...
        stall_proxy.pause()  # ...after a connect that took most of the limit
        with _later(3.5, stall_proxy.resume), _later(_STALL + 6, stall_proxy.release_replies):
            started = time.monotonic()
            with (
                pytest.raises((AcquireTimeoutError, DatabaseUnavailableError)),
                store.hold("job", "slow", owner, ttl=2, timeout=4),
            ):
                pytest.fail("a lease on a stalled path")
            took = time.monotonic() - started
        assert took < 4 + STEP_GRACE + _SLACK, took


async def test_async_hold_keeper_setup_gets_what_its_connect_left(
    stall_proxy: StallProxy, schema: str
) -> None:
    owner = Owner("host", "a")
    async with AsyncPostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        await store.ensure_resource("job", "slow")
        stall_proxy.hold_replies_after(_SETUP)
        stall_proxy.pause()
        with _later(3.5, stall_proxy.resume), _later(_STALL + 6, stall_proxy.release_replies):
            started = time.monotonic()
            with pytest.raises((AcquireTimeoutError, DatabaseUnavailableError)):
                async with store.hold("job", "slow", owner, ttl=2, timeout=4):
                    pytest.fail("a lease on a stalled path")
            took = time.monotonic() - started
        assert took < 4 + STEP_GRACE + _SLACK, took
