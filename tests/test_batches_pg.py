"""Batches on PostgreSQL: concurrent batches in opposite orders, the SQL
functions' own input checks, the client role, and a batch whose answer never
comes (outcome unknown, within the client deadline)."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    BatchOutcomeUnknownError,
    Claim,
    CommitOutcomeUnknownError,
    Owner,
    PgleaseError,
    PostgresStore,
)
from pglease.ids import token_hash
from pglease.roles import grant

from ._stall_proxy import StallProxy
from .test_network_stall_store import _ended, _ended_async, _ended_in_time, _options
from .test_trust import Roles, roles  # noqa: F401  (the fixture)

A = Owner("host", "a")
B = Owner("host", "b")


def _rows(dsn: str, text: str, args: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(text, args).fetchall()  # type: ignore[arg-type]


def test_batches_in_opposite_orders_never_deadlock_nor_fail_the_order_guard(
    pg_dsn: str, schema: str
) -> None:
    """Two threads (and a third of single calls) over the same 40 keys, one in
    id order, one in reverse: every batch locks in id order, so neither waits
    for the other in a cycle, and none writes before it holds its queue locks."""
    with PostgresStore(pg_dsn, schema=schema, max_size=4, lock_timeout=30.0) as store:
        rids = [store.ensure_resource("run", f"c{i}") for i in range(40)]
        failures: list[BaseException] = []
        generations: dict[str, list[int]] = {rid: [] for rid in rids}
        lock = threading.Lock()
        stop = time.monotonic() + 4.0

        def batches(order: list[str], owner: Owner) -> None:
            try:
                rounds = 0
                while time.monotonic() < stop or rounds < 5:
                    rounds += 1
                    got = store.claim_many(order, owner, 30)
                    mine = [c for c in got if c is not None]
                    with lock:
                        for c in mine:
                            generations[c.resource_id].append(c.generation)
                    if mine:
                        out = store.release_many(mine)
                        assert all(isinstance(x, int) for x in out), out
            except BaseException as exc:
                failures.append(exc)

        def singles() -> None:
            try:
                while time.monotonic() < stop:
                    for rid in rids[::7]:
                        c = store.claim(rid, Owner("host", "single"), 30)
                        if c is not None:
                            with lock:
                                generations[rid].append(c.generation)
                            store.release(c)
            except BaseException as exc:
                failures.append(exc)

        threads = [
            threading.Thread(target=batches, args=(sorted(rids), A), daemon=True),
            threading.Thread(target=batches, args=(sorted(rids, reverse=True), B), daemon=True),
            threading.Thread(target=singles, daemon=True),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a batch thread never finished"
        assert not failures, failures
        for rid in rids:
            gens = generations[rid]
            assert gens, rid
            assert sorted(gens) == list(range(1, len(gens) + 1))  # each granted once, no gaps
            state = store.get(rid)
            assert state.lease.generation == len(gens) and state.lease.owner is None
            events = store.events(rid, limit=10_000)
            assert [e.revision for e in events] == list(range(1, len(events) + 1))
            claimed = [e.lease_generation for e in events if e.type == "lease.claimed"]
            assert claimed == list(range(1, len(gens) + 1))  # strictly increasing, in order


@pytest.mark.parametrize(
    ("call", "code", "words"),
    [
        ("claim_many(ARRAY[]::text[], 'host', 'a', ARRAY[]::bytea[], 10, NULL)", "PGL21",
         "1 to 1000"),
        ("claim_many(NULL, 'host', 'a', NULL, 10, NULL)", "PGL21", "1 to 1000"),
        ("claim_many(array_fill('run-' || repeat('0', 40), ARRAY[1001]), 'host', 'a',"
         " array_fill(sha256('x'), ARRAY[1001]), 10, NULL)", "PGL21", "1 to 1000"),
        ("claim_many(ARRAY[%(a)s, %(b)s, %(a)s], 'host', 'a', ARRAY[%(t)s, %(t)s, %(t)s], 10,"
         " NULL)", "PGL21", "more than once"),
        ("claim_many(ARRAY[%(a)s, 'nope'], 'host', 'a', ARRAY[%(t)s, %(t)s], 10, NULL)", "PGL12",
         "not of the form"),
        ("claim_many(ARRAY[%(a)s, %(b)s], 'host', 'a', ARRAY[%(t)s], 10, NULL)", "PGL21",
         "one token hash per resource"),
        ("claim_many(ARRAY[%(a)s, %(b)s], 'host', 'a', ARRAY[%(t)s, '\\x00'::bytea], 10, NULL)",
         "PGL14", "32-byte"),
        ("claim_many(ARRAY[%(a)s], 'Host', 'a', ARRAY[%(t)s], 10, NULL)", "PGL13", "owner"),
        ("claim_many(ARRAY[%(a)s], 'host', 'a', ARRAY[%(t)s], 'NaN', NULL)", "PGL11", "ttl"),
        ("renew_many(ARRAY[%(a)s, %(b)s], ARRAY['host'], ARRAY['a', 'a'], ARRAY[1, 1],"
         " ARRAY[%(t)s, %(t)s], 10, NULL)", "PGL21", "five arrays"),
        ("renew_many(ARRAY[%(a)s, %(b)s], ARRAY['host', 'host'], ARRAY['a', ''], ARRAY[1, 1],"
         " ARRAY[%(t)s, %(t)s], 10, NULL)", "PGL13", "owner id"),
        ("release_many(ARRAY[%(a)s, %(b)s], ARRAY['host', 'host'], ARRAY['a', 'a'], ARRAY[1, -1],"
         " ARRAY[%(t)s, %(t)s], NULL)", "PGL15", "generation"),
        ("release_many(ARRAY[%(a)s, %(a)s], ARRAY['host', 'host'], ARRAY['a', 'a'], ARRAY[1, 1],"
         " ARRAY[%(t)s, %(t)s], NULL)", "PGL21", "more than once"),
    ],
)  # fmt: skip
def test_direct_sql_batches_check_their_inputs_and_change_nothing(
    pg_store: PostgresStore, pg_dsn: str, schema: str, call: str, code: str, words: str
) -> None:
    a, b = (pg_store.ensure_resource("run", k) for k in ("a", "b"))
    claim = pg_store.claim(a, A, 30)
    assert claim is not None
    before = _rows(pg_dsn, f'SELECT count(*), sum(revision) FROM "{schema}".resources')
    with psycopg.connect(pg_dsn, autocommit=True) as conn, pytest.raises(psycopg.Error) as info:
        conn.execute(
            f'SELECT * FROM "{schema}".' + call,
            {"a": a, "b": b, "t": token_hash(claim.token)},
        )
    assert info.value.diag.sqlstate == code, info.value
    assert words in str(info.value)
    assert _rows(pg_dsn, f'SELECT count(*), sum(revision) FROM "{schema}".resources') == before


def test_a_client_role_runs_batches(
    pg_store: PostgresStore,
    roles: Roles,  # noqa: F811
    pg_dsn: str,
    schema: str,
) -> None:
    name, dsn = roles.make("client")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, name, "client")
    with PostgresStore(dsn, schema=schema, max_size=2) as client:
        rids = [client.ensure_resource("job", f"r{i}") for i in range(3)]
        claims = client.claim_many(rids, A, 30)
        assert all(isinstance(c, Claim) for c in claims)
        renewed = client.renew_many(claims, 30)  # type: ignore[arg-type]
        assert all(isinstance(c, Claim) for c in renewed)
        assert all(isinstance(r, int) for r in client.release_many(renewed))  # type: ignore[arg-type]


def test_sync_claim_many_stalled_is_outcome_unknown_within_the_deadline(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rids = [store.ensure_resource("job", f"s{i}") for i in range(3)]
        stall_proxy.pause()
        error, elapsed = _ended(lambda: store.claim_many(rids, A, 30))
        _ended_in_time(stall_proxy, error, elapsed)
        stall_proxy.resume()
        assert isinstance(error, BatchOutcomeUnknownError), error
        assert isinstance(error, CommitOutcomeUnknownError)
        assert error.operation == "claim_many" and error.resource_ids == tuple(rids)
        assert error.owner == A and error.tokens is not None and len(error.tokens) == 3
        assert "no answer from PostgreSQL" in str(error)
        # The store goes on, on a new connection; the batch either committed
        # whole or not at all.
        with PostgresStore(pg_dsn, schema=schema, max_size=1) as direct:
            deadline = time.monotonic() + 10
            while True:
                owners = {direct.get(rid).lease.owner for rid in rids}
                if owners == {A} or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert owners in ({A}, {None})


async def test_async_release_many_stalled_is_outcome_unknown_within_the_deadline(
    stall_proxy: StallProxy, schema: str
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_options(schema)) as store:
        rids = [await store.ensure_resource("job", f"a{i}") for i in range(2)]
        claims = await store.claim_many(rids, A, 30)
        stall_proxy.pause()
        error = await _ended_async(stall_proxy, store.release_many(claims))  # type: ignore[arg-type]
        stall_proxy.resume()
        assert isinstance(error, BatchOutcomeUnknownError), error
        assert error.operation == "release_many" and error.resource_ids == tuple(rids)
        assert isinstance(error, PgleaseError) and "no answer from PostgreSQL" in str(error)


def test_batches_in_pooler_mode(pg_dsn: str, schema: str) -> None:
    """Pooler mode sends the limits as SET LOCAL in the batch's own transaction."""
    with PostgresStore(pg_dsn, schema=schema, pooler=True, max_size=2) as store:
        rids = [store.ensure_resource("job", f"p{i}") for i in range(3)]
        claims = store.claim_many(rids, A, 30)
        assert all(isinstance(c, Claim) for c in claims)
        assert all(isinstance(r, int) for r in store.release_many(claims))  # type: ignore[arg-type]


async def test_async_batches_in_pooler_mode(pg_dsn: str, schema: str) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, pooler=True, max_size=2) as store:
        rids = [await store.ensure_resource("job", f"q{i}") for i in range(3)]
        claims = await store.claim_many(rids, A, 30)
        renewed = await store.renew_many(claims, 30)  # type: ignore[arg-type]
        assert all(isinstance(c, Claim) for c in renewed)
        assert all(isinstance(r, int) for r in await store.release_many(renewed))  # type: ignore[arg-type]
