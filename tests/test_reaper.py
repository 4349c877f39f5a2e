"""The reaper's unit of work: one expired lease per transaction, after the
resource's advisory lock, never waiting for a busy writer (real PostgreSQL)."""

from __future__ import annotations

import time

import psycopg
import pytest

from pglease import AsyncPostgresStore, Owner, PostgresStore, ValidationError
from pglease.watch import reap_once, reap_once_async

A = Owner("host", "a")


def expire(store: PostgresStore, keys: list[str]) -> list[str]:
    rids = [store.ensure_resource("run", k) for k in keys]
    for rid in rids:
        assert store.claim(rid, A, 0.05) is not None
    time.sleep(0.1)
    return rids


def expired_xids(dsn: str, schema: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT resource_id, xid::text FROM "{schema}".events WHERE type = %s',
            ["lease.expired"],
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def test_each_lease_is_reaped_in_its_own_transaction(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rids = expire(pg_store, ["r1", "r2", "r3"])
    assert reap_once(pg_store) == 3
    xids = expired_xids(pg_dsn, schema)
    assert sorted(xids) == sorted(rids)
    # One transaction each: a write committed to a later lease while an
    # earlier one was being reaped can never be ordered after its expiry.
    assert len(set(xids.values())) == 3
    assert reap_once(pg_store) == 0


def test_a_busy_resource_is_left_for_the_next_pass(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    busy, free = expire(pg_store, ["busy", "free"])
    with psycopg.connect(pg_dsn) as writer:
        # A writer queued on the resource (the advisory lock every writer
        # takes first): the reaper must not wait for it, nor reap under it.
        writer.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, hashtext(%s)))", [busy, schema]
        )
        started = time.monotonic()
        assert reap_once(pg_store) == 1
        assert time.monotonic() - started < 2
        assert set(expired_xids(pg_dsn, schema)) == {free}
        writer.rollback()
    assert reap_once(pg_store) == 1
    assert set(expired_xids(pg_dsn, schema)) == {busy, free}


def test_limit_bounds_the_pass(pg_store: PostgresStore) -> None:
    expire(pg_store, ["l1", "l2", "l3"])
    assert reap_once(pg_store, 2) == 2
    assert reap_once(pg_store, 2) == 1
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValidationError):
            reap_once(pg_store, bad)  # type: ignore[arg-type]


async def test_async_reaps_one_lease_per_transaction(
    apg_store: AsyncPostgresStore, pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    expire(pg_store, ["a1", "a2"])
    assert await reap_once_async(apg_store) == 2
    assert len(set(expired_xids(pg_dsn, schema).values())) == 2
    assert await reap_once_async(apg_store) == 0
