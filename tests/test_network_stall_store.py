"""Every store call ends within the store's limits on a stalled path, and its
error says the truth about the outcome (issue 31 items 1-3).

A store behind a fault-injecting proxy (tests/_stall_proxy.py) whose path goes
silent mid-call: every wait on a store connection ends at the client deadline
(statement_timeout + 5 s; `StoreConnection`), the connection is closed and
never reused, and the caller gets the class the retry rule defines:
`DatabaseUnavailableError` when nothing can have reached the server (a
mutation stalled before its COMMIT was sent), `CommitOutcomeUnknownError`
once a write may have left (a claim, renew, release, COMMIT or
ensure_resource). Each test heals the path after the error and reads the rows
directly, to check that the error told the truth. A renew also gives up when
its claim's local trust window closes (`Claim.trusted_until`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    CommitOutcomeUnknownError,
    DatabaseUnavailableError,
    Owner,
    Permit,
    PostgresStore,
)
from pglease.ids import resource_id

from ._stall_proxy import StallProxy

OWNER = Owner("host", "stalled")
#: Small, so that a stalled call ends in seconds: the client deadline is this + 5 s.
_STATEMENT_TIMEOUT = 1.0
_DEADLINE = _STATEMENT_TIMEOUT + 5.0
#: The documented bound with room for a busy machine; the code before this
#: waited for as long as the socket stayed open (here: for the whole pause).
_BOUND = _DEADLINE + 15.0


def _options(schema: str, **more: Any) -> dict[str, Any]:
    return {"schema": schema, "min_size": 1, "max_size": 2,
            "statement_timeout": _STATEMENT_TIMEOUT, "lock_timeout": 0.5, **more}  # fmt: skip


def _ended(call: Callable[[], object], bound: float = _BOUND) -> tuple[object, float]:
    """Run a blocking call in a thread; its result or exception, and how long it took.
    None (with the time waited) if it had not ended within `bound`."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(bound)
    return (outcome[0] if outcome else None), time.monotonic() - started


def _ended_in_time(proxy: StallProxy, outcome: object, elapsed: float) -> object:
    if outcome is None:
        proxy.resume()  # let the stuck call finish before the test fails
        pytest.fail(f"the call still waited after {elapsed:.1f} s (bound {_BOUND:g} s)")
    return outcome


async def _ended_async(proxy: StallProxy, call: Any, bound: float = _BOUND) -> object:
    started = time.monotonic()
    try:
        return await asyncio.wait_for(call, bound)
    except TimeoutError:
        proxy.resume()
        pytest.fail(f"the call still waited after {time.monotonic() - started:.1f} s")
    except BaseException as exc:
        return exc


def _settle(store: PostgresStore, read: Callable[[PostgresStore], object], until: object) -> object:
    """`read(store)` until it equals `until` or 10 s passed; the last value. The
    bytes the proxy held reach the server after the heal: give them a moment."""
    deadline = time.monotonic() + 10
    value = read(store)
    while value != until and time.monotonic() < deadline:
        time.sleep(0.2)
        value = read(store)
    return value


@pytest.fixture
def direct(pg_dsn: str, schema: str) -> Any:
    """Opens a store on the server itself, not through the proxy (to see what
    really happened); lazily, once the store under test migrated the schema."""
    opened: list[PostgresStore] = []

    def open_() -> PostgresStore:
        if not opened:
            opened.append(PostgresStore(pg_dsn, schema=schema, max_size=1))
        return opened[0]

    yield open_
    for store in opened:
        store.close()


def _table(pg_dsn: str, schema: str) -> str:
    """A table of the test's own rows, for `apply` to write into."""
    table = f'"{schema}".stall_rows'
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (n int)")
    return table


def _rows(pg_dsn: str, table: str) -> int:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])


# ------------------------------------------------------------------ mutate


@pytest.mark.parametrize("where", ["begin", "apply"])
def test_sync_mutate_stalled_before_commit_is_unavailable_and_nothing_committed(
    stall_proxy: StallProxy, pg_dsn: str, schema: str, where: str, direct: Any
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = store.ensure_resource("job", "mutate")
        table = _table(pg_dsn, schema)
        revision = store.get(rid).revision

        def apply(conn: psycopg.Connection[Any]) -> None:
            conn.execute(f"INSERT INTO {table} VALUES (1)")
            if where == "apply":
                stall_proxy.pause()
                conn.execute("SELECT 1")  # this one's answer never comes

        if where == "begin":
            stall_proxy.pause()
        error, elapsed = _ended(lambda: store.mutate(Permit(rid, revision), "job.moved", apply))
        _ended_in_time(stall_proxy, error, elapsed)
        stall_proxy.resume()
        assert type(error) is DatabaseUnavailableError, error
        assert "nothing was committed" in str(error) and "no answer from PostgreSQL" in str(error)
        assert elapsed >= _DEADLINE - 0.5  # the deadline, not something else, ended it
        # Healed: the held bytes reach the server, which rolls the session back.
        time.sleep(1.0)
        assert direct().get(rid).revision == revision
        assert _rows(pg_dsn, table) == 0
        # The stalled connection was dropped; the store works on a new one.
        assert store.mutate(Permit(rid, revision), "job.moved").revision == revision + 1


def test_sync_mutate_stalled_at_commit_is_outcome_unknown_and_tells_the_truth(
    stall_proxy: StallProxy, pg_dsn: str, schema: str, direct: Any
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = store.ensure_resource("job", "commit")
        table = _table(pg_dsn, schema)
        revision = store.get(rid).revision

        def apply(conn: psycopg.Connection[Any]) -> None:
            conn.execute(f"INSERT INTO {table} VALUES (1)")
            stall_proxy.pause()  # the COMMIT sent next is held

        error, elapsed = _ended(lambda: store.mutate(Permit(rid, revision), "job.moved", apply))
        _ended_in_time(stall_proxy, error, elapsed)
        stall_proxy.resume()
        assert isinstance(error, CommitOutcomeUnknownError), error
        assert error.operation == "mutate" and error.resource_id == rid
        _check_commit_truth(pg_dsn, rid, revision, table, direct)


def _check_commit_truth(pg_dsn: str, rid: str, revision: int, table: str, direct: Any) -> None:
    """After the heal the COMMIT held by the proxy reaches the server: the
    mutation lands whole (revision + 1, the event, apply's row) or not at all."""
    store = direct()
    settled = _settle(store, lambda s: s.get(rid).revision, revision + 1)
    assert settled in (revision, revision + 1)
    landed = settled == revision + 1
    assert _rows(pg_dsn, table) == (1 if landed else 0)
    events = [e.type for e in store.events(rid, after_revision=revision)]
    assert events == (["job.moved"] if landed else [])


async def test_async_mutate_stalled_at_begin_in_apply_and_at_commit(
    stall_proxy: StallProxy, pg_dsn: str, schema: str, direct: Any
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_options(schema)) as store:
        rid = await store.ensure_resource("job", "mutate")
        table = await asyncio.to_thread(_table, pg_dsn, schema)
        revision = (await store.get(rid)).revision
        await asyncio.to_thread(direct)

        for where in ("begin", "apply"):

            async def apply(conn: psycopg.AsyncConnection[Any], where: str = where) -> None:
                await conn.execute(f"INSERT INTO {table} VALUES (1)")
                if where == "apply":
                    stall_proxy.pause()
                    await conn.execute("SELECT 1")

            if where == "begin":
                stall_proxy.pause()
            started = time.monotonic()
            error = await _ended_async(
                stall_proxy, store.mutate(Permit(rid, revision), "job.moved", apply)
            )
            elapsed = time.monotonic() - started
            stall_proxy.resume()
            assert type(error) is DatabaseUnavailableError, (where, error)
            assert "nothing was committed" in str(error), error
            assert elapsed >= _DEADLINE - 0.5
            await asyncio.sleep(1.0)
            assert (await store.get(rid)).revision == revision
            assert await asyncio.to_thread(_rows, pg_dsn, table) == 0

        async def at_commit(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(f"INSERT INTO {table} VALUES (1)")
            stall_proxy.pause()

        error = await _ended_async(
            stall_proxy, store.mutate(Permit(rid, revision), "job.moved", at_commit)
        )
        stall_proxy.resume()
        assert isinstance(error, CommitOutcomeUnknownError), error
        assert error.operation == "mutate"
        await asyncio.to_thread(_check_commit_truth, pg_dsn, rid, revision, table, direct)


# ---------------------------------------------------- ensure_resource, connection()


def test_sync_ensure_resource_stalled_is_outcome_unknown(
    stall_proxy: StallProxy, pg_dsn: str, schema: str, direct: Any
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        store.ensure_resource("job", "warm")
        stall_proxy.pause()
        error, elapsed = _ended(lambda: store.ensure_resource("job", "new"))
        _ended_in_time(stall_proxy, error, elapsed)
        stall_proxy.resume()
        # The INSERT may have left: it can land when the path heals.
        assert isinstance(error, CommitOutcomeUnknownError), error
        assert error.operation == "ensure_resource"
        assert error.resource_id == resource_id("job", "new")
        assert "idempotent" in str(error)
        # Idempotent: calling again is the retry rule, whatever happened.
        assert store.ensure_resource("job", "new") == error.resource_id
        assert direct().get(error.resource_id).id == error.resource_id


async def test_async_ensure_resource_stalled_is_outcome_unknown(
    stall_proxy: StallProxy, schema: str
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_options(schema)) as store:
        await store.ensure_resource("job", "warm")
        stall_proxy.pause()
        error = await _ended_async(stall_proxy, store.ensure_resource("job", "new"))
        stall_proxy.resume()
        assert isinstance(error, CommitOutcomeUnknownError), error
        assert error.operation == "ensure_resource"
        assert await store.ensure_resource("job", "new") == error.resource_id


def test_sync_sql_on_a_borrowed_connection_ends_and_the_connection_is_dropped(
    stall_proxy: StallProxy, schema: str
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        with store.connection() as conn:
            conn.execute("SELECT 1")
        borrowed: list[psycopg.Connection[Any]] = []

        def run() -> object:
            with store.connection() as conn:
                borrowed.append(conn)
                stall_proxy.pause()
                return conn.execute("SELECT 2").fetchone()

        error, elapsed = _ended(run)
        _ended_in_time(stall_proxy, error, elapsed)
        stall_proxy.resume()
        # The caller's own SQL: psycopg's error (README: store.connection()).
        assert isinstance(error, psycopg.OperationalError), error
        assert "no answer from PostgreSQL" in str(error)
        assert borrowed[0].closed  # never handed out again
        with store.connection() as conn:
            assert conn is not borrowed[0]
            assert conn.execute("SELECT 3").fetchone() == (3,)


async def test_async_sql_on_a_borrowed_connection_ends_and_the_connection_is_dropped(
    stall_proxy: StallProxy, schema: str
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_options(schema)) as store:
        borrowed: list[psycopg.AsyncConnection[Any]] = []

        async def run() -> object:
            async with store.connection() as conn:
                borrowed.append(conn)
                stall_proxy.pause()
                return await (await conn.execute("SELECT 2")).fetchone()

        error = await _ended_async(stall_proxy, run())
        stall_proxy.resume()
        assert isinstance(error, psycopg.OperationalError), error
        assert borrowed[0].closed
        async with store.connection() as conn:
            assert conn is not borrowed[0]
            assert await (await conn.execute("SELECT 3")).fetchone() == (3,)


# ------------------------------------------------------ claim, renew, release, get


def test_sync_lease_calls_stalled_say_what_may_have_happened(
    stall_proxy: StallProxy, pg_dsn: str, schema: str, direct: Any
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema)) as store:
        rid = store.ensure_resource("job", "lease")
        claim = store.claim(rid, OWNER, ttl=60)
        assert claim is not None
        for name, call in (
            ("renew", lambda: store.renew(claim, 60)),
            ("release", lambda: store.release(claim)),
        ):
            stall_proxy.pause()
            error, elapsed = _ended(call)
            _ended_in_time(stall_proxy, error, elapsed)
            stall_proxy.resume()
            assert isinstance(error, CommitOutcomeUnknownError), (name, error)
            assert error.operation == name and error.resource_id == rid
            store.get(rid)  # a live connection again before the next stall
        # Healed: the release held by the proxy lands (nothing else can be there).
        assert _settle(direct(), lambda s: s.get(rid).lease.held, False) is False
        stall_proxy.pause()
        error, elapsed = _ended(lambda: store.get(rid))
        _ended_in_time(stall_proxy, error, elapsed)
        stall_proxy.resume()
        assert type(error) is DatabaseUnavailableError, error
        assert store.get(rid).lease.generation == claim.generation


async def test_async_lease_calls_stalled_say_what_may_have_happened(
    stall_proxy: StallProxy, pg_dsn: str, schema: str, direct: Any
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_options(schema)) as store:
        rid = await store.ensure_resource("job", "lease")
        claim = await store.claim(rid, OWNER, ttl=60)
        assert claim is not None
        for name, call in (("renew", store.renew(claim, 60)), ("release", store.release(claim))):
            stall_proxy.pause()
            error = await _ended_async(stall_proxy, call)
            stall_proxy.resume()
            assert isinstance(error, CommitOutcomeUnknownError), (name, error)
            assert error.operation == name
            await store.get(rid)  # a live connection again before the next stall
        reader = await asyncio.to_thread(direct)
        held = await asyncio.to_thread(_settle, reader, lambda s: s.get(rid).lease.held, False)
        assert held is False
        stall_proxy.pause()
        error = await _ended_async(stall_proxy, store.get(rid))
        stall_proxy.resume()
        assert type(error) is DatabaseUnavailableError, error


# ------------------------------------------------ item 3: the claim's trust window

#: A long client deadline (statement_timeout 30 s + 5 s): a renew that ends in
#: a few seconds was ended by its claim's trust window, not by the deadline.
_LONG = {"statement_timeout": 30.0}


def test_sync_claim_and_renew_carry_their_trust_window(
    stall_proxy: StallProxy, schema: str
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema, **_LONG)) as store:
        rid = store.ensure_resource("job", "window")
        before = time.monotonic()
        claim = store.claim(rid, OWNER, ttl=20)
        assert claim is not None and claim.trusted_until is not None
        assert before + 20 <= claim.trusted_until <= time.monotonic() + 20
        before = time.monotonic()
        renewed = store.renew(claim, 40)
        assert renewed.trusted_until is not None
        assert before + 40 <= renewed.trusted_until <= time.monotonic() + 40
        assert renewed == replace(renewed, trusted_until=None)  # not compared


def test_sync_renew_gives_up_when_its_claims_trust_window_closes(
    stall_proxy: StallProxy, pg_dsn: str, schema: str, direct: Any
) -> None:
    with PostgresStore(stall_proxy.dsn, **_options(schema, **_LONG)) as store:
        rid = store.ensure_resource("job", "window")
        claim = store.claim(rid, OWNER, ttl=3)  # trusted for 3 s from the request
        assert claim is not None and claim.trusted_until is not None
        stall_proxy.pause()
        error, elapsed = _ended(lambda: store.renew(claim, 3))
        ended_at = time.monotonic()
        _ended_in_time(stall_proxy, error, elapsed)
        stall_proxy.resume()
        assert isinstance(error, CommitOutcomeUnknownError), error
        assert error.operation == "renew"
        assert "trust window" in str(error)
        # It waited until the window closed, and not for the 35 s deadline.
        assert claim.trusted_until - 0.1 <= ended_at < claim.trusted_until + 15
        # Healed: the renew (held by the proxy) may land or find the lease
        # expired; either way no other holder, the same generation.
        lease = direct().get(rid).lease
        assert lease.generation == claim.generation
        assert lease.owner in (OWNER, None)


async def test_async_renew_gives_up_when_its_claims_trust_window_closes(
    stall_proxy: StallProxy, schema: str
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_options(schema, **_LONG)) as store:
        rid = await store.ensure_resource("job", "window")
        claim = await store.claim(rid, OWNER, ttl=60)
        assert claim is not None
        # The window, moved by hand: as if the claim had been taken 59 s ago.
        claim = replace(claim, trusted_until=time.monotonic() + 1.0)
        stall_proxy.pause()
        error = await _ended_async(stall_proxy, store.renew(claim, 60))
        ended_at = time.monotonic()
        stall_proxy.resume()
        assert isinstance(error, CommitOutcomeUnknownError), error
        assert "trust window" in str(error)
        assert claim.trusted_until is not None
        assert claim.trusted_until - 0.1 <= ended_at < claim.trusted_until + 15
        # The store is fine afterwards; the renew held by the proxy landed or not,
        # the lease is still this owner's.
        assert (await store.get(rid)).lease.owner == OWNER


async def test_async_a_renew_after_the_window_closed_still_runs(
    stall_proxy: StallProxy, schema: str
) -> None:
    """The trust window bounds a renew's wait only while it is open: a renew
    started after it closed is the holder's way back to a trusted lease."""
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_options(schema)) as store:
        rid = await store.ensure_resource("job", "late")
        claim = await store.claim(rid, OWNER, ttl=60)
        assert claim is not None
        late = replace(claim, trusted_until=time.monotonic() - 1.0)
        renewed = await store.renew(late, 60)
        assert renewed.generation == claim.generation
        assert renewed.trusted_until is not None and renewed.trusted_until > time.monotonic()
