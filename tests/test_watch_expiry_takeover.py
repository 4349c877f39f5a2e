"""A takeover of an expired lease records the old generation's expiry (sql/0007),
exactly once even when the reaper races it; and `_bump`'s event-order guard
reaches callers as `EventOrderError`.

Real PostgreSQL, real concurrent connections. The backend-neutral part (event
history of a takeover) is also in the conformance suite, for SQLite too.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    ConflictError,
    EventOrderError,
    Owner,
    Permit,
    PostgresStore,
)
from pglease.postgres import _core
from pglease.types import Event
from pglease.watch import Watcher, reap_once
from tests._lock_helpers import lock_waiters, wait_until

A = Owner("host", "a")
B = Owner("host", "b")
C = Owner("host", "c")


def history(events: list[Event]) -> list[tuple[str, int, Owner | None, int | None]]:
    return [(e.type, e.revision, e.actor, e.lease_generation) for e in events]


def expire(store: PostgresStore, rid: str, owner: Owner = A, ttl: float = 0.05) -> int:
    """Claim with a short TTL and let it run out; return the generation."""
    claim = store.claim(rid, owner, ttl)
    assert claim is not None
    time.sleep(ttl + 0.05)
    return claim.generation


# --------------------------------------------------------------------------- takeover


def test_takeover_of_unreaped_lease_writes_expired_then_claimed(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "t1")
    old = pg_store.claim(rid, A, 0.05)
    assert old is not None
    time.sleep(0.1)
    with Watcher(pg_store, after="now") as w:
        new = pg_store.claim(rid, B, 5)
        assert new is not None and (new.generation, new.revision) == (2, 3)
        seen = [w.get(5), w.get(5)]
    # Watchers get the expiry first, then the claim, with consecutive revisions.
    assert [(e.type, e.revision) for e in seen if e is not None] == [
        ("lease.expired", 2),
        ("lease.claimed", 3),
    ]
    events = pg_store.events(rid)
    assert history(events) == [
        ("lease.claimed", 1, A, 1),
        ("lease.expired", 2, A, 1),
        ("lease.claimed", 3, B, 2),
    ]
    expired = events[1]
    assert expired.lease_expires_at == old.expires_at  # what the old holder had
    assert expired.payload is None
    # The claim's revision is the resource's and its own event's.
    assert pg_store.get(rid).revision == new.revision == events[-1].revision
    assert pg_store.mutate(Permit(rid, new.revision, new), "run.step").revision == 4
    # The taken-over generation is recorded: the reaper writes nothing for it,
    # and nothing for the live new lease.
    assert reap_once(pg_store) == 0
    assert len(pg_store.events(rid)) == 4


def test_takeover_of_reaped_lease_writes_no_second_expired(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "t2")
    expire(pg_store, rid)
    assert reap_once(pg_store) == 1
    new = pg_store.claim(rid, B, 5)
    assert new is not None and new.revision == 3
    assert history(pg_store.events(rid)) == [
        ("lease.claimed", 1, A, 1),
        ("lease.expired", 2, A, 1),
        ("lease.claimed", 3, B, 2),
    ]


def test_claim_of_free_or_released_lease_writes_only_the_claim(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "t3")
    first = pg_store.claim(rid, A, 0.05)
    assert first is not None
    time.sleep(0.1)
    pg_store.release(first)  # released after it ran out: the holder is gone
    second = pg_store.claim(rid, B, 5)
    assert second is not None and second.revision == 3
    assert pg_store.claim(rid, C, 5) is None  # refused: nothing written
    assert [e.type for e in pg_store.events(rid)] == [
        "lease.claimed",
        "lease.released",
        "lease.claimed",
    ]


def test_fair_acquire_takeover_writes_expired_first(pg_store: PostgresStore) -> None:
    # acquire(fair=True) claims through claim_fair (0005), which calls claim.
    rid = pg_store.ensure_resource("run", "t4")
    expire(pg_store, rid)
    claim = pg_store.acquire("run", "t4", B, 5, timeout=5, fair=True)
    assert (claim.generation, claim.revision) == (2, 3)
    assert history(pg_store.events(rid)) == [
        ("lease.claimed", 1, A, 1),
        ("lease.expired", 2, A, 1),
        ("lease.claimed", 3, B, 2),
    ]


async def test_async_takeover_writes_expired_then_claimed(
    apg_store: AsyncPostgresStore,
) -> None:
    import asyncio

    rid = await apg_store.ensure_resource("run", "t5")
    assert await apg_store.claim(rid, A, 0.05) is not None
    await asyncio.sleep(0.1)
    new = await apg_store.claim(rid, B, 5)
    assert new is not None and (new.generation, new.revision) == (2, 3)
    events = await apg_store.events(rid)
    assert history(events) == [
        ("lease.claimed", 1, A, 1),
        ("lease.expired", 2, A, 1),
        ("lease.claimed", 3, B, 2),
    ]


def test_reaper_skips_a_lease_a_takeover_is_writing(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """Takeover first: its transaction holds the lease row; the reaper passes
    it by (SKIP LOCKED), and after the commit there is nothing left to reap."""
    rid = pg_store.ensure_resource("run", "t6")
    expire(pg_store, rid)
    with psycopg.connect(pg_dsn) as taker:
        row = taker.execute(
            f'SELECT claimed, revision FROM "{schema}".claim(%s, %s, %s, %s, 5, NULL, NULL)',
            [rid, B.type, B.id, hashlib.sha256(b"token-b").digest()],
        ).fetchone()
        assert row == (True, 3)
        assert reap_once(pg_store) == 0  # row locked by the open takeover
        taker.commit()
    assert reap_once(pg_store) == 0
    assert history(pg_store.events(rid)) == [
        ("lease.claimed", 1, A, 1),
        ("lease.expired", 2, A, 1),
        ("lease.claimed", 3, B, 2),
    ]


def test_takeover_waiting_for_the_reaper_writes_no_second_expired(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """Reaper first: the claim waits for its row lock, then sees the marker."""
    rid = pg_store.ensure_resource("run", "t7")
    expire(pg_store, rid)
    result: list[Any] = []
    with psycopg.connect(pg_dsn) as reaper:
        row = reaper.execute(f'SELECT "{schema}".reap_expired(10)').fetchone()
        assert row == (1,)
        t = threading.Thread(target=lambda: result.append(pg_store.claim(rid, B, 5)))
        t.start()
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".claim') == 1)
        reaper.commit()
    t.join(10)
    assert not t.is_alive()
    [claim] = result
    assert claim is not None and (claim.generation, claim.revision) == (2, 3)
    assert history(pg_store.events(rid)) == [
        ("lease.claimed", 1, A, 1),
        ("lease.expired", 2, A, 1),
        ("lease.claimed", 3, B, 2),
    ]


# --------------------------------------------------------------------------- order guard


def _order_guard_error(pg_store: PostgresStore, pg_dsn: str, schema: str) -> psycopg.Error:
    """Provoke `_bump`'s order guard for real and return the raw error.

    Transaction A takes its xid first; B then writes revision 1 of the resource
    and commits (B's xid is larger); A's write of revision 2 would be read
    before revision 1 by watchers, who consume the log in xid order.
    """
    rid = pg_store.ensure_resource("run", "order")
    with psycopg.connect(pg_dsn) as a:
        a.execute("SELECT pg_current_xact_id()")  # A's xid, before B's
        assert pg_store.mutate(Permit(rid, 0), "run.b").revision == 1  # B, committed
        with pytest.raises(psycopg.Error) as info:
            a.execute(
                f'SELECT * FROM "{schema}".mutate_begin(%s, NULL, %s, NULL, NULL, NULL,'
                " NULL, 'host', 'a', NULL, NULL)",
                [rid, "run.a"],
            )
        a.rollback()
    # Nothing of A's stayed.
    assert [e.type for e in pg_store.events(rid)] == ["run.b"]
    return info.value


def test_order_guard_maps_to_event_order_error(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    raw = _order_guard_error(pg_store, pg_dsn, schema)
    assert raw.diag.sqlstate == "40001"
    mapped = _core.translate(raw)
    assert isinstance(mapped, EventOrderError) and isinstance(mapped, ConflictError)
    assert "event order" in str(mapped)


def test_order_guard_through_the_claim_function(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("run", "order-claim")
    with psycopg.connect(pg_dsn) as a:
        a.execute("SELECT pg_current_xact_id()")
        assert pg_store.mutate(Permit(rid, 0), "run.b").revision == 1
        with pytest.raises(psycopg.Error) as info:
            a.execute(
                f'SELECT * FROM "{schema}".claim(%s, %s, %s, %s, 5, NULL, NULL)',
                [rid, A.type, A.id, hashlib.sha256(b"token-a").digest()],
            )
        a.rollback()
    assert isinstance(_core.translate(info.value), EventOrderError)
    state = pg_store.get(rid)
    assert state.revision == 1 and state.lease.owner is None


def test_other_serialization_failures_are_not_renamed(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn, pytest.raises(psycopg.Error) as info:
        conn.execute(
            "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access'"
            " USING ERRCODE = '40001'; END $$"
        )
    assert info.value.diag.sqlstate == "40001"
    assert _core.translate(info.value) is None
