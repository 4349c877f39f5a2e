"""PostgreSQL-only behaviour: storage details, commit ordering, migrations, real processes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import threading
import time
from datetime import UTC
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    CommitOutcomeUnknownError,
    LeaseLostError,
    MigrationChecksumError,
    MigrationError,
    Owner,
    PayloadConflictError,
    Permit,
    PostgresStore,
)
from pglease.migrations import load_migrations

ROOT = Path(__file__).resolve().parent.parent


def sql(dsn: str, query: str, args: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query.encode(), args)
        return cur.fetchall() if cur.description else []


def _claims_waiting(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    """The backends whose claim (in `schema`) waits on a lock."""
    query = "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s"
    return sql(dsn, query, [f'%"{schema}".claim(%'])


def test_only_the_token_hash_is_stored(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    rid = pg_store.ensure_resource("run", "t")
    claim = pg_store.claim(rid, Owner("host", "a"), 30)
    assert claim is not None
    [row] = sql(pg_dsn, f"SELECT * FROM {schema}.leases")
    assert hashlib.sha256(claim.token.encode()).digest() in [
        bytes(v) for v in row if isinstance(v, bytes)
    ]
    assert claim.token not in repr(row)
    assert claim.token not in repr(claim)


def test_same_hash_with_different_bytes_is_refused(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("run", "p")
    pg_store.mutate(Permit(rid, 0), "run.a", payload={"a": 1})
    sql(pg_dsn, f"UPDATE {schema}.payloads SET body = '{{\"a\": 1}}'")  # tampered bytes
    with pytest.raises(PayloadConflictError):
        pg_store.mutate(Permit(rid, 1), "run.b", payload={"a": 1})
    assert pg_store.get(rid).revision == 1


def test_out_of_order_commits_are_never_skipped(pg_store: PostgresStore) -> None:
    """The first writer takes the lower event id but commits last."""
    first = pg_store.ensure_resource("run", "slow")
    second = pg_store.ensure_resource("run", "fast")
    inside, release = threading.Event(), threading.Event()

    def slow_apply(conn: psycopg.Connection[Any]) -> None:
        inside.set()
        assert release.wait(10)

    slow = threading.Thread(target=pg_store.mutate, args=(Permit(first, 0), "run.slow", slow_apply))
    slow.start()
    assert inside.wait(10)
    fast = pg_store.mutate(Permit(second, 0), "run.fast")
    early = pg_store.events_after()
    assert early == []  # the fast event waits behind the open transaction
    release.set()
    slow.join()
    events = pg_store.events_after()
    assert sorted(e.type for e in events) == ["run.fast", "run.slow"]
    assert fast.event_id > min(e.id for e in events)
    assert pg_store.events_after(events[-1].cursor) == []


def test_migrate_is_idempotent_and_recorded(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema) as store:
        assert store.migrate() == []
    rows = sql(pg_dsn, f"SELECT version, name, checksum FROM {schema}.schema_migrations")
    expected = [(m.version, m.name, m.checksum) for m in load_migrations()]
    assert sorted(rows) == expected


def test_changed_migration_is_refused(pg_dsn: str, schema: str) -> None:
    PostgresStore(pg_dsn, schema=schema).close()
    sql(pg_dsn, f"UPDATE {schema}.schema_migrations SET checksum = 'abc' WHERE version = 1")
    with pytest.raises(MigrationChecksumError, match="must never change"):
        PostgresStore(pg_dsn, schema=schema)


def test_unknown_applied_migration_is_refused(pg_dsn: str, schema: str) -> None:
    PostgresStore(pg_dsn, schema=schema).close()
    sql(pg_dsn, f"INSERT INTO {schema}.schema_migrations VALUES (9999, 'future', 'x')")
    with pytest.raises(MigrationError, match="upgrade pglease"):
        PostgresStore(pg_dsn, schema=schema)


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests._workers", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_eight_processes_migrate_at_once(pg_dsn: str, schema: str) -> None:
    start_at = str(time.time() + 1.5)
    procs = [_spawn("migrate", pg_dsn, schema, start_at) for _ in range(8)]
    for proc in procs:
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    rows = sql(pg_dsn, f"SELECT version FROM {schema}.schema_migrations ORDER BY version")
    assert [r[0] for r in rows] == [m.version for m in load_migrations()]


@pytest.mark.parametrize("processes", [2, 8])
def test_processes_racing_for_one_resource(
    pg_store: PostgresStore, pg_dsn: str, schema: str, processes: int
) -> None:
    rid = pg_store.ensure_resource("controller", "hot")
    start_at = str(time.time() + 1.5)
    procs = [
        _spawn("race", pg_dsn, schema, rid, f"p{i}", "2.0", start_at) for i in range(processes)
    ]
    won: dict[int, str] = {}
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        for line in out.splitlines():
            generation = json.loads(line)["generation"]
            assert generation not in won, f"generation {generation} granted twice"
            won[generation] = f"p{i}"
    assert sorted(won) == list(range(1, len(won) + 1))
    assert len(set(won.values())) > 1, "expected more than one process to win at some point"
    # The event log agrees: one claim per generation, by the process that saw it won,
    # and no claim while the previous holder was live (released or expired first).
    events = []
    cursor = 0
    while page := pg_store.events(rid, after_revision=cursor, limit=1000):
        events.extend(page)
        cursor = page[-1].revision
    claims = [e for e in events if e.type == "lease.claimed"]
    assert [e.lease_generation for e in claims] == sorted(won)
    assert all(won[e.lease_generation] == e.actor.id for e in claims if e.actor)  # type: ignore[index]
    holder_until = None
    for event in events:
        if event.type == "lease.claimed":
            assert holder_until is None or holder_until <= event.created_at
            holder_until = event.lease_expires_at
        elif event.type == "lease.released":
            holder_until = None
    assert [e.revision for e in events] == list(range(1, len(events) + 1))
    # Readers consume the log in (xid, id) order; under contention that must still be
    # revision order per resource, or a watcher would see revision n+1 before n.
    rows = sql(
        pg_dsn,
        f"SELECT xid::text::numeric FROM {schema}.events WHERE resource_id = %s ORDER BY revision",
        [rid],
    )
    xids = [r[0] for r in rows]
    assert xids == sorted(xids)


_FAST_PATH = ["pglease_claim", "pglease_release", "pglease_renew"]


def test_connections_come_prepared(pg_store: PostgresStore) -> None:
    """The pool prepares the fast path on connect: a new connection's first claim
    must not fail on a missing statement first (the server logs each such ERROR)."""
    with pg_store.connection() as conn:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE 'pglease%' ORDER BY name"
        )]  # fmt: skip
        limit = conn.execute("SHOW statement_timeout").fetchone()
    assert names == _FAST_PATH
    assert limit is not None and limit[0] != "0"  # the limits are set as before


async def test_async_connections_come_prepared(apg_store: AsyncPostgresStore) -> None:
    async with apg_store.connection() as conn:
        cur = await conn.execute(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE 'pglease%' ORDER BY name"
        )
        names = [r[0] for r in await cur.fetchall()]
    assert names == _FAST_PATH


def _until(condition: Any, what: str, limit: float = 30.0) -> None:
    """Wait (bounded) for `condition()`, polling."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {limit} s"
        time.sleep(0.01)


def test_a_caller_waiting_for_the_pool_gets_the_next_connection_back(
    pg_dsn: str, schema: str
) -> None:
    """Connections go back to the pool, not to the reuse stack, while a caller waits
    there: else it would wait out pool_timeout beside an idle connection."""
    with PostgresStore(pg_dsn, schema=schema, max_size=1) as store:
        rid = store.ensure_resource("run", "starve")
        got: list[Any] = []
        with store.connection():
            waiter = threading.Thread(target=lambda: got.append(store.get(rid)))
            waiter.start()
            pool = store._pool
            assert pool is not None
            _until(lambda: pool.get_stats()["requests_waiting"] == 1, "the waiting caller")
        waiter.join(60)
        assert not waiter.is_alive() and [s.id for s in got] == [rid]
        assert store.claim(rid, Owner("host", "a"), 30) is not None  # reuse goes on


async def test_async_caller_waiting_for_the_pool_gets_the_next_connection_back(
    pg_dsn: str, schema: str
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, max_size=1) as store:
        rid = await store.ensure_resource("run", "starve")
        async with store.connection():
            waiter = asyncio.create_task(store.get(rid))
            for _ in range(3000):  # bounded: the task asks for a connection at once
                if store.pool.get_stats()["requests_waiting"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert store.pool.get_stats()["requests_waiting"] == 1
        state = await asyncio.wait_for(waiter, 60)
        assert state.id == rid
        assert await store.claim(rid, Owner("host", "a"), 30) is not None


async def test_async_fast_path_goes_on_after_its_connection_is_lost_mid_call(
    pg_dsn: str, schema: str
) -> None:
    """The asyncio fast path keeps its socket registered with the event loop between
    calls; a connection lost mid-call (libpq closes its socket) is an outcome
    unknown, and the calls after it, on the pool's replacement connection, each
    complete within a bound."""
    async with AsyncPostgresStore(pg_dsn, schema=schema, max_size=1, lock_timeout=None) as store:
        rid = await store.ensure_resource("run", "lost")
        other = await store.ensure_resource("run", "after")
        claim = await store.claim(other, Owner("host", "a"), 30)  # the socket is watched now
        assert claim is not None
        await store.release(claim)
        locker = psycopg.connect(pg_dsn, autocommit=True)
        with locker, locker.transaction():  # the claim waits on the lease row
            locker.execute(
                f'SELECT 1 FROM "{schema}".leases WHERE resource_id = %s FOR UPDATE', [rid]
            )
            task = asyncio.create_task(store.claim(rid, Owner("host", "a"), 30))
            pids: list[tuple[Any, ...]] = []
            for _ in range(3000):  # bounded: the claim reaches the lock at once
                if pids := _claims_waiting(pg_dsn, schema):
                    break
                await asyncio.sleep(0.01)
            assert pids, "the claim never waited on the row lock"
            sql(pg_dsn, "SELECT pg_terminate_backend(%s, 10000)", [pids[0][0]])
            with pytest.raises(CommitOutcomeUnknownError):
                await asyncio.wait_for(task, 60)
        for _ in range(3):  # on the replacement connection, each call bounded
            claim = await asyncio.wait_for(store.claim(other, Owner("host", "b"), 30), 60)
            assert claim is not None
            await asyncio.wait_for(store.release(claim), 60)
        assert not (await store.get(rid)).lease.held


def test_hot_path_survives_deallocate_all(pg_store: PostgresStore) -> None:
    """psycopg sends DEALLOCATE ALL after a rollback; claim/renew/release re-prepare."""
    rid = pg_store.ensure_resource("run", "dealloc")
    claim = pg_store.claim(rid, Owner("host", "a"), 30)
    assert claim is not None
    with pg_store.connection() as conn:
        conn.execute("DEALLOCATE ALL")
    claim = pg_store.renew(claim, 30)
    assert pg_store.release(claim) == 3


async def test_async_hot_path_survives_deallocate_all(apg_store: AsyncPostgresStore) -> None:
    rid = await apg_store.ensure_resource("run", "dealloc")
    claim = await apg_store.claim(rid, Owner("host", "a"), 30)
    assert claim is not None
    async with apg_store.connection() as conn:
        await conn.execute("DEALLOCATE ALL")
    claim = await apg_store.renew(claim, 30)
    assert await apg_store.release(claim) == 3
    with pytest.raises(LeaseLostError):
        await apg_store.release(claim)


async def test_async_claim_cancelled_in_flight_is_cancelled_on_the_server(
    pg_dsn: str, schema: str
) -> None:
    """A task cancelled while its claim waits on the server: the claim is cancelled
    there too (it never takes the lease) and the store's one connection goes on."""

    def claims_waiting() -> list[tuple[Any, ...]]:
        return _claims_waiting(pg_dsn, schema)

    async with AsyncPostgresStore(pg_dsn, schema=schema, max_size=1) as store:
        rid = await store.ensure_resource("run", "cancelled")
        locker = psycopg.connect(pg_dsn, autocommit=True)
        with locker, locker.transaction():  # holds the lease row: the claim waits for it
            locker.execute(
                f'SELECT 1 FROM "{schema}".leases WHERE resource_id = %s FOR UPDATE', [rid]
            )
            task = asyncio.create_task(store.claim(rid, Owner("host", "a"), 30))
            for _ in range(3000):  # bounded: the claim reaches the lock at once
                if claims_waiting():
                    break
                await asyncio.sleep(0.01)
            assert claims_waiting(), "the claim never waited on the row lock"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 60)
            # Cancelled on the server while the row is still locked: nothing waits.
            assert not claims_waiting()
        state = await store.get(rid)  # the cancelled claim took nothing
        assert not state.lease.held and state.revision == 0
        claim = await store.claim(rid, Owner("host", "b"), 30)
        assert claim is not None and claim.owner == Owner("host", "b")
        assert await store.release(claim) == claim.revision + 1


def test_timestamps_are_utc_whatever_the_servers_timezone(pg_dsn: str, schema: str) -> None:
    # A session TimeZone far from UTC: psycopg would read timestamptz values in it.
    dsn = pg_dsn + ("&" if "?" in pg_dsn else "?") + "options=-c%20TimeZone%3DAsia/Tokyo"
    with PostgresStore(dsn, schema=schema) as store:
        with store.connection() as conn:
            assert conn.execute("SHOW TimeZone").fetchone() == ("Asia/Tokyo",)
        rid = store.ensure_resource("run", "tz")
        claim = store.claim(rid, Owner("host", "a"), 30)
        assert claim is not None
        state = store.get(rid)
        assert state.lease.expires_at == claim.expires_at
        assert state.lease.expires_at is not None and state.lease.expires_at.tzinfo is UTC
        assert claim.expires_at.tzinfo is UTC
        assert store.events(rid)[0].created_at.tzinfo is UTC
        assert all(e.created_at.tzinfo is UTC for e in store.events_after())
