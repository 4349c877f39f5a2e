"""The batch heartbeat function: every status in one call, by the database's rules."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pglease import Claim, Owner, PostgresStore
from pglease.ids import resource_id

A = Owner("host", "a")
B = Owner("host", "b")


def beat(dsn: str, schema: str, claims: list[Claim], ttl: float = 30) -> dict[str, tuple[Any, ...]]:
    rows = _call(dsn, schema, claims, ttl)
    by_id = {r[0]: r for r in rows}
    assert len(by_id) == len(rows) == len(claims), rows  # one row per requested lease
    return by_id


def _call(dsn: str, schema: str, claims: list[Claim], ttl: float) -> list[tuple[Any, ...]]:
    args = [
        [c.resource_id for c in claims],
        [c.generation for c in claims],
        [hashlib.sha256(c.token.encode()).digest() for c in claims],
        [c.owner.type for c in claims],
        [c.owner.id for c in claims],
        [ttl] * len(claims),
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            tuple(r)
            for r in conn.execute(
                f'SELECT * FROM "{schema}".heartbeat(%s::text[], %s::bigint[], %s::bytea[],'
                " %s::text[], %s::text[], %s::float8[])",
                args,
            ).fetchall()
        ]


def test_one_beat_reports_every_status(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    ids = {k: pg_store.ensure_resource("job", k) for k in ("live", "lost", "old", "busy")}
    live = pg_store.claim(ids["live"], A, 30)
    taken = pg_store.claim(ids["lost"], A, 30, now=datetime.now(UTC) - timedelta(hours=1))
    old = pg_store.claim(ids["old"], A, 1, now=datetime.now(UTC) - timedelta(hours=1))
    busy = pg_store.claim(ids["busy"], A, 30)
    assert live and taken and old and busy
    assert pg_store.claim(ids["lost"], B, 30) is not None  # taken over after its expiry
    ghost = Claim(resource_id("job", "ghost"), A, live.token, 1, live.expires_at, 0)
    with psycopg.connect(pg_dsn) as locker:
        locker.execute(
            f'SELECT 1 FROM "{schema}".leases WHERE resource_id = %s FOR UPDATE', [ids["busy"]]
        )
        # Unsorted, as any caller may send them; the function locks in id order itself.
        got = beat(pg_dsn, schema, [busy, ghost, old, taken, live], ttl=60)
        locker.rollback()
    assert {rid: row[1] for rid, row in got.items()} == {
        ids["live"]: "renewed",
        ids["lost"]: "lost",
        ids["old"]: "expired",
        ids["busy"]: "busy",
        ghost.resource_id: "unknown",
    }
    assert got[ids["lost"]][3] == taken.generation + 1  # the generation that is current now
    # Only the renewed lease moved: 60 s from the beat, no revision, no event.
    state = pg_store.get(ids["live"])
    assert state.lease.expires_at == got[ids["live"]][2]
    assert state.lease.expires_at is not None and state.lease.expires_at > live.expires_at
    assert state.revision == live.revision
    assert pg_store.get(ids["busy"]).lease.expires_at == busy.expires_at
    # The busy lease beats once the row is free again.
    assert beat(pg_dsn, schema, [busy])[ids["busy"]][1] == "renewed"


def test_a_beat_of_many_leases_renews_them_all(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    with pg_store.connection() as conn:
        conn.execute(
            f'SELECT "{schema}".ensure_resource(%s, %s || g) FROM generate_series(1, 2000) g',
            ["job", "k"],
        )
    claims = []
    for g in range(1, 501):
        claim = pg_store.claim(resource_id("job", f"k{g}"), A, 30)
        assert claim is not None
        claims.append(claim)
    rows = _call(pg_dsn, schema, claims, 30)
    assert sorted(r[0] for r in rows) == sorted(c.resource_id for c in claims)
    assert {r[1] for r in rows} == {"renewed"}
