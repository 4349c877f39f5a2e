"""Batches of lease operations (claim_many, renew_many, release_many), run against
every backend (sync and asyncio twins): per-item outcomes, bad input refused
whole, one event per lease."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from pglease import (
    MAX_BATCH,
    Claim,
    InvalidBatchError,
    InvalidOwnerError,
    InvalidResourceIdError,
    InvalidTTLError,
    LeaseExpiredError,
    LeaseLostError,
    Owner,
    UnknownResourceError,
    ValidationError,
)

from ..backends import Backend
from .watching import drain, log_of, watcher

A = Owner("host", "a")
B = Owner("host", "b")
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ids(backend: Backend, n: int, prefix: str = "k") -> list[str]:
    return [backend.store.ensure_resource("run", f"{prefix}{i}") for i in range(n)]


def snapshot(backend: Backend, rids: list[str]) -> list[tuple[int, int, object, int]]:
    """Per resource: revision, generation, owner, number of events."""
    out = []
    for rid in rids:
        state = backend.store.get(rid)
        out.append(
            (
                state.revision,
                state.lease.generation,
                state.lease.owner,
                len(backend.store.events(rid)),
            )
        )
    return out


def test_claim_many_takes_free_leases_and_reports_held_ones(backend: Backend) -> None:
    s = backend.store
    r = ids(backend, 4)
    held = s.claim(r[1], B, 10, now=at(0))
    assert held is not None
    # Input order on purpose not id order: results come back in input order.
    order = [r[3], r[1], r[0], r[2]]
    started = time.monotonic()
    got = s.claim_many(order, A, 10, now=at(1))
    answered = time.monotonic()
    assert [c is None for c in got] == [False, True, False, False]
    for rid, claim in zip(order, got, strict=True):
        if claim is None:
            continue
        assert isinstance(claim, Claim)
        assert claim.resource_id == rid and claim.owner == A and claim.generation == 1
        assert claim.expires_at == at(11)
        # Trusted from the call's start (ClaimOp.started), like a single claim.
        assert started + 10 <= claim.trusted_until <= answered + 10
        state = s.get(rid, now=at(1))
        assert state.lease.owner == A and state.lease.generation == 1
        assert state.revision == claim.revision == 1
        # Each lease its own event with its own revision and generation.
        (event,) = s.events(rid)
        assert (event.type, event.revision, event.lease_generation) == ("lease.claimed", 1, 1)
    tokens = {c.token for c in got if c is not None}
    assert len(tokens) == 3
    assert s.get(r[1], now=at(1)).lease.owner == B
    assert len(s.events(r[1])) == 1  # the held one: no event for the refusal


def test_claim_many_takes_over_expired_leases(backend: Backend) -> None:
    s = backend.store
    r = ids(backend, 2)
    old = s.claim(r[0], B, 5, now=at(0))
    assert old is not None
    got = s.claim_many(r, A, 10, now=at(6))
    assert all(c is not None for c in got)
    first = got[0]
    assert first is not None and first.generation == 2
    types = [(e.type, e.revision, e.lease_generation) for e in s.events(r[0])]
    assert types == [("lease.claimed", 1, 1), ("lease.expired", 2, 1), ("lease.claimed", 3, 2)]
    # The old holder is fenced: per-item lost in a batch too.
    (lost,) = s.renew_many([old], 10, now=at(7))
    assert isinstance(lost, LeaseLostError) and not isinstance(lost, LeaseExpiredError)
    assert "superseded by generation 2" in str(lost)


def test_renew_many_and_release_many_per_item(backend: Backend) -> None:
    s = backend.store
    r = ids(backend, 5)
    claims = s.claim_many(r, A, 10, now=at(0))
    c = [x for x in claims if x is not None]
    assert len(c) == 5
    released = s.release(c[1], now=at(1))  # released: not current
    wrong_token = replace(c[2], token="x" * len(c[2].token))
    expired = s.claim_many([r[3]], B, 1, now=at(20))
    assert expired[0] is not None  # r[3] taken over by B after A's ttl ran out
    b_claim = expired[0]
    renewed = s.renew_many([c[0], c[1], wrong_token, c[3], c[4]], 30, now=at(2))
    ok0, lost1, lost2, lost3, ok4 = renewed
    assert isinstance(ok0, Claim) and ok0.expires_at == at(32) and ok0.revision == 2
    assert isinstance(ok4, Claim) and ok4.expires_at == at(32)
    assert isinstance(lost1, LeaseLostError) and "released" in str(lost1)
    assert isinstance(lost2, LeaseLostError) and "token does not match" in str(lost2)
    assert isinstance(lost3, LeaseLostError) and "superseded" in str(lost3)
    assert s.get(r[0], now=at(2)).revision == 2
    assert s.get(r[1], now=at(2)).revision == released
    # Expired (not taken over): a renew says so, a release still works.
    late = s.renew_many([b_claim], 5, now=at(30))
    assert isinstance(late[0], LeaseExpiredError)
    out = s.release_many([ok0, b_claim, c[1], ok4], now=at(31))
    assert isinstance(out[0], int) and out[0] == 3
    assert isinstance(out[1], int)
    assert isinstance(out[2], LeaseLostError)
    assert isinstance(out[3], int)
    for rid in (r[0], r[3], r[4]):
        state = s.get(rid, now=at(31))
        assert state.lease.owner is None
        assert s.events(rid)[-1].type == "lease.released"


@pytest.mark.parametrize(
    ("shape", "error"),
    [
        ("empty", InvalidBatchError),
        ("duplicate", InvalidBatchError),
        ("malformed", InvalidResourceIdError),
        ("string", InvalidBatchError),
        ("too many", InvalidBatchError),
    ],
)
def test_bad_batches_change_nothing(backend: Backend, shape: str, error: type) -> None:
    s = backend.store
    r = ids(backend, 2)
    held = s.claim(r[0], B, 10, now=at(0))
    assert held is not None
    rids: list[str] = {
        "empty": [],
        "duplicate": [r[1], r[0], r[1]],
        "malformed": [r[1], "not-an-id"],
        "too many": [r[1]] * (MAX_BATCH + 1),
    }.get(shape, [])
    before = snapshot(backend, r)
    claims = [replace(held, resource_id=rid) for rid in rids]
    with pytest.raises(error):
        s.claim_many(r[0] if shape == "string" else rids, A, 10, now=at(1))
    with pytest.raises(error):
        s.release_many(held if shape == "string" else claims, now=at(1))
    with pytest.raises(error):
        s.renew_many(held if shape == "string" else claims, 10, now=at(1))
    assert snapshot(backend, r) == before


def test_bad_owner_ttl_or_unknown_resource_refuse_the_whole_batch(backend: Backend) -> None:
    s = backend.store
    r = ids(backend, 3)
    before = snapshot(backend, r)
    with pytest.raises(InvalidTTLError):
        s.claim_many(r, A, 0, now=at(0))
    with pytest.raises(ValidationError):
        s.claim_many(r, "host:a", 10, now=at(0))  # type: ignore[arg-type]
    # An unknown resource last in id order: the items before it were claimed
    # in the transaction, and are rolled back with it.
    unknown = "run-" + "f" * 40
    with pytest.raises(UnknownResourceError):
        s.claim_many([*r, unknown], A, 10, now=at(0))
    assert snapshot(backend, r) == before
    claims = [c for c in s.claim_many(r, A, 10, now=at(0)) if c is not None]
    before = snapshot(backend, r)
    with pytest.raises(InvalidOwnerError):
        s.renew_many([claims[0], replace(claims[1], owner=Owner("Bad Type", "x"))], 10)
    with pytest.raises(UnknownResourceError):
        s.release_many([*claims, replace(claims[0], resource_id=unknown)], now=at(1))
    with pytest.raises(UnknownResourceError):
        s.renew_many([*claims, replace(claims[0], resource_id=unknown)], 10, now=at(1))
    assert snapshot(backend, r) == before


def test_batch_events_reach_the_log_and_generations_rise(backend: Backend) -> None:
    s = backend.store
    r = ids(backend, 3)
    start = s.events_after(None)
    cursor = start[-1].cursor if start else None
    generations: dict[str, list[int]] = {rid: [] for rid in r}
    for round_ in range(3):
        t = round_ * 10
        claims = s.claim_many(list(reversed(r)), A, 5, now=at(t))
        for claim in claims:
            assert claim is not None
            generations[claim.resource_id].append(claim.generation)
        assert all(isinstance(x, int) for x in s.release_many(claims, now=at(t + 1)))  # type: ignore[arg-type]
    for gens in generations.values():
        assert gens == sorted(set(gens)) and len(gens) == 3
    events = s.events_after(cursor)
    assert len(events) == 3 * 3 * 2
    for rid in r:
        mine = [e for e in events if e.resource_id == rid]
        assert [e.revision for e in mine] == list(range(1, 7))
        assert [e.type for e in mine] == ["lease.claimed", "lease.released"] * 3


def test_watchers_see_every_batch_event_once_in_order(backend: Backend) -> None:
    s = backend.store
    r = ids(backend, 4, "w")
    with watcher(backend) as w:
        claims = s.claim_many(list(reversed(r)), A, 5)
        assert all(c is not None for c in claims)
        renewed = s.renew_many(claims, 5)  # type: ignore[arg-type]
        assert all(isinstance(c, Claim) for c in renewed)
        released = s.release_many(renewed)  # type: ignore[arg-type]
        assert all(isinstance(x, int) for x in released)
        expected = log_of(backend)
        assert len(expected) == 12
        got = drain(w, len(expected))
        assert got == expected
        for rid in r:
            mine = [(e.type, e.revision) for e in got if e.resource_id == rid]
            assert mine == [("lease.claimed", 1), ("lease.renewed", 2), ("lease.released", 3)]


def test_renew_many_just_before_expiry_renews(backend: Backend) -> None:
    """A lease within a second of its expiry is renewed all the same (on
    PostgreSQL such an item runs in its own subtransaction, as it might fail)."""
    s = backend.store
    r = ids(backend, 2, "e")
    claims = s.claim_many(r, A, 10, now=at(0))
    renewed = s.renew_many(claims, 10, now=at(9.5))  # type: ignore[arg-type]
    assert all(isinstance(c, Claim) and c.expires_at == at(19.5) for c in renewed)
    late = s.renew_many(renewed, 10, now=at(19.5))  # type: ignore[arg-type]
    assert all(isinstance(x, LeaseExpiredError) for x in late)
    assert [s.get(rid).revision for rid in r] == [2, 2]
