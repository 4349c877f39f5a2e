"""PostgreSQL session leases are held by the store's keeper, the one `hold()` uses.

One store, one keeper: a session's writer lease and a `hold()` of the same
store are renewed in one batch heartbeat on the keeper's one connection. The
keeper's verdicts reach the handle: a lease taken over is lost at the next
beat, a killed keeper connection is replaced without loss. Time is a
`FakeClock` where the keeper's timing matters (the database's own expiry stays
real), so nothing here waits for a real renew interval.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pglease import AsyncPostgresStore, LeaseLostError, Owner, PostgresStore
from pglease.clock import FakeClock
from pglease.ids import resource_id
from pglease.postgres.runtime import application_name
from pglease.runtime import AsyncKeeper, Keeper, hold, hold_async
from pglease.sessions import (
    AsyncPostgresSessionRepository,
    PostgresSessionRepository,
    WriterLeaseLostError,
)

from ._blocking import FLAVOURS, Flavour, open_flavour, unwrap
from .conformance.test_sessions import msg

flavour = pytest.fixture(params=FLAVOURS)(open_flavour)

OTHER = Owner("host", "other")
FAR = datetime.now(UTC) + timedelta(days=1)
#: Real seconds any condition below may take on a loaded host.
BOUND = 30.0


def wait_for(
    condition: Callable[[], bool], what: str, step: Callable[[], None] | None = None
) -> None:
    """Poll `condition` (calling `step` between tries) for at most `BOUND` real seconds."""
    end = time.monotonic() + BOUND
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.02)


def keeper_backends(dsn: str, schema: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
            (application_name(schema),),
        ).fetchall()
    return [r[0] for r in rows]


def events(store: PostgresStore, session_id: str) -> list[str]:
    return [e.type for e in store.events(resource_id("session", session_id))]


# --------------------------------------------------------------------------- sync


def test_a_session_and_a_hold_share_one_keeper_and_one_beat(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    clock = FakeClock()
    repo = PostgresSessionRepository(pg_store, lease_seconds=30, renew_interval=10, clock=clock)
    with (
        hold(pg_store, "run", "r1", OTHER, 30, clock=clock) as lease,
        repo.create("s") as session,
    ):
        keeper = Keeper.for_store(pg_store, clock)
        assert session.held is not None and len(keeper) == 2
        assert keeper_backends(pg_dsn, schema) != [] and len(keeper_backends(pg_dsn, schema)) == 1
        revision = pg_store.get(session.resource_id).revision
        expires_at = pg_store.get(session.resource_id).lease.expires_at
        assert expires_at is not None
        beats = keeper.stats.beats
        clock.advance(10)  # both are due: one beat renews both
        wait_for(lambda: keeper.stats.beats > beats, "a beat")
        assert keeper.stats.last_beat_size == 2
        assert session.held.renewals == 1 and lease.renewals == 1
        state = pg_store.get(session.resource_id)
        assert state.lease.expires_at is not None and state.lease.expires_at > expires_at
        # a heartbeat: no revision bump, no event; the handle's revision still fences
        assert state.revision == revision == session.revision
        assert events(pg_store, "s") == ["lease.claimed", "session.created"]
        assert session.append_message(None, msg("a")).seq == 3
        session.close()
        assert len(keeper) == 1 and not session.lost.is_set()
        assert "no longer held: released" in str(session.held.lost_error)  # not a loss
        assert pg_store.get(session.resource_id).lease.owner is None  # released
        assert not lease.lost.is_set()
    assert len(keeper) == 0


def test_a_lease_taken_over_is_lost_at_the_next_beat(pg_store: PostgresStore) -> None:
    clock = FakeClock()
    lost: list[str] = []
    repo = PostgresSessionRepository(
        pg_store, renew_interval=10, clock=clock, on_lost=lambda h: lost.append(h.id)
    )
    session = repo.create("s")
    keeper = Keeper.for_store(pg_store, clock)
    taken = pg_store.claim(session.resource_id, OTHER, 60, now=FAR)  # as if a day had passed
    assert taken is not None and taken.generation == session.fence + 1
    clock.advance(10)
    assert session.lost.wait(BOUND)
    assert lost == ["s"] and len(keeper) == 0
    with pytest.raises(WriterLeaseLostError, match="no longer current") as caught:
        session.append_message(None, msg("late"))
    assert isinstance(caught.value, LeaseLostError)
    assert session.held is not None and session.held.lost_error is not None
    session.close()  # never releases the successor's lease
    assert pg_store.get(session.resource_id).lease.owner == OTHER
    assert lost == ["s"]


def test_the_trust_window_closes_when_no_beat_succeeds(pg_store: PostgresStore) -> None:
    """A keeper that cannot renew (here: its beats are never due, the clock
    jumps past the window) loses the handle by its own clock."""
    clock = FakeClock()
    repo = PostgresSessionRepository(pg_store, lease_seconds=30, renew_interval=15, clock=clock)
    session = repo.create("s")
    assert session.held is not None
    assert session.held.timing.interval == 15 and session.held.timing.margin == 3
    clock.advance(27)  # request start + ttl - margin: trust ends, whatever the beats did
    assert session.lost.wait(BOUND)
    assert session.trust_expired()
    with pytest.raises(WriterLeaseLostError, match="could not be renewed"):
        session.append_message(None, msg("late"))
    session.close()


def test_a_killed_keeper_connection_is_replaced_without_loss(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    clock = FakeClock()
    repo = PostgresSessionRepository(pg_store, renew_interval=10, clock=clock)
    with repo.create("s") as session:
        held = session.held
        assert held is not None
        [pid] = keeper_backends(pg_dsn, schema)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        clock.advance(10)
        # The failed beat is retried a little later on the keeper's clock.
        wait_for(lambda: held.renewals >= 1, "a renewal", step=lambda: clock.advance(0.1))
        assert not session.lost.is_set()
        assert keeper_backends(pg_dsn, schema) not in ([], [pid])
        assert session.append_message(None, msg("still mine")).seq == 3


def test_explicit_renew_extends_the_keepers_trust_window(pg_store: PostgresStore) -> None:
    clock = FakeClock()
    repo = PostgresSessionRepository(pg_store, renew_interval=10, clock=clock)
    with repo.create("s") as session:
        held = session.held
        assert held is not None
        before = held.deadline
        clock.advance(5)
        session.renew()
        assert held.deadline == before + 5 and held.renewals == 1


# --------------------------------------------------------------------------- both flavours


def test_a_dropped_handle_lets_its_lease_expire(flavour: Flavour) -> None:
    repo = flavour.repo(lease_seconds=1.0, renew_interval=0.2)
    session = repo.create("dropped")
    handle = unwrap(session)
    keeper = handle._lease.keeper
    assert keeper is not None and len(keeper) == 1
    del session, handle
    gc.collect()
    wait_for(lambda: len(keeper) == 0, "the keeper to let the dropped lease go")
    other = flavour.repo(renew_interval=None)
    with other.open("dropped", wait=BOUND) as again:  # woken by the expiry
        assert again.fence == 2


def test_no_keeper_without_background_renewal(flavour: Flavour) -> None:
    repo = flavour.repo(renew_interval=None)
    with repo.create("s") as session:
        assert session.held is None
        session.renew()
        assert not session.lost.is_set()


# --------------------------------------------------------------------------- asyncio


async def test_async_session_and_hold_share_one_keeper(
    apg_store: AsyncPostgresStore, pg_dsn: str, schema: str
) -> None:
    clock = FakeClock()
    repo = AsyncPostgresSessionRepository(apg_store, renew_interval=10, clock=clock)
    async with (
        hold_async(apg_store, "run", "r1", OTHER, 30, clock=clock) as lease,
        await repo.create("s") as session,
    ):
        keeper = AsyncKeeper.for_store(apg_store, clock)
        assert session.held is not None and len(keeper) == 2
        assert len(await asyncio.to_thread(keeper_backends, pg_dsn, schema)) == 1
        revision = (await apg_store.get(session.resource_id)).revision
        beats = keeper.stats.beats
        clock.advance(10)
        async with asyncio.timeout(BOUND):
            while keeper.stats.beats == beats:
                await asyncio.sleep(0.02)
        assert keeper.stats.last_beat_size == 2
        assert session.held.renewals == 1 and lease.renewals == 1
        assert (await apg_store.get(session.resource_id)).revision == revision
        await session.close()
        assert len(keeper) == 1
    assert len(keeper) == 0
    await keeper.aclose()


async def test_async_lease_taken_over_is_lost(apg_store: AsyncPostgresStore) -> None:
    clock = FakeClock()
    lost = threading.Event()
    repo = AsyncPostgresSessionRepository(
        apg_store, renew_interval=10, clock=clock, on_lost=lambda h: lost.set()
    )
    session = await repo.create("s")
    keeper: Any = AsyncKeeper.for_store(apg_store, clock)
    assert await apg_store.claim(session.resource_id, OTHER, 60, now=FAR) is not None
    clock.advance(10)
    async with asyncio.timeout(BOUND):
        await session.lost.wait()
    assert lost.is_set() and len(keeper) == 0
    with pytest.raises(WriterLeaseLostError, match="no longer current"):
        await session.append_message(None, msg("late"))
    await session.close()
    assert (await apg_store.get(session.resource_id)).lease.owner == OTHER
    await keeper.aclose()
