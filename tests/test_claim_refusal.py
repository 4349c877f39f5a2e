"""A claim of a live lease is refused without a lock: it does not queue behind
a transaction that holds the lease row, and it assigns no transaction id."""

from __future__ import annotations

import psycopg
import pytest

from pglease import AsyncPostgresStore, LockTimeoutError, Owner, PostgresStore

A = Owner("host", "a")
B = Owner("host", "b")


def _row_locked(pg_dsn: str, schema: str, rid: str) -> psycopg.Connection:
    """A connection holding the lease row's lock in an open transaction."""
    conn = psycopg.connect(pg_dsn)
    conn.execute(f'SELECT 1 FROM "{schema}".leases WHERE resource_id = %s FOR UPDATE', [rid])
    return conn


def test_refused_claim_does_not_wait_for_the_row_lock(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema, lock_timeout=1) as store:
        rid = store.ensure_resource("job", "hot")
        held = store.claim(rid, A, 60)
        assert held is not None
        locker = _row_locked(pg_dsn, schema, rid)
        try:
            # Before, this queued on the row lock and ended in LockTimeoutError.
            assert store.claim(rid, B, 60) is None
            # With an expected revision the claim takes the locked path, so a
            # stale revision is judged under the lock, as documented.
            with pytest.raises(LockTimeoutError):
                store.claim(rid, B, 60, expected_revision=held.revision)
        finally:
            locker.close()
        state = store.get(rid)
        assert state.revision == held.revision  # the refusals changed nothing
        assert state.lease.owner == A and state.lease.generation == held.generation


def test_refused_claim_assigns_no_transaction_id(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "xid")
    assert pg_store.claim(rid, A, 60) is not None
    with pg_store.connection() as conn:
        conn.execute("BEGIN")
        row = conn.execute(
            f'SELECT claimed FROM "{pg_store.schema}".claim(%s, %s, %s, %s, 60, NULL, NULL)',
            [rid, B.type, B.id, b"\x00" * 32],
        ).fetchone()
        xid = conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()
        conn.execute("ROLLBACK")
    assert row is not None and row[0] is False
    assert xid is not None and xid[0] is None  # read-only: nothing to flush at commit


async def test_async_refused_claim_does_not_wait_for_the_row_lock(
    pg_dsn: str, schema: str
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=1) as store:
        rid = await store.ensure_resource("job", "hot")
        assert await store.claim(rid, A, 60) is not None
        locker = _row_locked(pg_dsn, schema, rid)
        try:
            assert await store.claim(rid, B, 60) is None
        finally:
            locker.close()


def test_an_expired_lease_is_still_claimed_under_the_lock(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "expired")
    first = pg_store.claim(rid, A, 1)
    assert first is not None
    later = first.expires_at  # by the database's test clock: the lease has ended
    second = pg_store.claim(rid, B, 60, now=later)
    assert second is not None and second.generation == first.generation + 1
