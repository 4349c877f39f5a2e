"""The server stops and starts again (issue 31 item 6), for real: a throwaway
PostgreSQL of the test's own (tests/_pgserver.py), stopped with `pg_ctl stop`
and started again on the same port; no proxy in between.

While it is down every call fails with DatabaseUnavailableError within
`connect_timeout` (not `PoolExhaustedError` after `pool_timeout`); once it
accepts connections again the first call succeeds at once, and a holder that
claimed before the outage renews, reads and releases its lease.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pglease import (
    AsyncPostgresStore,
    DatabaseUnavailableError,
    Owner,
    PoolExhaustedError,
    PostgresStore,
)

from . import _pgserver

#: Long enough for psycopg-pool's own reconnect back-off (1, 2, 4, 8 s ...) to
#: grow past the outage's end: uncapped, its next attempt would come seconds
#: after the server is back.
_OUTAGE = 8.5
_CONNECT_TIMEOUT = 2.0
#: Far above connect_timeout: a call that waited for the pool would show.
_POOL_TIMEOUT = 30.0
#: Generous bounds for a busy 2-core machine.
_FAIL_WITHIN = _CONNECT_TIMEOUT + 4.0
_BACK_WITHIN = 5.0
#: Outlives the outage: the holder's lease is still its own afterwards.
_TTL = 120.0


@pytest.fixture(scope="module")
def server() -> Iterator[_pgserver.Server]:
    if (why := _pgserver.skip_reason()) is not None:
        pytest.skip(why)
    with _pgserver.server() as srv:
        yield srv


def _options() -> dict[str, Any]:
    return {"schema": f"t_{uuid.uuid4().hex[:12]}", "min_size": 2, "max_size": 2,
            "connect_timeout": _CONNECT_TIMEOUT, "pool_timeout": _POOL_TIMEOUT}  # fmt: skip


def _check_down(error: DatabaseUnavailableError, took: float) -> None:
    assert not isinstance(error, PoolExhaustedError), error
    assert took < _FAIL_WITHIN, (took, error)
    assert "127.0.0.1" in str(error) and "refused" in str(error), error


def test_sync_a_stopped_server_fails_fast_and_a_restarted_one_serves_at_once(
    server: _pgserver.Server,
) -> None:
    with PostgresStore(server.dsn, **_options()) as store:
        rid = store.ensure_resource("job", "restart")
        holder = Owner("host", "holder")
        claim = store.claim(rid, holder, ttl=_TTL)
        assert claim is not None
        server.stop()
        down = time.monotonic()
        calls = [
            lambda: store.get(rid),
            lambda: store.claim(rid, Owner("host", "rival"), ttl=_TTL),
            lambda: store.renew(claim, ttl=_TTL),
        ]
        n = 0
        while n < len(calls) or time.monotonic() - down < _OUTAGE:
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError) as caught:
                calls[n % len(calls)]()
            _check_down(caught.value, time.monotonic() - started)
            n += 1
            time.sleep(0.5)
        server.start()
        back = time.monotonic()
        state = store.get(rid)
        assert time.monotonic() - back < _BACK_WITHIN
        assert state.lease.held and state.lease.owner == holder
        claim = store.renew(claim, ttl=_TTL)
        assert store.claim(rid, Owner("host", "rival"), ttl=_TTL) is None  # still the holder's
        store.release(claim)
        assert store.claim(rid, Owner("host", "next"), ttl=_TTL) is not None


async def test_async_a_stopped_server_fails_fast_and_a_restarted_one_serves_at_once(
    server: _pgserver.Server,
) -> None:
    async with await AsyncPostgresStore.open(server.dsn, **_options()) as store:
        rid = await store.ensure_resource("job", "restart")
        holder = Owner("host", "holder")
        claim = await store.claim(rid, holder, ttl=_TTL)
        assert claim is not None
        await asyncio.to_thread(server.stop)
        down = time.monotonic()
        calls = [
            lambda: store.get(rid),
            lambda: store.claim(rid, Owner("host", "rival"), ttl=_TTL),
            lambda: store.renew(claim, ttl=_TTL),
        ]
        n = 0
        while n < len(calls) or time.monotonic() - down < _OUTAGE:
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError) as caught:
                await calls[n % len(calls)]()
            _check_down(caught.value, time.monotonic() - started)
            n += 1
            await asyncio.sleep(0.5)
        await asyncio.to_thread(server.start)
        back = time.monotonic()
        state = await store.get(rid)
        assert time.monotonic() - back < _BACK_WITHIN
        assert state.lease.held and state.lease.owner == holder
        claim = await store.renew(claim, ttl=_TTL)
        assert await store.claim(rid, Owner("host", "rival"), ttl=_TTL) is None
        await store.release(claim)
        assert await store.claim(rid, Owner("host", "next"), ttl=_TTL) is not None
