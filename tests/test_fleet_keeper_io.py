"""Keepers on a connection that goes dark mid-statement (a frozen server or a
dead network path: bytes acknowledged, never answered). The beat is cut off
after its limit and retried on a new connection before the trust window
closes, so the lease survives. Generous timing: asserts outcomes, not speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import psycopg

from pglease import AsyncPostgresStore, Owner, PostgresStore
from pglease.postgres.runtime import SESSION_SETUP, _connect_kwargs
from pglease.runtime import AsyncKeeper, Keeper, Timing

from ._fleet_proxy import FreezingProxy
from ._pg_where import PgWhere

A = Owner("host", "a")
TTL = 6.0  # interval 2 s: a cut-off beat (after ~1.7 s) leaves ~1.7 s to retry


def _eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


def test_keeper_tcp_settings_are_accepted(pg_dsn: str) -> None:
    # libpq knows every keyword (a typo would fail the connect), over TCP too.
    with FreezingProxy(pg_dsn) as proxy:
        for dsn in (pg_dsn, proxy.dsn):
            with psycopg.connect(dsn, **_connect_kwargs(2.0, "keeper_io")) as conn:
                conn.execute(SESSION_SETUP)
                row = conn.execute("SHOW statement_timeout").fetchone()
                assert row is not None and row[0] == "10s"
                # Batches of every size share one prepared statement: never a
                # generic plan (blind to the arrays' lengths) for them.
                row = conn.execute("SHOW plan_cache_mode").fetchone()
                assert row is not None and row[0] == "force_custom_plan"


def test_sync_keeper_recovers_from_a_frozen_connection(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "frozen")
    claim = pg_store.claim(rid, A, TTL)
    assert claim is not None
    with FreezingProxy(pg_store.dsn) as proxy, Keeper(PgWhere(proxy.dsn, pg_store.schema)) as k:
        lease = k.add(claim, Timing.of(TTL), time.monotonic())
        _eventually(lambda: lease.renewals >= 1)
        assert proxy.freeze() == 1  # the keeper's one connection
        before = lease.renewals
        _eventually(lambda: lease.renewals > before or lease.lost.is_set())
        assert lease.lost_error is None, lease.lost_error
        assert k.stats.aborted >= 1
        lease.check()
    state = pg_store.get(rid)
    assert state.lease.owner == A and state.lease.generation == claim.generation


async def test_async_keeper_recovers_from_a_frozen_connection(
    apg_store: AsyncPostgresStore,
) -> None:
    rid = await apg_store.ensure_resource("run", "afrozen")
    claim = await apg_store.claim(rid, A, TTL)
    assert claim is not None
    with FreezingProxy(apg_store.dsn) as proxy:
        async with AsyncKeeper(PgWhere(proxy.dsn, apg_store.schema, is_async=True)) as k:
            lease = k.add(claim, Timing.of(TTL), time.monotonic())
            end = time.monotonic() + 30
            while lease.renewals < 1 and time.monotonic() < end:
                await asyncio.sleep(0.02)
            assert proxy.freeze() == 1
            before = lease.renewals
            while lease.renewals == before and not lease.lost.is_set():
                assert time.monotonic() < end + 30
                await asyncio.sleep(0.02)
            assert lease.lost_error is None, lease.lost_error
            assert k.stats.aborted >= 1
