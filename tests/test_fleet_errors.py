"""Failure honesty of the fleet runtime on real PostgreSQL: only PgleaseErrors
reach the caller, a row locked past the store's lock_timeout is 'busy' (acquire
keeps waiting until its own timeout), and a host that cannot get a keeper
connection fails before it claims anything.

Timing is generous: the tests assert outcomes, never how fast they came.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from pglease import (
    AcquireTimeoutError,
    AsyncPostgresStore,
    DatabaseUnavailableError,
    Owner,
    PgleaseError,
    PostgresStore,
)
from pglease.migrations import grant
from pglease.postgres.runtime import SESSION_SETUP, _connect_kwargs, application_name
from pglease.runtime import AsyncKeeper, Keeper, acquire, acquire_async, hold, hold_async

from ._pg_where import PgWhere

A = Owner("host", "a")
B = Owner("host", "b")
LOCK_TIMEOUT = 0.3
DEAD_DSN = "postgresql://nobody@127.0.0.1:9/none?connect_timeout=1"


def _eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


def _admin(dsn: str, text: str, args: list[Any] | None = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(text, args)


# --------------------------------------------------------------------------- keeper session


def test_keeper_session_uses_sets_not_startup_options(pg_store: PostgresStore) -> None:
    kwargs = _connect_kwargs(2.0, pg_store.schema)
    assert "options" not in kwargs  # PgBouncer refuses startup options
    with Keeper(pg_store) as keeper:
        keeper.connect()
        conn = keeper._channel._conn  # type: ignore[attr-defined]
        assert conn is not None
        settings = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings"
                " WHERE name IN ('statement_timeout', 'plan_cache_mode', 'application_name')"
            ).fetchall()
        )
        assert settings == {
            "statement_timeout": "10000",
            "plan_cache_mode": "force_custom_plan",
            "application_name": application_name(pg_store.schema),
        }
        keeper.connect()  # idempotent: the same connection
        assert keeper._channel._conn is conn  # type: ignore[attr-defined]
    assert b"SET statement_timeout" in SESSION_SETUP


def test_hold_with_an_unreachable_keeper_fails_before_claiming(pg_store: PostgresStore) -> None:
    with Keeper(PgWhere(DEAD_DSN, pg_store.schema), connect_timeout=1) as dead:
        with (
            pytest.raises(DatabaseUnavailableError, match="keeper: cannot connect"),
            hold(pg_store, "run", "dead", A, 30, keeper=dead),
        ):
            pytest.fail("the body must not run")
        assert len(dead) == 0
    assert pg_store.list_resources() == []


async def test_hold_async_with_an_unreachable_keeper_fails_before_claiming(
    apg_store: AsyncPostgresStore,
) -> None:
    dead = AsyncKeeper(PgWhere(DEAD_DSN, apg_store.schema, is_async=True), connect_timeout=1)
    try:
        with pytest.raises(DatabaseUnavailableError, match="keeper: cannot connect"):
            async with hold_async(apg_store, "run", "dead", A, 30, keeper=dead):
                pytest.fail("the body must not run")
    finally:
        await dead.aclose()
    assert await apg_store.list_resources() == []


# --------------------------------------------------------------------------- no free slot


@pytest.fixture
def limited(pg_dsn: str, schema: str, pg_store: PostgresStore) -> Iterator[str]:
    """The DSN of a client role on the test schema that may open one connection."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
        if not (row and row[0]):
            pytest.skip("the test server's user cannot create roles")
        name = f"pgl_fleet_{uuid.uuid4().hex[:8]}"
        conn.execute(f"CREATE ROLE {name} LOGIN CONNECTION LIMIT 1")
        grant(conn, schema, name, "client")
    try:
        yield conninfo.make_conninfo(pg_dsn, user=name)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [name],
            )
            conn.execute(f"DROP OWNED BY {name}")
            conn.execute(f"DROP ROLE {name}")


def test_hold_without_a_free_connection_slot_fails_at_once(limited: str, schema: str) -> None:
    # The store's pool holds the role's one connection: the keeper gets none.
    with PostgresStore(limited, schema=schema, min_size=1, max_size=1, auto_migrate=False) as s:
        with (
            pytest.raises(DatabaseUnavailableError, match="keeper: cannot connect") as caught,
            hold(s, "run", "slot", A, 30, keeper=Keeper(s)),
        ):
            pytest.fail("the body must not run")
        assert "too many connections" in str(caught.value)
        assert isinstance(caught.value, PgleaseError)
        assert s.list_resources() == []  # nothing claimed, not even the resource


def test_pglease_hold_without_a_free_connection_slot_exits_1(limited: str, schema: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", limited, "--schema", schema, "--no-migrate",
         "hold", "job", "j1", "--owner", "host:cli", "--ttl", "30", "--", "true"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "keeper: cannot connect" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- busy rows


@pytest.fixture
def short_lock_store(pg_dsn: str, schema: str, pg_store: PostgresStore) -> Iterator[PostgresStore]:
    with PostgresStore(pg_dsn, schema=schema, lock_timeout=LOCK_TIMEOUT) as store:
        yield store


class _RowLock:
    """Another transaction holding the lease row's lock (a stalled writer)."""

    def __init__(self, store: PostgresStore, rid: str) -> None:
        self.conn = psycopg.connect(store.dsn)
        self.conn.execute(
            f'SELECT 1 FROM "{store.schema}".leases WHERE resource_id = %s FOR UPDATE', [rid]
        )

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def _busy_retries(caplog: pytest.LogCaptureFixture) -> int:
    return sum("lease row locked" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fair", [False, True])
def test_acquire_behind_a_row_lock_waits_until_its_own_timeout(
    short_lock_store: PostgresStore, caplog: pytest.LogCaptureFixture, fair: bool
) -> None:
    caplog.set_level(logging.DEBUG, logger="pglease.runtime")
    rid = short_lock_store.ensure_resource("run", "locked")
    lock = _RowLock(short_lock_store, rid)
    try:
        # A claim waits LOCK_TIMEOUT for the row, then tries again: never a
        # LockTimeoutError, only the acquire's own timeout.
        with pytest.raises(AcquireTimeoutError, match="within"):
            acquire(short_lock_store, "run", "locked", A, 5, timeout=2.0, fair=fair)
        assert _busy_retries(caplog) >= 1
    finally:
        lock.release()
    assert not short_lock_store.get(rid).lease.held


def test_acquire_behind_a_row_lock_succeeds_once_the_locker_rolls_back(
    short_lock_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pglease.runtime")
    rid = short_lock_store.ensure_resource("run", "locked")
    lock = _RowLock(short_lock_store, rid)
    got: list[Any] = []
    t = threading.Thread(
        target=lambda: got.append(acquire(short_lock_store, "run", "locked", A, 5, timeout=60)),
        daemon=True,
    )
    try:
        t.start()
        # Past the store's lock_timeout at least twice: it kept waiting.
        _eventually(lambda: _busy_retries(caplog) >= 2)
        assert t.is_alive() and got == []
    finally:
        lock.release()
    t.join(60)
    assert len(got) == 1 and got[0].generation == 1
    assert short_lock_store.get(rid).lease.owner == A


async def test_acquire_async_behind_a_row_lock_waits_then_succeeds(
    pg_dsn: str, schema: str, pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pglease.runtime")
    rid = pg_store.ensure_resource("run", "alocked")
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=LOCK_TIMEOUT) as store:
        lock = _RowLock(pg_store, rid)
        try:
            with pytest.raises(AcquireTimeoutError):
                await acquire_async(store, "run", "alocked", A, 5, timeout=1.0)
            waiter = asyncio.ensure_future(acquire_async(store, "run", "alocked", A, 5, timeout=60))
            end = time.monotonic() + 30
            before = _busy_retries(caplog)
            while _busy_retries(caplog) < before + 2:
                assert time.monotonic() < end and not waiter.done()
                await asyncio.sleep(0.02)
        finally:
            lock.release()
        claim = await asyncio.wait_for(waiter, 60)
        assert claim.generation == 1


def test_acquire_on_a_closed_store_raises_a_pglease_error(pg_dsn: str, schema: str) -> None:
    store = PostgresStore(pg_dsn, schema=schema)
    store.ensure_resource("run", "closed")
    store.close()
    with pytest.raises(PgleaseError) as caught:
        acquire(store, "run", "closed", A, 5, timeout=1)
    assert not isinstance(caught.value, psycopg.Error)
