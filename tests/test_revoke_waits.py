"""A revoke fences the holder at once, yet nobody can claim before the revoked
holder's last granted expiry (migration 0017, `revoke_lease` and `claim`).

The database cannot stop a process on another host: the revoked holder's
runner stops its command by its own trust window, which closes before that
expiry. Time is driven by the test clock (`now=` on the rival's claims); the
revoke itself reads the database clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

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


def test_reads_show_a_revoked_lease_as_free_but_not_claimable_yet(
    pg_store: PostgresStore, pg_dsn: str
) -> None:
    """get, list_resources, `pglease get` and `pglease ls` name the wait: a
    revoked lease is free (no holder) yet refused until the revoked holder's
    last expiry, and a reader shown plain "free" would claim in vain."""
    rid = pg_store.ensure_resource("job", "shown")
    other = pg_store.ensure_resource("job", "plain")
    stuck = pg_store.claim(rid, A, 600)
    assert stuck is not None
    _revoke(pg_store, rid)
    state = pg_store.get(rid)
    assert state.lease.owner is None and not state.lease.held
    assert state.lease.claimable_at == stuck.expires_at
    # Judged at the reader's time: after the old expiry nothing is waited for.
    assert pg_store.get(rid, now=stuck.expires_at + MS).lease.claimable_at is None
    listed = {s.id: s.lease.claimable_at for s in pg_store.list_resources("job")}
    assert listed == {rid: stuck.expires_at, other: None}

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", pg_store.schema,
             *args],
            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    got = json.loads(cli("--json", "get", "job", "shown"))
    assert got["lease"]["held"] is False and got["lease"]["holder"] is None
    assert datetime.fromisoformat(got["lease"]["claimable_at"]) == stuck.expires_at
    assert json.loads(cli("--json", "get", "job", "plain"))["lease"]["claimable_at"] is None
    text = cli("get", "job", "shown")
    assert "lease:      free (revoked)" in text and "claimable again at" in text
    rows = {r["key"]: r for r in json.loads(cli("--json", "ls"))}
    assert datetime.fromisoformat(rows["shown"]["claimable_at"]) == stuck.expires_at
    assert rows["plain"]["claimable_at"] is None
    table = {line.split()[1]: line for line in cli("ls").splitlines()[1:]}
    assert "(revoked)" in table["shown"] and "until claimable" in table["shown"]
    assert "(revoked)" not in table["plain"]
