"""The stores' fleet-runtime methods reach the real runtime (sync and asyncio)."""

from __future__ import annotations

from pglease import AsyncPostgresStore, Owner, PostgresStore, resource_id

A = Owner("host", "a")


def test_sync_store_hold_acquire_elect(pg_store: PostgresStore) -> None:
    with pg_store.hold("run", "held", A, 3) as lease:
        assert lease.generation == 1
        state = pg_store.get(resource_id("run", "held"))
        assert state.lease.owner == A and state.lease.held
    assert not pg_store.get(resource_id("run", "held")).lease.held
    claim = pg_store.acquire("run", "acq", A, 5, timeout=1)
    assert claim.generation == 1
    election = pg_store.elect("scheduler", A, ttl=3)
    try:
        assert election.wait_elected(30)
        leader = pg_store.leader("scheduler")
        assert leader is not None and leader.owner == A and leader.generation == 1
    finally:
        election.stop()
    assert pg_store.leader("scheduler") is None


async def test_async_store_hold_acquire_elect(apg_store: AsyncPostgresStore) -> None:
    async with apg_store.hold("run", "held", A, 3) as lease:
        assert lease.generation == 1
        assert (await apg_store.get(resource_id("run", "held"))).lease.owner == A
    assert not (await apg_store.get(resource_id("run", "held"))).lease.held
    claim = await apg_store.acquire("run", "acq", A, 5, timeout=1)
    assert claim.generation == 1
    election = await apg_store.elect("scheduler", A, ttl=3)
    try:
        assert await election.wait_elected(30)
        leader = await apg_store.leader("scheduler")
        assert leader is not None and leader.owner == A
    finally:
        await election.stop()
    assert await apg_store.leader("scheduler") is None


def test_sync_store_watch_delivers_new_events(pg_store: PostgresStore) -> None:
    from pglease import Permit

    rid = pg_store.ensure_resource("run", "watched")
    with pg_store.watch(after="now", types="run") as watcher:
        pg_store.mutate(Permit(rid, 0), "run.step", payload={"n": 1})
        event = watcher.get(timeout=10)
    assert event is not None and event.type == "run.step" and event.payload == {"n": 1}


async def test_async_store_watch_delivers_new_events(apg_store: AsyncPostgresStore) -> None:
    from pglease import Permit

    rid = await apg_store.ensure_resource("run", "watched")
    async with apg_store.watch(after="start") as watcher:
        await apg_store.mutate(Permit(rid, 0), "run.step")
        event = await watcher.get(timeout=10)
    assert event is not None and event.resource_id == rid
