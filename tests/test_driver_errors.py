"""Failure honesty of the PostgreSQL stores: no raw driver error from the public API.

Real server, real failures: backends terminated with pg_terminate_backend, a
lease row locked by a stalled transaction, statements past statement_timeout,
a pool with no free connection. Sync and asyncio twins.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pglease import (
    AsyncPostgresStore,
    CommitOutcomeUnknownError,
    DatabaseError,
    DatabaseUnavailableError,
    LockTimeoutError,
    Owner,
    Permit,
    PgleaseError,
    PoolExhaustedError,
    PostgresStore,
    StatementTimeoutError,
    StoreClosedError,
    ValidationError,
)

ME = Owner("host", "me")
PASSWORD = "s3cr3t-pw-never-shown"  # the test server trusts local connections


def app_name(schema: str) -> str:
    """What a store's connections call themselves (README "Errors")."""
    return f"pglease-{schema}"


def kill_store_backends(dsn: str, schema: str) -> int:
    """Terminate every backend of the store's connections and wait until they are gone."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND application_name = %s",
            [app_name(schema)],
        ).fetchall()
    assert all(ok for (ok,) in rows)
    return len(rows)


def wait_for_lock_waiter(dsn: str, schema: str) -> int:
    """The pid of the store backend waiting for a lock (fails after 30 s)."""
    deadline = time.monotonic() + 30
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
                " AND wait_event_type = 'Lock'",
                [app_name(schema)],
            ).fetchone()
            if row is not None:
                return int(row[0])
            time.sleep(0.02)
    raise AssertionError("the store's call never waited for the lock")


def terminate(dsn: str, pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s, 10000)", [pid]).fetchone() == (True,)


@pytest.fixture
def row_locker(pg_dsn: str, schema: str) -> Iterator[Any]:
    """`lock(rid)`: hold the lease row FOR UPDATE in an open transaction (a stalled holder)."""
    conn = psycopg.connect(pg_dsn)

    def lock(rid: str) -> psycopg.Connection[Any]:
        conn.execute(f'SELECT 1 FROM "{schema}".leases WHERE resource_id = %s FOR UPDATE', [rid])
        return conn

    try:
        yield lock
    finally:
        conn.close()


def warm(store: PostgresStore, n: int = 3) -> None:
    """Leave `n` connections idle in the store (nested borrows)."""

    def nest(left: int) -> None:
        if left:
            with store.connection():
                nest(left - 1)

    nest(n)


async def awarm(store: AsyncPostgresStore, n: int = 3) -> None:
    async def nest(left: int) -> None:
        if left:
            async with store.connection():
                await nest(left - 1)

    await nest(n)


# --- terminated backends --------------------------------------------------------------


def test_reads_and_claims_survive_terminated_backends(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("run", "killed")
    pg_store.mutate(Permit(rid, 0), "run.started", payload={"n": 1})
    warm(pg_store)
    reads: list[Callable[[], object]] = [
        lambda: pg_store.get(rid),
        lambda: pg_store.list_resources(),
        lambda: pg_store.list_resources("run"),
        lambda: pg_store.events(rid),
        lambda: pg_store.events_after(),
        lambda: pg_store.ensure_resource("run", "killed"),
    ]
    for read in reads:
        assert kill_store_backends(pg_dsn, schema) >= 1
        read()
    assert pg_store.get(rid).revision == 1
    assert kill_store_backends(pg_dsn, schema) >= 1
    # Dead idle connections are found before anything is sent: a safe retry.
    # Should one die in flight anyway, the only other answer is the honest one.
    try:
        claim = pg_store.claim(rid, ME, 30)
    except CommitOutcomeUnknownError as exc:
        assert exc.operation == "claim" and exc.token
        pytest.skip(f"a connection died in flight: {exc}")
    assert claim is not None
    assert kill_store_backends(pg_dsn, schema) >= 1
    claim = pg_store.renew(claim, 30)
    assert kill_store_backends(pg_dsn, schema) >= 1
    pg_store.mutate(Permit(rid, claim.revision, claim), "run.step")
    assert kill_store_backends(pg_dsn, schema) >= 1
    pg_store.release(claim)
    assert not pg_store.get(rid).lease.held


async def test_async_reads_and_claims_survive_terminated_backends(
    apg_store: AsyncPostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = await apg_store.ensure_resource("run", "killed")
    await apg_store.mutate(Permit(rid, 0), "run.started", payload={"n": 1})
    await awarm(apg_store)
    reads: list[Callable[[], Awaitable[object]]] = [
        lambda: apg_store.get(rid),
        lambda: apg_store.list_resources(),
        lambda: apg_store.list_resources("run"),
        lambda: apg_store.events(rid),
        lambda: apg_store.events_after(),
        lambda: apg_store.ensure_resource("run", "killed"),
    ]
    for read in reads:
        assert await asyncio.to_thread(kill_store_backends, pg_dsn, schema) >= 1
        await read()
    await asyncio.to_thread(kill_store_backends, pg_dsn, schema)
    try:
        claim = await apg_store.claim(rid, ME, 30)
    except CommitOutcomeUnknownError as exc:
        assert exc.operation == "claim" and exc.token
        pytest.skip(f"a connection died in flight: {exc}")
    assert claim is not None
    await asyncio.to_thread(kill_store_backends, pg_dsn, schema)
    claim = await apg_store.renew(claim, 30)
    await asyncio.to_thread(kill_store_backends, pg_dsn, schema)
    await apg_store.mutate(Permit(rid, claim.revision, claim), "run.step")
    await asyncio.to_thread(kill_store_backends, pg_dsn, schema)
    await apg_store.release(claim)
    assert not (await apg_store.get(rid)).lease.held


def test_a_read_cut_off_mid_statement_is_retried(pg_dsn: str, schema: str) -> None:
    """ensure_resource waits behind an uncommitted insert of the same key; its
    backend is terminated while waiting, and the retry on a fresh connection
    returns once the insert commits."""
    with PostgresStore(pg_dsn, schema=schema) as store:
        with psycopg.connect(pg_dsn) as blocker:
            row = blocker.execute(
                f"SELECT \"{schema}\".ensure_resource('run', 'contended')"
            ).fetchone()
            assert row is not None
            result: list[Any] = []
            worker = threading.Thread(
                target=lambda: result.append(_outcome(store.ensure_resource, "run", "contended"))
            )
            worker.start()
            terminate(pg_dsn, wait_for_lock_waiter(pg_dsn, schema))
            # The retry waits behind the insert again; let it through.
            wait_for_lock_waiter(pg_dsn, schema)
            blocker.commit()
            worker.join(30)
        assert result == [row[0]]


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException as exc:
        return exc


def test_a_claim_cut_off_mid_statement_is_outcome_unknown(
    pg_dsn: str, schema: str, row_locker: Any
) -> None:
    dsn = make_conninfo(pg_dsn, password=PASSWORD)
    with PostgresStore(dsn, schema=schema, lock_timeout=None) as store:
        rid = store.ensure_resource("run", "cut")
        locker = row_locker(rid)
        result: list[Any] = []
        worker = threading.Thread(target=lambda: result.append(_outcome(store.claim, rid, ME, 30)))
        worker.start()
        terminate(pg_dsn, wait_for_lock_waiter(pg_dsn, schema))
        worker.join(30)
        locker.rollback()
        [error] = result
        assert isinstance(error, CommitOutcomeUnknownError), repr(error)
        assert isinstance(error, DatabaseUnavailableError)
        assert (error.operation, error.resource_id, error.owner) == ("claim", rid, ME)
        assert error.token and error.token not in str(error)
        assert PASSWORD not in str(error) and f"get({rid!r})" in str(error)
        assert isinstance(error.__cause__, psycopg.OperationalError)
        # Resolved by reading: here it was not committed, and the store still works.
        assert not store.get(rid).lease.held
        assert store.claim(rid, ME, 30) is not None


async def test_async_claim_cut_off_mid_statement_is_outcome_unknown(
    pg_dsn: str, schema: str, row_locker: Any
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=None) as store:
        rid = await store.ensure_resource("run", "cut")
        locker = row_locker(rid)
        task = asyncio.create_task(store.claim(rid, ME, 30))
        pid = await asyncio.to_thread(wait_for_lock_waiter, pg_dsn, schema)
        await asyncio.to_thread(terminate, pg_dsn, pid)
        with pytest.raises(CommitOutcomeUnknownError) as caught:
            await asyncio.wait_for(task, 30)
        locker.rollback()
        assert caught.value.operation == "claim" and caught.value.token
        assert not (await store.get(rid)).lease.held


def test_mutate_cut_off_before_commit_says_nothing_was_committed(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema) as store:
        rid = store.ensure_resource("run", "m")

        def apply(conn: psycopg.Connection[Any]) -> None:
            terminate(pg_dsn, conn.info.backend_pid)
            conn.execute("SELECT 1")

        with pytest.raises(DatabaseUnavailableError, match="nothing was committed") as caught:
            store.mutate(Permit(rid, 0), "run.x", apply)
        assert not isinstance(caught.value, CommitOutcomeUnknownError)
        assert store.get(rid).revision == 0


# --- stalled holders and time limits -----------------------------------------------


def test_claim_behind_a_stalled_row_lock_raises_lock_timeout(
    pg_dsn: str, schema: str, row_locker: Any
) -> None:
    with PostgresStore(pg_dsn, schema=schema, lock_timeout=0.5) as store:
        rid = store.ensure_resource("run", "stalled")
        row_locker(rid)
        started = time.monotonic()
        with pytest.raises(LockTimeoutError, match=r"resource busy: waited lock_timeout=0\.5 s"):
            store.claim(rid, ME, 30)
        assert time.monotonic() - started < 25  # bounded; the bound itself is the server's
        with pytest.raises(LockTimeoutError):
            store.mutate(Permit(rid, 0), "run.x")
        assert store.get(rid).revision == 0


async def test_async_claim_behind_a_stalled_row_lock_raises_lock_timeout(
    pg_dsn: str, schema: str, row_locker: Any
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=0.5) as store:
        rid = await store.ensure_resource("run", "stalled")
        row_locker(rid)
        with pytest.raises(LockTimeoutError, match=r"lock_timeout=0\.5 s"):
            await store.claim(rid, ME, 30)


def test_statement_timeout_cancels_a_mutation_without_trace(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema, statement_timeout=0.3) as store:
        rid = store.ensure_resource("run", "slow")
        with pytest.raises(StatementTimeoutError, match=r"statement_timeout=0\.3 s") as caught:
            store.mutate(Permit(rid, 0), "run.slow", lambda c: c.execute("SELECT pg_sleep(5)"))
        assert caught.value.sqlstate == "57014"
        assert isinstance(caught.value.__cause__, psycopg.errors.QueryCanceled)
        assert store.get(rid).revision == 0
        assert store.events(rid) == [] and store.events_after() == []
        assert store.mutate(Permit(rid, 0), "run.fast").revision == 1


async def test_async_statement_timeout_cancels_a_mutation_without_trace(
    pg_dsn: str, schema: str
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, statement_timeout=0.3) as store:
        rid = await store.ensure_resource("run", "slow")

        async def slow(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute("SELECT pg_sleep(5)")

        with pytest.raises(StatementTimeoutError, match=r"statement_timeout=0\.3 s"):
            await store.mutate(Permit(rid, 0), "run.slow", slow)
        assert (await store.get(rid)).revision == 0
        assert await store.events(rid) == []
        assert (await store.mutate(Permit(rid, 0), "run.fast")).revision == 1


def test_the_callers_own_sql_errors_in_apply_reach_it_unchanged(
    pg_store: PostgresStore,
) -> None:
    """Only what pglease causes is mapped (time limits, lost connections); errors of
    the caller's own SQL are theirs, like any exception `apply` raises."""
    rid = pg_store.ensure_resource("run", "apply")
    with pytest.raises(psycopg.errors.DivisionByZero):
        pg_store.mutate(Permit(rid, 0), "run.x", lambda c: c.execute("SELECT 1/0"))

    class Mine(Exception):
        pass

    def raises(conn: psycopg.Connection[Any]) -> None:
        raise Mine("mine")

    with pytest.raises(Mine):
        pg_store.mutate(Permit(rid, 0), "run.x", raises)
    assert pg_store.get(rid).revision == 0


def drop_function(dsn: str, schema: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        [(signature,)] = conn.execute(
            "SELECT oid::regprocedure::text FROM pg_proc"
            " WHERE proname = %s AND pronamespace = %s::regnamespace",
            [name, schema],
        ).fetchall()
        conn.execute(f"DROP FUNCTION {signature}")


def test_other_server_errors_are_a_database_error(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("run", "broken-schema")
    drop_function(pg_dsn, schema, "claim")
    with pytest.raises(DatabaseError, match="42883") as caught:
        pg_store.claim(rid, ME, 30)
    assert caught.value.sqlstate == "42883"
    assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedFunction)
    drop_function(pg_dsn, schema, "ensure_resource")
    with pytest.raises(DatabaseError, match="42883"):
        pg_store.ensure_resource("run", "other")


async def test_async_other_server_errors_are_a_database_error(
    apg_store: AsyncPostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = await apg_store.ensure_resource("run", "broken-schema")
    drop_function(pg_dsn, schema, "claim")
    with pytest.raises(DatabaseError, match="42883") as caught:
        await apg_store.claim(rid, ME, 30)
    assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedFunction)


def test_connections_carry_the_limits_and_a_name(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema, statement_timeout=2.5, lock_timeout=0.25) as store:
        rid = store.ensure_resource("run", "limits")
        with store.connection() as conn:
            assert conn.execute("SHOW statement_timeout").fetchone() == ("2500ms",)
            assert conn.execute("SHOW lock_timeout").fetchone() == ("250ms",)
            assert conn.execute("SHOW application_name").fetchone() == (app_name(schema),)
            # DISCARD ALL drops the fast path's statements and the settings alike.
            conn.execute("DISCARD ALL")
        claim = store.claim(rid, ME, 30)
        assert claim is not None
        with store.connection() as conn:
            assert conn.execute("SHOW lock_timeout").fetchone() == ("250ms",)
        assert store.migrate() == []
        with store.connection() as conn:
            assert conn.execute("SHOW statement_timeout").fetchone() == ("2500ms",)
    with (
        PostgresStore(pg_dsn, schema=schema, statement_timeout=None) as store,
        store.connection() as conn,
        psycopg.connect(pg_dsn) as plain,
    ):
        server_default = plain.execute("SHOW statement_timeout").fetchone()
        assert conn.execute("SHOW statement_timeout").fetchone() == server_default


# --- pools and closed stores -------------------------------------------------------


def test_an_exhausted_pool_raises_a_typed_error(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema, min_size=1, max_size=1, pool_timeout=0.2) as store:
        rid = store.ensure_resource("run", "pool")
        with store.connection():
            with pytest.raises(PoolExhaustedError, match=r"pool_timeout=0\.2 s.*max_size=1"):
                store.get(rid)
            with pytest.raises(PoolExhaustedError):
                store.claim(rid, ME, 30)
        assert store.claim(rid, ME, 30) is not None
    with pytest.raises(StoreClosedError):
        store.get(rid)


async def test_async_exhausted_pool_and_closed_store(pg_dsn: str, schema: str) -> None:
    store = await AsyncPostgresStore.open(
        pg_dsn, schema=schema, min_size=1, max_size=1, pool_timeout=0.2
    )
    rid = await store.ensure_resource("run", "pool")
    async with store.connection():
        with pytest.raises(PoolExhaustedError, match="max_size=1"):
            await store.claim(rid, ME, 30)
    await store.close()
    with pytest.raises(StoreClosedError):
        await store.get(rid)


# --- option checks -------------------------------------------------------------------

BAD_LIMITS = [-1, 0, math.nan, math.inf, 10**400, 10**7, True, "5"]


@pytest.mark.parametrize("option", ["statement_timeout", "lock_timeout", "pool_timeout"])
@pytest.mark.parametrize("value", BAD_LIMITS, ids=repr)
def test_bad_limits_are_refused_before_connecting(option: str, value: Any) -> None:
    if option == "pool_timeout" and value == 10**7:
        return  # a long pool wait is allowed; only the server limits have a ceiling
    dsn = "postgresql://nobody@127.0.0.1:1/none"  # never reached
    with pytest.raises(ValidationError, match=option):
        PostgresStore(dsn, **{option: value})
    with pytest.raises(ValidationError, match=option):
        AsyncPostgresStore(dsn, **{option: value})
    if option == "pool_timeout":
        with pytest.raises(ValidationError):
            PostgresStore(dsn, pool_timeout=None)  # type: ignore[arg-type]


def test_every_error_is_a_pglease_error() -> None:
    for cls in (
        CommitOutcomeUnknownError,
        DatabaseError,
        LockTimeoutError,
        PoolExhaustedError,
        StatementTimeoutError,
        StoreClosedError,
    ):
        assert issubclass(cls, PgleaseError)
