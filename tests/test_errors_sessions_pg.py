"""Failure honesty of PostgreSQL sessions: no raw psycopg error from the session API.

Real server, real failures: the store's backends terminated
(pg_terminate_backend) before and during calls, a commit stuck behind a
session row another connection holds past the store's statement_timeout or
lock_timeout. A commit that failed left nothing; the handle keeps its lease.
Sync and asyncio: the tests taking `flavour` run on both (`tests/_blocking.py`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    CommitOutcomeUnknownError,
    DatabaseError,
    DatabaseUnavailableError,
    LeaseLostError,
    LockTimeoutError,
    PgleaseError,
    PostgresStore,
    StatementTimeoutError,
)
from pglease.sessions import (
    AsyncPostgresSessionRepository,
    PostgresSessionRepository,
    SessionExistsError,
    WriterLeaseLostError,
)

from ._blocking import FLAVOURS, Flavour, open_flavour
from .test_driver_errors import awarm, kill_store_backends, terminate, wait_for_lock_waiter, warm


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


flavour = pytest.fixture(params=FLAVOURS)(open_flavour)


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except BaseException as exc:
        return exc


async def _aoutcome(fn: Callable[[], Awaitable[object]]) -> object:
    try:
        return await fn()
    except BaseException as exc:
        return exc


def assert_typed(outcome: object) -> None:
    """A value, or a PgleaseError; never a raw driver error."""
    assert not isinstance(outcome, psycopg.Error), repr(outcome)
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, PgleaseError), repr(outcome)


@pytest.fixture
def session_row_locker(
    pg_dsn: str, schema: str
) -> Iterator[Callable[[str], psycopg.Connection[Any]]]:
    """`lock(session_id)`: hold the session's row FOR UPDATE in an open transaction
    (a stalled writer); rolled back at the end of the test."""
    conn = psycopg.connect(pg_dsn)

    def lock(session_id: str) -> psycopg.Connection[Any]:
        conn.execute(f'SELECT 1 FROM "{schema}".sessions WHERE id = %s FOR UPDATE', [session_id])
        return conn

    try:
        yield lock
    finally:
        conn.close()


# --- terminated backends --------------------------------------------------------------


def test_session_calls_after_terminated_backends_are_typed(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    repo = PostgresSessionRepository(pg_store, renew_interval=None)
    s = repo.create("s1")
    root = s.append_message(None, msg("root"))
    s.set_register("fact", "k", 1)
    calls: list[Callable[[], object]] = [
        lambda: repo.exists("s1"),
        lambda: repo.snapshot("s1"),
        repo.list,
        lambda: repo.info("s1"),
        s.stats,
        s.snapshot,
        s.scan_entries,
        s.usage_rows,
        lambda: s.get_entry(root.id),
        lambda: s.scan_branch(root.id),
        lambda: s.get_register("fact", "k"),
        lambda: s.list_registers("fact"),
        lambda: s.append_message(root.id, msg("after a kill")),
        s.renew,
        lambda: repo.create("s2"),
        lambda: repo.fork("s1", id="s3"),
    ]
    outcomes = []
    for call in calls:
        warm(pg_store)
        assert kill_store_backends(pg_dsn, schema) >= 1
        outcomes.append(_outcome(call))
    for outcome in outcomes:
        assert_typed(outcome)
    # Dead idle connections are dropped before anything is sent, and reads are
    # retried on a fresh one: here every call succeeded.
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert [e.seq for e in s.scan_entries()] == [3, 5]
    assert not s.lost.is_set()
    repo.close()


async def test_async_session_calls_after_terminated_backends_are_typed(
    apg_store: AsyncPostgresStore, pg_dsn: str, schema: str
) -> None:
    repo = AsyncPostgresSessionRepository(apg_store, renew_interval=None)
    s = await repo.create("s1")
    root = await s.append_message(None, msg("root"))
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: repo.exists("s1"),
        lambda: repo.snapshot("s1"),
        repo.list,
        s.stats,
        s.scan_entries,
        lambda: s.get_entry(root.id),
        lambda: s.scan_branch(root.id),
        lambda: s.list_registers("lane.leaf"),
        lambda: s.append_message(root.id, msg("after a kill")),
        s.renew,
        lambda: repo.create("s2"),
    ]
    outcomes = []
    for call in calls:
        await awarm(apg_store)
        assert await asyncio.to_thread(kill_store_backends, pg_dsn, schema) >= 1
        outcomes.append(await _aoutcome(call))
    for outcome in outcomes:
        assert_typed(outcome)
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    await repo.close()


def test_a_commit_cut_off_before_commit_left_nothing(
    pg_dsn: str,
    schema: str,
    session_row_locker: Callable[[str], psycopg.Connection[Any]],
    flavour: Flavour,
) -> None:
    """The commit waits behind a stalled writer's row lock; its backend is
    terminated while it waits: nothing was committed, and the handle goes on."""
    with flavour.store(lock_timeout=None) as store:
        repo = flavour.repo(store, renew_interval=None)
        s = repo.create("s1")
        root = s.append_message(None, msg("root"))
        before = s.stats()
        revision = store.get(s.resource_id).revision
        session_row_locker("s1")
        result: list[object] = []
        worker = threading.Thread(
            target=lambda: result.append(_outcome(lambda: s.append_message(root.id, msg("cut"))))
        )
        worker.start()
        terminate(pg_dsn, wait_for_lock_waiter(pg_dsn, schema))
        worker.join(30)
        [error] = result
        assert isinstance(error, DatabaseUnavailableError), repr(error)
        assert not isinstance(error, CommitOutcomeUnknownError)
        assert "nothing was committed" in str(error)
        assert isinstance(error.__cause__, psycopg.OperationalError)
        # The locker still holds the row; reads do not wait for it.
        assert s.stats() == before
        assert store.get(s.resource_id).revision == revision
        assert [e.id for e in s.scan_entries()] == [root.id]
        assert not s.lost.is_set()


SESSION_TABLES = (
    "sessions",
    "session_entries",
    "session_registers",
    "session_usage_ledger",
    "session_branch_entries",
    "session_branch_meta",
)


@pytest.fixture
def table_locker(pg_dsn: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection whose `lock()` takes every session table ACCESS EXCLUSIVE (even
    reads wait for it) in an open transaction; `rollback()` lets them through."""
    conn = psycopg.connect(pg_dsn)
    try:
        yield conn
    finally:
        conn.close()


def lock_session_tables(conn: psycopg.Connection[Any], schema: str) -> None:
    names = ", ".join(f'"{schema}".{t}' for t in SESSION_TABLES)
    conn.execute(f"LOCK TABLE {names} IN ACCESS EXCLUSIVE MODE")


def test_session_reads_cut_off_mid_statement_are_retried(
    pg_dsn: str, schema: str, table_locker: psycopg.Connection[Any]
) -> None:
    """A read waits behind a table lock; its backend is terminated while it waits;
    the retry on a fresh connection answers once the lock is gone."""
    with PostgresStore(pg_dsn, schema=schema, lock_timeout=None) as store:
        repo = PostgresSessionRepository(store, renew_interval=None)
        s = repo.create("s1")
        root = s.append_message(None, msg("root"))
        reads: list[Callable[[], object]] = [
            lambda: repo.snapshot("s1"),
            repo.list,
            lambda: repo.exists("s1"),
            s.stats,
            s.scan_entries,
            lambda: s.scan_branch(root.id),
        ]
        for read in reads:
            lock_session_tables(table_locker, schema)
            result: list[object] = []
            worker = threading.Thread(target=lambda r=read, out=result: out.append(_outcome(r)))
            worker.start()
            terminate(pg_dsn, wait_for_lock_waiter(pg_dsn, schema))
            wait_for_lock_waiter(pg_dsn, schema)  # the retry waits again
            table_locker.rollback()
            worker.join(30)
            [outcome] = result
            assert not isinstance(outcome, BaseException), repr(outcome)
        assert [e.id for e in s.scan_entries()] == [root.id]
        repo.close()


async def test_async_session_read_cut_off_mid_statement_is_retried(
    pg_dsn: str, schema: str, table_locker: psycopg.Connection[Any]
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=None) as store:
        repo = AsyncPostgresSessionRepository(store, renew_interval=None)
        s = await repo.create("s1")
        await s.append_message(None, msg("root"))
        for read in (lambda: repo.snapshot("s1"), s.stats, s.scan_entries):
            lock_session_tables(table_locker, schema)
            task = asyncio.create_task(_aoutcome(read))
            pid = await asyncio.to_thread(wait_for_lock_waiter, pg_dsn, schema)
            await asyncio.to_thread(terminate, pg_dsn, pid)
            await asyncio.to_thread(wait_for_lock_waiter, pg_dsn, schema)
            table_locker.rollback()
            outcome = await asyncio.wait_for(task, 30)
            assert not isinstance(outcome, BaseException), repr(outcome)
        await repo.close()


@pytest.mark.parametrize("limit", ["statement_timeout", "lock_timeout"])
def test_session_reads_past_the_time_limits_are_typed(
    pg_dsn: str, schema: str, table_locker: psycopg.Connection[Any], limit: str
) -> None:
    options: dict[str, Any] = {"statement_timeout": None, "lock_timeout": None, limit: 1.0}
    expected = StatementTimeoutError if limit == "statement_timeout" else LockTimeoutError
    with PostgresStore(pg_dsn, schema=schema, **options) as store:
        repo = PostgresSessionRepository(store, renew_interval=None)
        s = repo.create("s1")
        root = s.append_message(None, msg("root"))
        lock_session_tables(table_locker, schema)
        reads: list[Callable[[], object]] = [
            lambda: repo.snapshot("s1"),
            repo.list,
            lambda: repo.exists("s1"),
            lambda: repo.open("s1"),
            s.stats,
            s.scan_entries,
            s.usage_rows,
            lambda: s.get_entry(root.id),
            lambda: s.scan_branch(root.id),
            lambda: s.get_register("lane.leaf", "main"),
            lambda: s.list_registers("lane.leaf"),
        ]
        for read in reads:
            error = _outcome(read)
            assert isinstance(error, expected), repr(error)
            assert isinstance(error.__cause__, psycopg.Error)
        table_locker.rollback()
        assert [e.id for e in s.scan_entries()] == [root.id]
        repo.close()


async def test_async_session_reads_past_lock_timeout_are_typed(
    pg_dsn: str, schema: str, table_locker: psycopg.Connection[Any]
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=0.5) as store:
        repo = AsyncPostgresSessionRepository(store, renew_interval=None)
        s = await repo.create("s1")
        root = await s.append_message(None, msg("root"))
        lock_session_tables(table_locker, schema)
        reads: list[Callable[[], Awaitable[object]]] = [
            lambda: repo.snapshot("s1"),
            repo.list,
            lambda: repo.exists("s1"),
            s.stats,
            s.scan_entries,
            lambda: s.get_entry(root.id),
            lambda: s.scan_branch(root.id),
        ]
        for read in reads:
            error = await _aoutcome(read)
            assert isinstance(error, LockTimeoutError), repr(error)
        table_locker.rollback()
        await repo.close()


def test_a_cancelled_commit_is_a_typed_database_error(
    pg_dsn: str,
    schema: str,
    session_row_locker: Callable[[str], psycopg.Connection[Any]],
    flavour: Flavour,
) -> None:
    """pg_cancel_backend is not the store's statement_timeout: a DatabaseError
    naming SQLSTATE 57014, and nothing was committed."""
    with flavour.store(lock_timeout=None) as store:
        repo = flavour.repo(store, renew_interval=None)
        s = repo.create("s1")
        root = s.append_message(None, msg("root"))
        before = s.stats()
        locker = session_row_locker("s1")
        result: list[object] = []
        worker = threading.Thread(
            target=lambda: result.append(_outcome(lambda: s.append_message(root.id, msg("no"))))
        )
        worker.start()
        pid = wait_for_lock_waiter(pg_dsn, schema)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pg_cancel_backend(%s)", [pid]).fetchone()
            assert row == (True,)
        worker.join(30)
        [error] = result
        assert isinstance(error, DatabaseError), repr(error)
        assert not isinstance(error, StatementTimeoutError)
        assert error.sqlstate == "57014"
        assert isinstance(error.__cause__, psycopg.errors.QueryCanceled)
        assert s.stats() == before
        locker.rollback()
        assert s.append_message(root.id, msg("yes")).seq == before.next_seq
        repo.close()


# --- the store's time limits -------------------------------------------------------------


def test_a_commit_past_statement_timeout_is_typed_and_left_nothing(
    pg_dsn: str,
    schema: str,
    session_row_locker: Callable[[str], psycopg.Connection[Any]],
    flavour: Flavour,
) -> None:
    # 1 s, not less: the other statements of the test must not hit it on a busy host.
    with flavour.store(statement_timeout=1.0, lock_timeout=None) as store:
        repo = flavour.repo(store, renew_interval=None)
        s = repo.create("s1")
        root = s.append_message(None, msg("root"))
        before = s.stats()
        revision = store.get(s.resource_id).revision
        session_row_locker("s1")
        with pytest.raises(StatementTimeoutError, match=r"statement_timeout=1 s") as caught:
            s.append_message(root.id, msg("too slow"))
        assert caught.value.sqlstate == "57014"
        assert isinstance(caught.value.__cause__, psycopg.errors.QueryCanceled)
        assert s.stats() == before
        assert store.get(s.resource_id).revision == revision
        assert [e.id for e in s.scan_entries()] == [root.id]
        assert not s.lost.is_set()
        s.close()
        # Deleting waits on the same row: also typed, also without effect.
        with pytest.raises(StatementTimeoutError):
            repo.delete("s1")
        assert repo.exists("s1")


def test_a_commit_past_lock_timeout_is_typed_and_the_handle_goes_on(
    pg_dsn: str,
    schema: str,
    session_row_locker: Callable[[str], psycopg.Connection[Any]],
    flavour: Flavour,
) -> None:
    with flavour.store(lock_timeout=0.5) as store:
        repo = flavour.repo(store, renew_interval=None)
        s = repo.create("s1")
        root = s.append_message(None, msg("root"))
        before = s.stats()
        locker = psycopg.connect(pg_dsn)
        try:
            locker.execute(f'SELECT 1 FROM "{schema}".sessions WHERE id = %s FOR UPDATE', ["s1"])
            with pytest.raises(LockTimeoutError, match=r"lock_timeout=0\.5 s") as caught:
                s.append_message(root.id, msg("blocked"))
            assert isinstance(caught.value.__cause__, psycopg.errors.LockNotAvailable)
            assert s.stats() == before
        finally:
            locker.close()
        # The stalled writer is gone: the same handle commits at the same seq.
        assert s.append_message(root.id, msg("through")).seq == before.next_seq
        repo.close()


async def test_async_commit_past_statement_timeout_is_typed_and_left_nothing(
    pg_dsn: str, schema: str, session_row_locker: Callable[[str], psycopg.Connection[Any]]
) -> None:
    async with AsyncPostgresStore(
        pg_dsn, schema=schema, statement_timeout=1.0, lock_timeout=None
    ) as store:
        repo = AsyncPostgresSessionRepository(store, renew_interval=None)
        s = await repo.create("s1")
        root = await s.append_message(None, msg("root"))
        before = await s.stats()
        session_row_locker("s1")
        with pytest.raises(StatementTimeoutError):
            await s.append_message(root.id, msg("too slow"))
        assert await s.stats() == before
        await repo.close()


async def test_async_commit_past_lock_timeout_is_typed(
    pg_dsn: str, schema: str, session_row_locker: Callable[[str], psycopg.Connection[Any]]
) -> None:
    async with AsyncPostgresStore(pg_dsn, schema=schema, lock_timeout=0.5) as store:
        repo = AsyncPostgresSessionRepository(store, renew_interval=None)
        s = await repo.create("s1")
        before = await s.stats()
        session_row_locker("s1")
        with pytest.raises(LockTimeoutError):
            await s.set_register("fact", "k", 2)
        assert await s.stats() == before
        assert await s.get_register("fact", "k") is None
        await repo.close()


# --- session errors stay what they were -----------------------------------------------------


def test_session_specific_errors_are_unchanged(flavour: Flavour) -> None:
    repo = flavour.repo(renew_interval=None)
    with repo.create("s1") as s:
        s.append_message(None, msg("a"), id="a")
        from pglease.sessions import DuplicateIdError

        with pytest.raises(DuplicateIdError):
            s.append_message(None, msg("again"), id="a")
    with pytest.raises(SessionExistsError):
        repo.create("s1")


# --- a lost writer lease is a LeaseLostError -------------------------------------------------


def test_a_lost_pg_writer_lease_is_a_lease_lost_error(flavour: Flavour) -> None:
    first = flavour.repo(lease_seconds=0.5, renew_interval=None)
    second = flavour.repo(lease_seconds=30, renew_interval=None)
    stale = first.create("s1")
    with second.open("s1", wait=30):  # claims once the first lease ran out
        with pytest.raises(LeaseLostError) as caught:
            stale.append_message(None, msg("stale"))
        assert isinstance(caught.value, WriterLeaseLostError)
        with pytest.raises(LeaseLostError):
            stale.renew()
    stale.close()


async def test_async_lost_pg_writer_lease_is_a_lease_lost_error(
    apg_store: AsyncPostgresStore,
) -> None:
    first = AsyncPostgresSessionRepository(apg_store, lease_seconds=0.5, renew_interval=None)
    second = AsyncPostgresSessionRepository(apg_store, lease_seconds=30, renew_interval=None)
    stale = await first.create("s1")
    async with await second.open("s1", wait=30):
        with pytest.raises(LeaseLostError):
            await stale.append_message(None, msg("stale"))
    await stale.close()
