"""A revoke fences the holder at once, yet nobody can claim before the revoked
holder's last granted expiry (migration 0017, `revoke_lease` and `claim`).

The database cannot stop a process on another host: the revoked holder's
runner stops its command by its own trust window, which closes before that
expiry. Time is driven by the test clock (`now=` on the rival's claims); the
revoke itself reads the database clock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pglease import LeaseLostError, Owner, Permit, PostgresStore
from pglease.admin import revoke_lease
from pglease.driver import ClaimRequest

A = Owner("host", "a")
B = Owner("host", "b")
MS = timedelta(milliseconds=1)


def _revoke(store: PostgresStore, rid: str) -> int:
    with psycopg.connect(store.dsn, autocommit=True) as conn:
        done = revoke_lease(conn, store.schema, rid)
    assert done.revoked
    return done.generation


def test_revoked_lease_is_fenced_at_once_and_claimable_only_after_its_expiry(
    pg_store: PostgresStore,
) -> None:
    rid = pg_store.ensure_resource("job", "r1")
    stuck = pg_store.claim(rid, A, 600)
    assert stuck is not None
    generation = _revoke(pg_store, rid)
    # Fenced at once.
    with pytest.raises(LeaseLostError):
        pg_store.renew(stuck, 30)
    with pytest.raises(LeaseLostError):
        pg_store.mutate(Permit(rid, pg_store.get(rid).revision, stuck), "job.step")
    with pytest.raises(LeaseLostError):
        pg_store.release(stuck)
    # Refused by the lock-free path, the locked path (an expected revision)
    # and the fair path, up to the old expiry.
    revision = pg_store.get(rid).revision
    assert pg_store.claim(rid, B, 30) is None
    assert pg_store.claim(rid, B, 30, revision) is None
    assert pg_store.claim(rid, B, 30, now=stuck.expires_at - MS) is None
    assert pg_store.claim(rid, B, 30, revision, now=stuck.expires_at - MS) is None
    driver = pg_store.runtime_driver()
    for request in (
        ClaimRequest(rid, B, "tok-b", 30.0),
        ClaimRequest(rid, B, "tok-b", 30.0, "waiter-b", 5.0),
    ):
        answer = driver.attempt_claim(request)
        assert answer is not None and not answer.claimed
        # A busy refusal with no holder and the time it frees: waiters sleep until then.
        assert answer.holder is None
        assert answer.expires_at == stuck.expires_at
        assert answer.generation == generation
    state = pg_store.get(rid)
    assert not state.lease.held and state.lease.owner is None
    assert state.revision == revision  # refusals change nothing
    # From the old expiry on, the next claim gets the next generation.
    taken = pg_store.claim(rid, B, 30, now=stuck.expires_at + MS)
    assert taken is not None and taken.generation == generation + 1
    types = [e.type for e in pg_store.events(rid)]
    assert types == ["lease.claimed", "lease.revoked", "lease.claimed"]


def test_revoking_an_expired_lease_makes_nobody_wait(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "r2")
    past = datetime.now(UTC) - timedelta(hours=1)
    assert pg_store.claim(rid, A, 60, now=past) is not None  # expired an hour ago
    generation = _revoke(pg_store, rid)
    taken = pg_store.claim(rid, B, 30)
    assert taken is not None and taken.generation == generation + 1


def test_a_second_revoke_changes_nothing_and_keeps_the_wait(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "r3")
    stuck = pg_store.claim(rid, A, 600)
    assert stuck is not None
    _revoke(pg_store, rid)
    with psycopg.connect(pg_store.dsn, autocommit=True) as conn:
        again = revoke_lease(conn, pg_store.schema, rid)
    assert not again.revoked
    assert pg_store.claim(rid, B, 30) is None
    assert pg_store.claim(rid, B, 30, now=stuck.expires_at + MS) is not None


def test_revocation_says_when_the_lease_is_claimable_again(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "r4")
    stuck = pg_store.claim(rid, A, 600)
    assert stuck is not None
    with psycopg.connect(pg_store.dsn, autocommit=True) as conn:
        done = revoke_lease(conn, pg_store.schema, rid)
        assert done.claimable_at == stuck.expires_at
        again = revoke_lease(conn, pg_store.schema, rid)
        assert not again.revoked and again.claimable_at == stuck.expires_at
    expired = pg_store.ensure_resource("job", "r5")
    assert pg_store.claim(expired, A, 60, now=datetime.now(UTC) - timedelta(hours=1))
    with psycopg.connect(pg_store.dsn, autocommit=True) as conn:
        done = revoke_lease(conn, pg_store.schema, expired)
    assert done.revoked and done.claimable_at is None
