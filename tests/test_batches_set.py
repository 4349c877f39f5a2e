"""Set-based batches (sql/functions/15_batch.sql) leave exactly what single calls
in resource-id order leave: a twin schema gets the same history through
claim / renew / release one by one, and every lease row, resource row, event
and per-item answer must be equal. Also: a 1000-item batch, lease rows not
moved by migration 0018 yet (NULL revision), and a batch in a transaction
that wrote before (its order guard)."""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pglease import Claim, Owner, PostgresStore
from pglease.ids import token_hash
from pglease.migrations import migrate
from pglease.testing import set_test_clock

T0 = datetime(2030, 1, 1, tzinfo=UTC)
KEYS = [f"k{i}" for i in range(10)]
#: The keys whose lease rows are made "not moved yet" (NULL revision).
UNMOVED = {"k5", "k6", "k8"}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def tok(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


@pytest.fixture
def twins(pg_dsn: str) -> Iterator[tuple[psycopg.Connection[Any], str, str]]:
    names = [f"t_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in names:
            migrate(conn, name)
            set_test_clock(conn, name)
        yield conn, names[0], names[1]
        for name in names:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def one(conn: psycopg.Connection[Any], query: str, args: list[Any]) -> tuple[Any, ...]:
    row = conn.execute(query, args).fetchone()
    assert row is not None
    return tuple(row)


def history(conn: psycopg.Connection[Any], s: str) -> dict[str, str]:
    """The same starting state in either schema, through single calls."""
    ids = {k: str(one(conn, f"SELECT {s}.ensure_resource('run', %s)", [k])[0]) for k in KEYS}

    def claim(key: str, owner: str, ttl: float, t: float) -> None:
        row = one(
            conn,
            f"SELECT claimed FROM {s}.claim(%s, 'host', %s, %s, %s, NULL, %s)",
            [ids[key], owner, tok(owner + key), ttl, at(t)],
        )
        assert row[0] is True

    for key in KEYS:
        if key != "k0":  # k0: free, never claimed
            claim(key, "b", 5 if key in ("k2", "k4", "k6", "k9") else 100, 0)
    # k1, k8: held (live); k2, k6: expired, expiry not recorded (a takeover);
    # k3, k5: released; k4: revoked, its holder's expiry past; k7: revoked,
    # still waited for; k9: expired, then renewed by nobody (recorded below).
    for key in ("k3", "k5"):
        one(
            conn,
            f"SELECT {s}.release(%s, 'host', 'b', 1, %s, NULL, %s)",
            [ids[key], tok("b" + key), at(1)],
        )
    for key in ("k4", "k7"):
        one(conn, f"SELECT revoked FROM {s}.revoke_lease(%s)", [ids[key]])
    # k9's expiry recorded (what the reaper writes), by the legacy reap_expired's
    # own statements: the test clock does not reach the reaper.
    conn.execute(
        f"UPDATE {s}.leases SET expired_generation = generation WHERE resource_id = %s",
        [ids["k9"]],
    )
    # Not moved yet (migration 0018): the revision back in `resources`.
    unmoved = [ids[k] for k in UNMOVED]
    conn.execute(
        f"UPDATE {s}.resources r SET revision = l.revision, updated_at = l.updated_at"
        f" FROM {s}.leases l WHERE l.resource_id = r.id AND r.id = ANY(%s)",
        [unmoved],
    )
    conn.execute(
        f"UPDATE {s}.leases SET revision = NULL, updated_at = NULL, last_xid = NULL"
        " WHERE resource_id = ANY(%s)",
        [unmoved],
    )
    return ids


def state(conn: psycopg.Connection[Any], s: str) -> dict[str, Any]:
    """Every lease row, resource row and event of schema `s`, keyed by key."""
    leases = conn.execute(
        f"SELECT r.key, to_jsonb(l) - 'last_xid' - 'resource_id', to_jsonb(r) - 'id'"
        f" FROM {s}.leases l JOIN {s}.resources r ON r.id = l.resource_id ORDER BY r.key"
    ).fetchall()
    events = conn.execute(
        f"SELECT r.key, e.revision, e.type, e.actor_type, e.actor_id, e.lease_generation,"
        f" e.lease_expires_at, e.created_at FROM {s}.events e JOIN {s}.resources r"
        " ON r.id = e.resource_id ORDER BY r.key, e.revision"
    ).fetchall()
    moved = conn.execute(
        f"SELECT r.key, l.revision IS NOT NULL AND l.last_xid IS NOT NULL FROM {s}.leases l"
        f" JOIN {s}.resources r ON r.id = l.resource_id ORDER BY r.key"
    ).fetchall()
    return {"leases": real(leases), "events": real(events), "moved": moved}


def real(rows: list[Any]) -> list[Any]:
    """Rows with the times of the database's own clock (revoke_lease reads no
    test clock; they fall before T0) as one placeholder: twins differ there."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, datetime) and value < T0 - timedelta(days=365):
            return "real"
        if isinstance(value, str) and value[:2] == "20" and value[4:5] == "-" and value < "2029":
            return "real"
        return value

    return [tuple(plain(v) for v in row) for row in rows]


def answers(conn: psycopg.Connection[Any], query: str, args: list[Any]) -> list[Any]:
    """One single call's answer, or its refusal (SQLSTATE and message)."""
    try:
        with conn.transaction():
            return [tuple(r) for r in conn.execute(query, args).fetchall()]
    except psycopg.Error as exc:
        return [(exc.diag.sqlstate, exc.diag.message_primary)]


def test_a_mixed_batch_leaves_what_single_calls_in_id_order_leave(
    twins: tuple[psycopg.Connection[Any], str, str],
) -> None:
    conn, batch, single = twins
    bid, sid = history(conn, batch), history(conn, single)
    assert state(conn, batch) == state(conn, single)
    order = ["k7", "k2", "k0", "k9", "k1", "k5", "k4", "k3", "k6", "k8"]  # not id order

    # Claims at t=10: free (k0, k3, k5), held (k1, k8), takeovers of an
    # unrecorded expiry (k2, k6, the second not moved), a recorded one (k9),
    # revoked and past (k4), revoked and waited for (k7).
    got = conn.execute(
        f"SELECT * FROM {batch}.claim_many(%s, 'host', 'a', %s, 30, %s)",
        [[bid[k] for k in order], [tok("a" + k) for k in order], at(10)],
    ).fetchall()
    assert [r[0] for r in got] == list(range(1, len(order) + 1))
    singles: dict[str, Any] = {}
    for key in sorted(order, key=lambda k: sid[k]):
        singles[key] = one(
            conn,
            f"SELECT * FROM {single}.claim(%s, 'host', 'a', %s, 30, NULL, %s)",
            [sid[key], tok("a" + key), at(10)],
        )
    assert [tuple(r[1:]) for r in got] == [singles[k] for k in order]
    assert {k for k, r in zip(order, got, strict=True) if r[1]} == {
        "k0", "k2", "k3", "k4", "k5", "k6", "k9"
    }  # fmt: skip
    assert state(conn, batch) == state(conn, single)

    # Renews at t=20 (the claims at t=10 last 30 s): current ones (some moved
    # by the claims just now), a wrong token, a superseded generation, a lease
    # held by another owner, and k1's holder b renewing its own.
    items = [
        ("k0", "a", 1, "a"),
        ("k2", "a", 2, "a"),
        ("k3", "a", 2, "x"),  # token does not match
        ("k5", "a", 1, "a"),  # superseded (generation 2 is current)
        ("k1", "b", 1, "b"),  # b's own live lease
        ("k8", "a", 1, "a"),  # held by b
        ("k6", "a", 2, "a"),
        ("k9", "a", 2, "a"),
    ]

    def lease_args(rows: list[tuple[str, str, int, str]], ids: dict[str, str]) -> list[Any]:
        return [
            [ids[k] for k, *_ in rows],
            ["host"] * len(rows),
            [o for _, o, _, _ in rows],
            [g for _, _, g, _ in rows],
            [tok(t + k) for k, _, _, t in rows],
        ]

    def single_lease(fn: str, rows: list[tuple[str, str, int, str]], tail: list[Any]) -> list[Any]:
        out: dict[str, Any] = {}
        marks = ", ".join(["%s"] * len(tail))
        for k, o, g, t in sorted(rows, key=lambda r: sid[r[0]]):
            out[k] = answers(
                conn,
                f"SELECT * FROM {single}.{fn}(%s, 'host', %s, %s, %s, {marks})",
                [sid[k], o, g, tok(t + k), *tail],
            )
        return [out[k] for k, *_ in rows]

    def as_single(row: tuple[Any, ...]) -> list[Any]:
        *ok, code, message = row[1:]
        return [(code, message)] if code is not None else [tuple(ok)]

    got = conn.execute(
        f"SELECT * FROM {batch}.renew_many(%s, %s, %s, %s, %s, 30, %s)",
        [*lease_args(items, bid), at(20)],
    ).fetchall()
    assert [r[0] for r in got] == list(range(1, len(items) + 1))
    assert [as_single(r) for r in got] == single_lease("renew", items, [30, None, at(20)])
    assert [r[3] for r in got] == [None, None, "PGL03", "PGL03", None, "PGL03", None, None]
    assert state(conn, batch) == state(conn, single)

    # Renews at t=60: every lease renewed at t=20 has run out (PGL04).
    late = items[:2]
    got = conn.execute(
        f"SELECT * FROM {batch}.renew_many(%s, %s, %s, %s, %s, 30, %s)",
        [*lease_args(late, bid), at(60)],
    ).fetchall()
    assert [r[3] for r in got] == ["PGL04", "PGL04"]
    assert [as_single(r) for r in got] == single_lease("renew", late, [30, None, at(60)])
    assert state(conn, batch) == state(conn, single)

    # Releases at t=61: current (expired or not), not current.
    items = [
        ("k6", "a", 2, "a"),
        ("k0", "a", 1, "a"),
        ("k3", "a", 1, "a"),  # superseded
        ("k9", "a", 2, "a"),
        ("k1", "b", 1, "b"),
        ("k4", "a", 2, "x"),  # token does not match
    ]
    got = conn.execute(
        f"SELECT * FROM {batch}.release_many(%s, %s, %s, %s, %s, %s)",
        [*lease_args(items, bid), at(61)],
    ).fetchall()
    assert [as_single(r) for r in got] == single_lease("release", items, [None, at(61)])
    assert [r[2] for r in got] == [None, None, "PGL03", None, None, "PGL03"]
    assert state(conn, batch) == state(conn, single)
    # Every row written since it was made unmoved is moved (revision and xid);
    # k8 was only ever refused.
    assert [k for k, moved in state(conn, batch)["moved"] if not moved] == ["k8"]


def test_a_batch_refused_whole_by_an_unknown_resource_writes_nothing(
    twins: tuple[psycopg.Connection[Any], str, str],
) -> None:
    conn, s, _ = twins
    ids = history(conn, s)
    before = state(conn, s)
    unknown = "run-" + "f" * 40
    rids = [ids["k0"], ids["k2"], unknown]  # a grant, a takeover, then the unknown one
    with pytest.raises(psycopg.Error) as info:
        conn.execute(
            f"SELECT * FROM {s}.claim_many(%s, 'host', 'a', %s, 30, %s)",
            [rids, [tok(r) for r in rids], at(10)],
        )
    assert info.value.diag.sqlstate == "PGL01" and unknown in str(info.value)
    assert state(conn, s) == before


def test_a_batch_in_a_transaction_that_wrote_before(
    twins: tuple[psycopg.Connection[Any], str, str],
) -> None:
    """The transaction had an id before the queue locks: the statement reads the
    order guard's previous xids (none is newer here) and writes as usual."""
    conn, s, twin = twins
    ids, tids = history(conn, s), history(conn, twin)
    keys = ["k0", "k2", "k5", "k9"]
    with conn.transaction():
        one(conn, f"SELECT {s}.ensure_resource('run', 'other')", [])
        got = conn.execute(
            f"SELECT * FROM {s}.claim_many(%s, 'host', 'a', %s, 30, %s)",
            [[ids[k] for k in keys], [tok("a" + k) for k in keys], at(10)],
        ).fetchall()
    one(conn, f"SELECT {twin}.ensure_resource('run', 'other')", [])
    for key in sorted(keys, key=lambda k: tids[k]):
        one(
            conn,
            f"SELECT * FROM {twin}.claim(%s, 'host', 'a', %s, 30, NULL, %s)",
            [tids[key], tok("a" + key), at(10)],
        )
    assert all(r[1] for r in got)
    assert state(conn, s) == state(conn, twin)


def test_a_batch_of_1000(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    """The largest batch: one index probe per item (see the plan note in
    15_batch.sql); half the leases held by someone else, some not moved yet."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rids = [
            str(r[0])
            for r in conn.execute(
                f"SELECT {schema}.ensure_resource('run', 'big' || g)"
                " FROM generate_series(1, 1000) g"
            ).fetchall()
        ]
        conn.execute(
            f"UPDATE {schema}.leases SET revision = NULL, updated_at = NULL"
            " WHERE resource_id = ANY(%s)",
            [rids[::3]],
        )
    b = Owner("host", "b")
    a = Owner("host", "a")
    held = pg_store.claim_many(rids[::2], b, 60, now=at(0))
    assert all(isinstance(c, Claim) for c in held)
    got = pg_store.claim_many(list(reversed(rids)), a, 60, now=at(1))
    mine = [c for c in got if c is not None]
    assert len(mine) == 500
    assert {c.resource_id for c in mine} == set(rids[1::2])
    renewed = pg_store.renew_many([*mine, *held[:10]], 60, now=at(2))  # type: ignore[list-item]
    assert all(isinstance(c, Claim) for c in renewed)
    out = pg_store.release_many(renewed, now=at(3))  # type: ignore[arg-type]
    assert all(isinstance(x, int) for x in out)
    for rid in rids[1:20:2]:
        events = pg_store.events(rid)
        assert [(e.type, e.revision) for e in events] == [
            ("lease.claimed", 1), ("lease.renewed", 2), ("lease.released", 3)
        ]  # fmt: skip
    for rid in rids[0:20:2]:  # b's first ten: renewed and released by a's batch
        assert pg_store.get(rid, now=at(3)).revision == 3


def test_items_that_succeed_take_no_subtransaction(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """100 renews and releases that succeed next to some that fail: the
    transaction keeps no subxid (more than 64 would overflow the cache)."""
    rids = [pg_store.ensure_resource("run", f"sx{i}") for i in range(110)]
    claims = pg_store.claim_many(rids, Owner("host", "a"), 60, now=at(0))
    assert all(isinstance(c, Claim) for c in claims)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if conn.info.server_version < 160000:
            pytest.skip("pg_stat_get_backend_subxact needs PostgreSQL 16")
        for fn, tail in (("renew_many", [30, at(1)]), ("release_many", [at(2)])):
            marks = ", ".join(["%s"] * len(tail))
            with conn.transaction():
                rows = conn.execute(
                    f"SELECT error_code FROM {schema}.{fn}(%s, %s, %s, %s, %s, {marks})",
                    [
                        rids,
                        ["host"] * 110,
                        ["a"] * 100 + ["b"] * 10,  # the last 10: not current
                        [1] * 110,
                        [token_hash(c.token) for c in claims if c is not None],
                        *tail,
                    ],
                ).fetchall()
                # The backend's status, read for the first time in this
                # transaction, so after the batch.
                (count, overflowed) = one(
                    conn,
                    "SELECT x.subxact_count, x.subxact_overflowed"
                    " FROM pg_stat_get_backend_idset() b(id),"
                    " pg_stat_get_backend_subxact(b.id) x"
                    " WHERE pg_stat_get_backend_pid(b.id) = pg_backend_pid()",
                    [],
                )
            assert count == 0 and not overflowed
            assert [r[0] for r in rows] == [None] * 100 + ["PGL03"] * 10


def test_batches_next_to_heartbeats_that_lock_their_rows(pg_dsn: str, schema: str) -> None:
    """Heartbeats lock the rows they beat (FOR UPDATE SKIP LOCKED, no queue
    lock) while two batch threads claim and release the same leases in
    opposite orders: a batch's UPDATE waits for such a row and judges it
    again, never deadlocks, and every lease's history stays in order."""
    with PostgresStore(pg_dsn, schema=schema, max_size=4, lock_timeout=30.0) as store:
        rids = [store.ensure_resource("run", f"h{i}") for i in range(30)]
        failures: list[BaseException] = []
        stop = threading.Event()

        def batches(order: list[str], owner: Owner) -> None:
            try:
                for _ in range(40):
                    got = [c for c in store.claim_many(order, owner, 30) if c is not None]
                    if got:
                        renewed = store.renew_many(got, 30)
                        assert all(isinstance(c, Claim) for c in renewed), renewed
                        out = store.release_many(renewed)  # type: ignore[arg-type]
                        assert all(isinstance(x, int) for x in out), out
            except BaseException as exc:
                failures.append(exc)

        def beats() -> None:
            n = len(rids)
            try:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    while not stop.is_set():
                        conn.execute(
                            f'SELECT count(*) FROM "{schema}".heartbeat(%s, %s, %s, %s, %s, %s)',
                            [rids, [1] * n, [tok("x")] * n, ["host"] * n, ["a"] * n, [30.0] * n],
                        )
            except BaseException as exc:
                failures.append(exc)

        beater = threading.Thread(target=beats, daemon=True)
        beater.start()
        threads = [
            threading.Thread(target=batches, args=(sorted(rids), Owner("host", "a")), daemon=True),
            threading.Thread(
                target=batches, args=(sorted(rids, reverse=True), Owner("host", "b")), daemon=True
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.set()
        beater.join(30)
        assert not any(t.is_alive() for t in [*threads, beater])
        assert not failures, failures
        for rid in rids:
            events = store.events(rid, limit=10_000)
            assert [e.revision for e in events] == list(range(1, len(events) + 1))
            assert [e.type for e in events] == [
                "lease.claimed", "lease.renewed", "lease.released"
            ] * (len(events) // 3)  # fmt: skip
            claimed = [e.lease_generation for e in events if e.type == "lease.claimed"]
            assert claimed == list(range(1, len(claimed) + 1))
