"""The store driver protocol itself: every driver, both flavours, given the same
parameter objects, gives the same answers and raises the same errors.

The drivers are driven directly (no store above them), so what is checked is
the protocol of `pglease.driver.store`: the parameters in `pglease.driver.ops`
in, the library's result types or a `PgleaseError` out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from pglease import (
    Claim,
    LeaseLostError,
    Owner,
    Permit,
    PgleaseError,
    StaleResourceError,
    StoreClosedError,
    UnknownResourceError,
    resource_id,
)
from pglease.cursors import parse_cursor
from pglease.driver import AsyncStoreDriver, StoreDriver
from pglease.driver.ops import (
    ClaimOp,
    EnsureOp,
    EventsOp,
    GetOp,
    ListOp,
    MutateOp,
    ReadLogOp,
    ReleaseOp,
    RenewOp,
)
from pglease.ids import new_token, token_hash
from pglease.postgres._core import Limits
from pglease.postgres._driver import PgDriver
from pglease.postgres._driver_async import AsyncPgDriver
from pglease.sqlite._driver import SqliteDriver
from pglease.sqlite._driver_async import AsyncSqliteDriver

from ..conftest import enable_test_clock

A = Owner("host", "a")
B = Owner("host", "b")
T0 = datetime(2030, 1, 1, tzinfo=UTC)
DRIVERS = ["postgres", "postgres-async", "sqlite", "sqlite-async"]

#: Runs one driver operation by name and returns its result (an asyncio
#: driver's coroutine runs to completion on the test's own loop).
Call = Callable[..., Any]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def claim_op(rid: str, owner: Owner, seconds: float, token: str) -> ClaimOp:
    return ClaimOp(rid, owner, token, token_hash(token), 30.0, None, at(seconds))


@pytest.fixture(params=DRIVERS)
def call(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Call]:
    name: str = request.param
    driver: StoreDriver[Any] | AsyncStoreDriver[Any]
    if name.startswith("postgres"):
        dsn, schema = request.getfixturevalue("pg_dsn"), request.getfixturevalue("schema")
        kind = AsyncPgDriver if name.endswith("-async") else PgDriver
        limits = Limits.of(30.0, 10.0, 30.0, 2)
        driver = kind(dsn, schema, False, 10.0, limits, min_size=1, auto_migrate=True)
    else:
        kind_s = AsyncSqliteDriver if name.endswith("-async") else SqliteDriver
        driver = kind_s(str(tmp_path / "store.db"), 5.0, True)
    if name.endswith("-async"):
        loop = asyncio.new_event_loop()

        def run(op: str, *args: Any) -> Any:
            return loop.run_until_complete(getattr(driver, op)(*args))

    else:
        loop = None

        def run(op: str, *args: Any) -> Any:
            return getattr(driver, op)(*args)

    run("open")
    if name.startswith("postgres"):
        enable_test_clock(dsn, schema)
    try:
        yield run
    finally:
        run("close")
        if loop is not None:
            loop.close()


def history(call: Call) -> list[object]:
    """One fixed sequence of operations; what every driver must answer alike."""
    rid = call("ensure_resource", EnsureOp("run", "r1"))
    assert rid == resource_id("run", "r1")
    assert call("ensure_resource", EnsureOp("run", "r1")) == rid  # idempotent, silent
    token_a, token_b = new_token(), new_token()
    first: Claim = call("claim", claim_op(rid, A, 0, token_a))
    assert (first.owner, first.token, first.generation, first.revision) == (A, token_a, 1, 1)
    assert first.expires_at == at(30)
    assert call("claim", claim_op(rid, B, 10, token_b)) is None  # A's lease is live
    renewed: Claim = call(
        "renew", RenewOp(first, token_hash(token_a), 60.0, first.revision, at(20))
    )
    assert (renewed.expires_at, renewed.revision) == (at(80), 2)
    # B takes over after A's expiry: the claim records A's expiry first.
    second: Claim = call("claim", claim_op(rid, B, 81, token_b))
    assert (second.generation, second.revision) == (2, 4)
    mutation = call(
        "mutate",
        MutateOp(Permit(rid, 4, second), "note", token_hash(token_b), None, '{"n":1}', at(82)),
        None,
    )
    assert (mutation.resource_id, mutation.revision, mutation.value) == (rid, 5, None)
    assert call("release", ReleaseOp(second, token_hash(token_b), 5, at(83))) == 6
    state = call("get", GetOp(rid, at(84)))
    assert state.lease.owner is None and not state.lease.held
    listed = call("list_resources", ListOp("run", at(84)))
    assert [s.id for s in listed] == [rid] and call("list_resources", ListOp("nope", None)) == []
    events = call("events", EventsOp(rid, 0, 100))
    log = call("read_log", ReadLogOp(parse_cursor(None), 100))
    assert [e.id for e in log] == [e.id for e in events]
    after = call("read_log", ReadLogOp(parse_cursor(events[2].cursor), 2))
    assert [e.revision for e in after] == [4, 5]
    return [
        (state.revision, state.lease.generation),
        [(e.revision, e.type, e.actor, e.lease_generation, e.payload) for e in events],
    ]


EXPECTED = [
    (6, 2),
    [
        (1, "lease.claimed", A, 1, None),
        (2, "lease.renewed", A, 1, None),
        (3, "lease.expired", A, 1, None),
        (4, "lease.claimed", B, 2, None),
        (5, "note", B, 2, {"n": 1}),
        (6, "lease.released", B, 2, None),
    ],
]


def test_every_driver_answers_the_same_history(call: Call) -> None:
    assert history(call) == EXPECTED


def test_every_driver_raises_the_same_errors_and_changes_nothing(call: Call) -> None:
    rid = call("ensure_resource", EnsureOp("run", "r2"))
    token = new_token()
    claim: Claim = call("claim", claim_op(rid, A, 0, token))
    missing = resource_id("run", "never-made")
    with pytest.raises(UnknownResourceError, match="unknown resource"):
        call("get", GetOp(missing, None))
    with pytest.raises(UnknownResourceError, match="unknown resource"):
        call("events", EventsOp(missing, 0, 10))
    with pytest.raises(UnknownResourceError, match="unknown resource"):
        call("claim", claim_op(missing, A, 0, new_token()))
    with pytest.raises(StaleResourceError):
        call("renew", RenewOp(claim, token_hash(token), 30.0, claim.revision + 7, at(1)))
    wrong = token_hash(new_token())
    with pytest.raises(LeaseLostError):
        call("release", ReleaseOp(claim, wrong, None, at(1)))
    with pytest.raises(StaleResourceError):
        call("mutate", MutateOp(Permit(rid, 0), "note", None, None, None, at(1)), None)
    # Nothing above changed the resource: still the one claim.
    state = call("get", GetOp(rid, at(1)))
    assert (state.revision, state.lease.generation, state.lease.owner) == (1, 1, A)
    assert [e.type for e in call("events", EventsOp(rid, 0, 10))] == ["lease.claimed"]


def test_a_closed_driver_refuses_calls_with_a_pglease_error(call: Call) -> None:
    rid = call("ensure_resource", EnsureOp("run", "r3"))
    call("close")
    call("close")  # closing twice is harmless
    with pytest.raises(PgleaseError) as caught:
        call("get", GetOp(rid, None))
    assert isinstance(caught.value, StoreClosedError)
