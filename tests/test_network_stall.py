"""Live when the network stalls (issue 31): a store behind a fault-injecting
proxy (tests/_stall_proxy.py) fails fast while the server is unreachable and
is back as soon as the server is."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    CommitOutcomeUnknownError,
    DatabaseUnavailableError,
    Owner,
    PostgresStore,
)

from ._stall_proxy import StallProxy


def test_the_proxy_pauses_resets_and_refuses(stall_proxy: StallProxy) -> None:
    with psycopg.connect(stall_proxy.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert stall_proxy.connections == 1
        stall_proxy.pause()
        answer: list[object] = []
        reader = threading.Thread(target=lambda: answer.append(conn.execute("SELECT 2").fetchone()))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not answer  # held by the pause, socket open
        stall_proxy.resume()
        reader.join(30)
        assert answer == [(2,)]
        assert stall_proxy.reset() == 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 3")
    stall_proxy.refuse()
    with pytest.raises(psycopg.OperationalError, match="refused"):
        psycopg.connect(stall_proxy.dsn, connect_timeout=5)
    stall_proxy.accept()
    with psycopg.connect(stall_proxy.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 4").fetchone() == (4,)


# --------------------------------------------------------------- item 6: server down

#: Long enough for psycopg-pool's reconnect back-off (1, 2, 4, 8 s ...) to grow
#: past the outage's end: its next attempt would come about 7 s after the return.
_OUTAGE = 8.5
#: Far above connect_timeout: a call that waited for the pool would show.
_POOL_TIMEOUT = 30.0
_CONNECT_TIMEOUT = 2.0
#: Generous bounds for a busy machine; the old code needed the pool's 30 s to
#: fail and 6-8 s to come back here.
_FAIL_WITHIN = _CONNECT_TIMEOUT + 4.0
_BACK_WITHIN = 4.0


def _store_options(schema: str) -> dict[str, Any]:
    return {"schema": schema, "min_size": 2, "max_size": 2,
            "connect_timeout": _CONNECT_TIMEOUT, "pool_timeout": _POOL_TIMEOUT}  # fmt: skip


def test_sync_calls_fail_fast_while_the_server_is_down_and_recover_when_back(
    stall_proxy: StallProxy, schema: str
) -> None:
    with PostgresStore(stall_proxy.dsn, **_store_options(schema)) as store:
        rid = store.ensure_resource("job", "down")
        store.get(rid)
        stall_proxy.refuse()
        stall_proxy.reset()
        down = time.monotonic()
        while True:
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError, match="refused") as caught:
                store.get(rid)
            assert time.monotonic() - started < _FAIL_WITHIN, caught.value
            if time.monotonic() - down > _OUTAGE:
                break
            time.sleep(0.5)
        assert "127.0.0.1" in str(caught.value)
        stall_proxy.accept()
        back = time.monotonic()
        assert store.get(rid).id == rid
        assert time.monotonic() - back < _BACK_WITHIN


async def test_async_calls_fail_fast_while_the_server_is_down_and_recover_when_back(
    stall_proxy: StallProxy, schema: str
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_store_options(schema)) as store:
        rid = await store.ensure_resource("job", "down")
        await store.get(rid)
        stall_proxy.refuse()
        stall_proxy.reset()
        down = time.monotonic()
        while True:
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError, match="refused") as caught:
                await store.get(rid)
            assert time.monotonic() - started < _FAIL_WITHIN, caught.value
            if time.monotonic() - down > _OUTAGE:
                break
            await asyncio.sleep(0.5)
        assert "127.0.0.1" in str(caught.value)
        stall_proxy.accept()
        back = time.monotonic()
        assert (await store.get(rid)).id == rid
        assert time.monotonic() - back < _BACK_WITHIN


# ----------------------------------------------- items 1 and 2: a stalled path

#: A stalled call must end within statement_timeout plus the client's grace
#: (`Limits.client_deadline`); the bound adds room for a busy machine. The old
#: code waited for an answer for as long as the socket stayed open.
_STATEMENT_TIMEOUT = 1.0
_STALL_BOUND = 30.0


def _stall_options(schema: str) -> dict[str, Any]:
    return {"schema": schema, "min_size": 1, "max_size": 1,
            "statement_timeout": _STATEMENT_TIMEOUT, "lock_timeout": 0.5}  # fmt: skip


def _check_landed(pg_dsn: str, schema: str, rid: str, error: CommitOutcomeUnknownError) -> None:
    """After the proxy resumed, the claim may have reached the server after all:
    then it holds the lease for the owner the error names (hence outcome-unknown)."""
    with PostgresStore(pg_dsn, schema=schema, max_size=1) as direct:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lease = direct.get(rid).lease
            if lease.held:
                assert lease.owner == error.owner == OWNER
                break
            time.sleep(0.2)


OWNER = Owner("host", "stalled")


def test_sync_a_stalled_claim_ends_outcome_unknown_and_the_connection_is_dropped(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    with PostgresStore(stall_proxy.dsn, **_stall_options(schema)) as store:
        warm = store.ensure_resource("job", "warm")
        rid = store.ensure_resource("job", "stalled")
        assert store.claim(warm, OWNER, ttl=60) is not None
        stall_proxy.pause()
        outcome: list[BaseException | object] = []

        def claim() -> None:
            try:
                outcome.append(store.claim(rid, OWNER, ttl=60))
            except BaseException as exc:
                outcome.append(exc)

        started = time.monotonic()
        caller = threading.Thread(target=claim, daemon=True)
        caller.start()
        caller.join(_STALL_BOUND)
        elapsed = time.monotonic() - started
        stall_proxy.resume()
        assert outcome, f"the claim still waits after {elapsed:.1f} s"
        error = outcome[0]
        assert isinstance(error, CommitOutcomeUnknownError), error
        assert "no answer from PostgreSQL" in str(error)
        assert error.resource_id == rid and error.token is not None
        _check_landed(pg_dsn, schema, rid, error)
        # The stalled connection was dropped: the next call runs on a new one.
        assert store.get(warm).lease.owner == OWNER


async def test_async_a_stalled_claim_ends_outcome_unknown_and_the_connection_is_dropped(
    stall_proxy: StallProxy, pg_dsn: str, schema: str
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_stall_options(schema)) as store:
        warm = await store.ensure_resource("job", "warm")
        rid = await store.ensure_resource("job", "stalled")
        assert await store.claim(warm, OWNER, ttl=60) is not None
        stall_proxy.pause()
        with pytest.raises(CommitOutcomeUnknownError) as caught:
            await asyncio.wait_for(store.claim(rid, OWNER, ttl=60), _STALL_BOUND)
        stall_proxy.resume()
        assert "no answer from PostgreSQL" in str(caught.value)
        assert caught.value.resource_id == rid and caught.value.token is not None
        await asyncio.to_thread(_check_landed, pg_dsn, schema, rid, caught.value)
        assert (await store.get(warm)).lease.owner == OWNER


def test_sync_a_stalled_read_ends_unavailable_and_the_store_recovers(
    stall_proxy: StallProxy, schema: str
) -> None:
    with PostgresStore(stall_proxy.dsn, **_stall_options(schema)) as store:
        rid = store.ensure_resource("job", "read")
        stall_proxy.pause()
        outcome: list[BaseException | object] = []

        def read() -> None:
            try:
                outcome.append(store.get(rid))
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=read, daemon=True)
        caller.start()
        caller.join(_STALL_BOUND)
        stall_proxy.resume()
        assert outcome, "the read still waits"
        error = outcome[0]
        # A read commits nothing: unavailable, not outcome-unknown.
        assert type(error) is DatabaseUnavailableError, error
        assert "no answer from PostgreSQL" in str(error)
        assert store.get(rid).id == rid


async def test_async_a_stalled_read_ends_unavailable_and_the_store_recovers(
    stall_proxy: StallProxy, schema: str
) -> None:
    async with await AsyncPostgresStore.open(stall_proxy.dsn, **_stall_options(schema)) as store:
        rid = await store.ensure_resource("job", "read")
        stall_proxy.pause()
        with pytest.raises(DatabaseUnavailableError) as caught:
            await asyncio.wait_for(store.get(rid), _STALL_BOUND)
        stall_proxy.resume()
        assert type(caught.value) is DatabaseUnavailableError
        assert "no answer from PostgreSQL" in str(caught.value)
        assert (await store.get(rid)).id == rid


def test_sync_a_call_on_a_silent_path_is_unavailable_within_connect_timeout(
    stall_proxy: StallProxy, schema: str
) -> None:
    """The pool's own reconnection is bounded by connect_timeout: once the
    stalled connection is dropped, the next call learns that the server does
    not answer (DatabaseUnavailableError), not that the pool ran dry."""
    options = {**_stall_options(schema), "connect_timeout": _CONNECT_TIMEOUT}
    with PostgresStore(stall_proxy.dsn, **options) as store:
        rid = store.ensure_resource("job", "silent")
        stall_proxy.pause()
        try:
            with pytest.raises(DatabaseUnavailableError, match="no answer"):
                store.get(rid)  # the kept connection stalls: dropped at the deadline
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError) as caught:
                store.get(rid)
            assert time.monotonic() - started < 3 * _CONNECT_TIMEOUT + 4.0, caught.value
            assert type(caught.value) is DatabaseUnavailableError, caught.value
            assert "timeout" in str(caught.value), caught.value
        finally:
            stall_proxy.resume()
