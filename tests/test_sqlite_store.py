"""SQLite-only behaviour: file settings, migrations, reopening, bad paths, real processes."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import random
import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from pglease import (
    DatabaseUnavailableError,
    InvalidCursorError,
    MigrationChecksumError,
    MigrationError,
    Owner,
    PayloadConflictError,
    Permit,
    ValidationError,
)
from pglease.sqlite import AsyncSqliteStore, SqliteFileError, SqliteStore

A = Owner("host", "a")
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def query(path: Path, text: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return conn.execute(text, args).fetchall()
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "leases.db"


@pytest.fixture
def store(db: Path) -> Any:
    with SqliteStore(db) as s:
        yield s


# --- the file ---------------------------------------------------------------------------


def test_wal_busy_timeout_and_durability_are_set(db: Path) -> None:
    with SqliteStore(db, busy_timeout=2.5) as s, s.connection() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 2500
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    # WAL is a property of the file: any later opener sees it.
    assert query(db, "PRAGMA journal_mode") == [("wal",)]


def test_schema_is_versioned_in_the_file(db: Path) -> None:
    with SqliteStore(db) as s:
        assert s.migrate() == []
    rows = query(db, "SELECT version, name, checksum FROM schema_migrations ORDER BY version")
    assert [(v, n, len(c)) for v, n, c in rows] == [
        (1, "core", 64),
        (2, "fleet", 64),
        (3, "maintenance", 64),
    ]
    tables = {r[0] for r in query(db, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    expected = {"resources", "leases", "payloads", "events", "lease_waiters", "schema_migrations"}
    assert expected <= tables


def test_changed_or_unknown_migrations_are_refused(db: Path) -> None:
    SqliteStore(db).close()
    query(db, "UPDATE schema_migrations SET checksum = 'x' WHERE version = 1")
    with pytest.raises(MigrationChecksumError):
        SqliteStore(db)
    query(db, "DELETE FROM schema_migrations")
    query(db, "INSERT INTO schema_migrations VALUES (1, 'core', ?, 0)", (_current_checksum(db),))
    query(db, "INSERT INTO schema_migrations VALUES (99, 'future', 'x', 0)")
    with pytest.raises(MigrationError, match="does not know"):
        SqliteStore(db)
    # auto_migrate=False opens without looking
    SqliteStore(db, auto_migrate=False).close()


def _current_checksum(db: Path) -> str:
    from pglease.migrations import load_migrations
    from pglease.sqlite._db import MIGRATIONS_DIR

    return load_migrations(MIGRATIONS_DIR)[0].checksum


def test_reopened_file_keeps_state(db: Path) -> None:
    with SqliteStore(db) as s:
        rid = s.ensure_resource("run", "r")
        claim = s.claim(rid, A, 60)
        assert claim is not None
        s.mutate(Permit(rid, 1, claim), "run.step", payload={"n": 1})
    with SqliteStore(db) as s:
        state = s.get(rid)
        assert (state.revision, state.lease.generation, state.lease.owner) == (2, 1, A)
        assert state.lease.held and state.lease.expires_at == claim.expires_at
        assert [e.type for e in s.events(rid)] == ["lease.claimed", "run.step"]
        assert s.events(rid)[1].payload == {"n": 1}
        # the token from before the restart still proves ownership
        renewed = s.renew(claim, 60)
        assert s.release(renewed) == 4
        again = s.claim(rid, A, 60)
        assert again is not None and again.generation == 2


def test_only_the_token_hash_is_stored(store: SqliteStore, db: Path) -> None:
    rid = store.ensure_resource("run", "t")
    claim = store.claim(rid, A, 30)
    assert claim is not None
    [(stored,)] = query(db, "SELECT token_sha256 FROM leases")
    assert stored == hashlib.sha256(claim.token.encode()).digest()
    store.close()
    for f in db.parent.iterdir():
        assert claim.token.encode() not in f.read_bytes()


def test_timestamps_are_exact_utc_microseconds(store: SqliteStore) -> None:
    rid = store.ensure_resource("run", "t")
    now = T0 + timedelta(microseconds=123_457)
    claim = store.claim(rid, A, 1.5, now=now)
    assert claim is not None
    assert claim.expires_at == now + timedelta(seconds=1.5)
    assert claim.expires_at.utcoffset() == timedelta(0)
    state = store.get(rid, now=now)
    assert state.lease.acquired_at == now and state.lease.expires_at == claim.expires_at
    assert state.lease.held
    assert not store.get(rid, now=claim.expires_at).lease.held
    [event] = store.events(rid)
    assert event.created_at == now and event.lease_expires_at == claim.expires_at
    # `now` in another zone is the same instant
    later = (claim.expires_at + timedelta(microseconds=1)).astimezone(timezone(timedelta(hours=2)))
    assert later.utcoffset() == timedelta(hours=2)
    assert not store.get(rid, now=later).lease.held
    assert store.get(rid, now=later - timedelta(microseconds=2)).lease.held


def test_wall_clock_is_used_without_now(store: SqliteStore) -> None:
    rid = store.ensure_resource("run", "t")
    before = datetime.now(UTC)
    claim = store.claim(rid, A, 10)
    after = datetime.now(UTC)
    assert claim is not None
    assert before + timedelta(seconds=10) <= claim.expires_at <= after + timedelta(seconds=10)


def test_bad_paths_and_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUnavailableError, match="cannot open SQLite file"):
        SqliteStore(tmp_path / "missing" / "dir" / "x.db")
    with pytest.raises(SqliteFileError):
        SqliteStore(tmp_path)  # a directory
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not an sqlite file" * 100)
    with pytest.raises(SqliteFileError):
        SqliteStore(garbage)
    assert garbage.read_bytes() == b"this is not an sqlite file" * 100
    for bad in ["", ":memory:", "file::memory:?cache=shared", None, b"x.db", 3, "a\x00b"]:
        with pytest.raises(ValidationError):
            SqliteStore(bad)  # type: ignore[arg-type]
    for timeout in [0, -1, float("nan"), float("inf"), True, "5", 1e9]:
        with pytest.raises(ValidationError):
            SqliteStore(tmp_path / "ok.db", busy_timeout=timeout)  # type: ignore[arg-type]


async def test_async_store_reports_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(SqliteFileError):
        await AsyncSqliteStore.open(tmp_path / "missing" / "x.db")
    with pytest.raises(ValidationError):
        AsyncSqliteStore(":memory:")


def test_closed_store_refuses_work(db: Path) -> None:
    s = SqliteStore(db)
    s.close()
    with pytest.raises(Exception, match="closed"):
        s.ensure_resource("run", "x")


# --- transactions ----------------------------------------------------------------------


@pytest.mark.parametrize("escape", ["commit", "rollback", "COMMIT", "ROLLBACK", "BEGIN"])
def test_apply_cannot_end_the_transaction(store: SqliteStore, db: Path, escape: str) -> None:
    rid = store.ensure_resource("run", "t")
    query(db, "CREATE TABLE side (v TEXT)")

    def apply(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO side VALUES ('x')")
        if escape.islower():
            getattr(conn, escape)()
        else:
            conn.execute(escape)

    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        store.mutate(Permit(rid, 0), "run.step", apply, {"p": 1})
    assert store.get(rid).revision == 0 and store.events(rid) == []
    assert query(db, "SELECT count(*) FROM side") == [(0,)]
    assert query(db, "SELECT count(*) FROM payloads") == [(0,)]

    # savepoints inside the transaction are fine, and the store is still usable
    def nested(conn: sqlite3.Connection) -> str:
        conn.execute("SAVEPOINT s")
        conn.execute("INSERT INTO side VALUES ('y')")
        conn.execute("RELEASE s")
        return "ok"

    assert store.mutate(Permit(rid, 0), "run.step", nested).value == "ok"
    assert query(db, "SELECT v FROM side") == [("y",)]


def test_payload_hash_conflict_is_refused(store: SqliteStore, db: Path) -> None:
    rid = store.ensure_resource("run", "t")
    body = '{"a":1}'
    sha = hashlib.sha256(body.encode()).digest()
    query(db, "INSERT INTO payloads (sha256, body, created_at) VALUES (?, ?, 0)", (sha, '{"a": 1}'))
    with pytest.raises(PayloadConflictError):
        store.mutate(Permit(rid, 0), "run.step", payload={"a": 1})
    assert store.get(rid).revision == 0 and store.events(rid) == []


def test_cursors_are_sqlite_positions(store: SqliteStore) -> None:
    rid = store.ensure_resource("run", "t")
    store.mutate(Permit(rid, 0), "run.step")
    [event] = store.events_after()
    assert event.cursor.startswith(f"0.{event.id}.")  # v2: the position and its check
    assert store.events_after(event.cursor) == []
    with pytest.raises(InvalidCursorError):
        store.events_after("123.1")  # a PostgreSQL position
    with pytest.raises(InvalidCursorError):
        store.events_after("garbage")


def test_rolled_back_event_ids_leave_no_gap_for_readers(store: SqliteStore) -> None:
    rid = store.ensure_resource("run", "t")

    def fail(conn: sqlite3.Connection) -> None:
        raise RuntimeError("no")

    store.mutate(Permit(rid, 0), "run.a")
    with pytest.raises(RuntimeError):
        store.mutate(Permit(rid, 1), "run.b", fail)
    store.mutate(Permit(rid, 1), "run.c")
    events = store.events_after()
    assert [e.type for e in events] == ["run.a", "run.c"]
    assert [e.revision for e in events] == [1, 2]


def test_threads_racing_on_one_store_get_one_winner(store: SqliteStore) -> None:
    rid = store.ensure_resource("run", "t")
    barrier = threading.Barrier(8)
    wins: list[int] = []

    def race(i: int) -> None:
        barrier.wait()
        claim = store.claim(rid, Owner("host", f"t{i}"), 30)
        if claim is not None:
            wins.append(claim.generation)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins == [1]


# --- asyncio ------------------------------------------------------------------------------


async def test_async_tasks_racing_get_one_winner(db: Path) -> None:
    async with AsyncSqliteStore(db) as s:
        rid = await s.ensure_resource("run", "t")
        claims = await asyncio.gather(
            *(s.claim(rid, Owner("host", f"t{i}"), 30) for i in range(16))
        )
        assert [c.generation for c in claims if c is not None] == [1]


async def test_async_apply_runs_on_the_loop_inside_the_transaction(db: Path) -> None:
    async with AsyncSqliteStore(db) as s:
        rid = await s.ensure_resource("run", "t")
        query(db, "CREATE TABLE side (v TEXT)")
        loop_thread = threading.get_ident()

        async def apply(conn: sqlite3.Connection) -> int:
            assert threading.get_ident() == loop_thread
            await asyncio.sleep(0)  # the loop stays free while the lock is held
            conn.execute("INSERT INTO side VALUES ('a')")
            assert conn.in_transaction
            return int(conn.execute("SELECT revision FROM resources").fetchone()[0])

        result = await s.mutate(Permit(rid, 0), "run.step", apply)
        assert result.value == 1 and result.revision == 1
        assert query(db, "SELECT v FROM side") == [("a",)]


async def test_cancelled_async_mutation_rolls_back(db: Path) -> None:
    async with AsyncSqliteStore(db, busy_timeout=5) as s:
        rid = await s.ensure_resource("run", "t")
        query(db, "CREATE TABLE side (v TEXT)")
        started = asyncio.Event()

        async def stuck(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO side VALUES ('gone')")
            started.set()
            await asyncio.Event().wait()

        task = asyncio.create_task(s.mutate(Permit(rid, 0), "run.step", stuck, {"x": 1}))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the write lock is released promptly and nothing of the mutation stays
        result = await asyncio.wait_for(s.mutate(Permit(rid, 0), "run.other"), 5)
        assert result.revision == 1
        assert [e.type for e in await s.events(rid)] == ["run.other"]
        assert query(db, "SELECT count(*) FROM side") == [(0,)]
        assert query(db, "SELECT count(*) FROM payloads") == [(0,)]


# --- real processes ------------------------------------------------------------------------


def _race_worker(path: str, worker: int, wins_wanted: int, start_at: float) -> list[int]:
    """Open the (maybe fresh) file, then win the lease `wins_wanted` times."""
    while time.time() < start_at:
        time.sleep(0.001)
    owner = Owner("host", f"p{worker}")
    won: list[int] = []
    with SqliteStore(path, busy_timeout=30) as store:
        rid = store.ensure_resource("run", "contended")
        deadline = time.monotonic() + 120
        while len(won) < wins_wanted and time.monotonic() < deadline:
            claim = store.claim(rid, owner, 30)
            if claim is None:
                time.sleep(random.uniform(0, 0.002))
                continue
            store.mutate(
                Permit(rid, claim.revision, claim),
                "run.step",
                payload={"worker": worker, "generation": claim.generation},
            )
            store.release(claim)
            won.append(claim.generation)
    return won


@pytest.mark.parametrize(("processes", "wins"), [(2, 15), (8, 5)])
def test_processes_racing_on_one_file(tmp_path: Path, processes: int, wins: int) -> None:
    path = str(tmp_path / "shared.db")  # not created yet: the workers race to create it
    start_at = time.time() + 1.5
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        results = pool.starmap(
            _race_worker, [(path, i, wins, start_at) for i in range(processes)], chunksize=1
        )
    total = processes * wins
    assert all(len(r) == wins for r in results)
    won = sorted(g for r in results for g in r)
    assert won == list(range(1, total + 1))  # one winner per generation, none skipped

    with SqliteStore(path) as store:
        [state] = store.list_resources()
        events = store.events(state.id, limit=10_000)
        assert [e.revision for e in events] == list(range(1, 3 * total + 1))
        assert state.revision == 3 * total and state.lease.generation == total
        # claimed -> step -> released, by the same holder, never interleaved
        for g in range(1, total + 1):
            claimed, step, released = events[3 * (g - 1) : 3 * g]
            assert [claimed.type, step.type, released.type] == [
                "lease.claimed",
                "run.step",
                "lease.released",
            ]
            assert claimed.lease_generation == step.lease_generation == g
            assert released.lease_generation == g
            assert claimed.actor is not None
            assert claimed.actor == step.actor == released.actor
            assert step.payload == {"worker": int(claimed.actor.id[1:]), "generation": g}
        # the global log agrees: every event exactly once, in commit order
        paged, cursor = [], None
        while page := store.events_after(cursor, limit=7):
            paged.extend(page)
            cursor = page[-1].cursor
        assert [e.id for e in paged] == [e.id for e in events]
        assert [e.id for e in paged] == sorted({e.id for e in paged})
