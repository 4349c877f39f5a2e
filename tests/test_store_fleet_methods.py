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
        assert election.wait_elected(5)
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
        assert await election.wait_elected(5)
        leader = await apg_store.leader("scheduler")
        assert leader is not None and leader.owner == A
    finally:
        await election.stop()
    assert await apg_store.leader("scheduler") is None
