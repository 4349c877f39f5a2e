"""Lease store semantics, run against every backend (sync and asyncio twins)."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pglease import (
    Claim,
    InvalidEventTypeError,
    InvalidKeyError,
    InvalidOwnerError,
    InvalidPayloadError,
    InvalidResourceIdError,
    InvalidResourceTypeError,
    InvalidRevisionError,
    InvalidTokenError,
    InvalidTTLError,
    LeaseExpiredError,
    LeaseLostError,
    LeaseMismatchError,
    Owner,
    PayloadTooLargeError,
    Permit,
    ResourceLeasedError,
    StaleResourceError,
    UnknownResourceError,
    ValidationError,
    resource_id,
)
from pglease.payloads import MAX_PAYLOAD_BYTES

from ..backends import Backend

A = Owner("host", "a")
B = Owner("host", "b")
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def snapshot(b: Backend, rid: str) -> tuple[int, int, int]:
    """(revision, generation, number of events): what a refused call must not change."""
    state = b.store.get(rid)
    return state.revision, state.lease.generation, len(b.store.events(rid))


@pytest.fixture
def rid(backend: Backend) -> str:
    return str(backend.store.ensure_resource("run", "r1"))


# --- resources -------------------------------------------------------------------


def test_ensure_resource_is_deterministic_idempotent_and_silent(backend: Backend) -> None:
    s = backend.store
    first = s.ensure_resource("session", "key with spaces/and:colons")
    assert first == resource_id("session", "key with spaces/and:colons")
    assert s.ensure_resource("session", "key with spaces/and:colons") == first
    state = s.get(first)
    assert (state.type, state.key, state.revision) == ("session", "key with spaces/and:colons", 0)
    assert state.lease.generation == 0 and state.lease.owner is None and not state.lease.held
    assert s.events(first) == []


@pytest.mark.parametrize(
    "rtype",
    [
        "run",
        "session",
        "decision",
        "controller",
        "effect",
        "channel",
        "notification",
        "turn_intent",
    ],
)
def test_pi_workflows_resource_types_work(backend: Backend, rtype: str) -> None:
    rid = backend.store.ensure_resource(rtype, "k")
    assert rid.startswith(rtype + "-")


@pytest.mark.parametrize("otype", ["session", "host", "controller", "channel", "system"])
def test_pi_workflows_owner_types_work(backend: Backend, rid: str, otype: str) -> None:
    claim = backend.store.claim(rid, Owner(otype, "x:1"), 5)
    assert claim is not None and claim.owner.type == otype


@pytest.mark.parametrize("rtype", ["", "Run", "1run", "run-x", "run.x", "a" * 64, None, 5])
def test_bad_resource_types_are_refused(backend: Backend, rtype: Any) -> None:
    with pytest.raises(InvalidResourceTypeError):
        backend.store.ensure_resource(rtype, "k")
    assert backend.store.list_resources() == []


@pytest.mark.parametrize("key", ["", "a\x00b", "x" * 1025, "\udc80", None, 7])
def test_bad_keys_are_refused(backend: Backend, key: Any) -> None:
    with pytest.raises(InvalidKeyError):
        backend.store.ensure_resource("run", key)
    assert backend.store.list_resources() == []


def test_unknown_resource_is_reported_everywhere(backend: Backend) -> None:
    s = backend.store
    ghost = resource_id("run", "ghost")
    with pytest.raises(UnknownResourceError):
        s.claim(ghost, A, 5)
    with pytest.raises(UnknownResourceError):
        s.get(ghost)
    with pytest.raises(UnknownResourceError):
        s.events(ghost)
    with pytest.raises(UnknownResourceError):
        s.mutate(Permit(ghost, 0), "run.started")
    fake = Claim(ghost, A, "A" * 43, 1, T0, 1)
    with pytest.raises(UnknownResourceError):
        s.renew(fake, 5)
    with pytest.raises(UnknownResourceError):
        s.release(fake)


@pytest.mark.parametrize("bad", ["run", "run-xyz", "Run-" + "0" * 40, "run-" + "0" * 39, 3])
def test_malformed_resource_ids_are_refused(backend: Backend, bad: Any) -> None:
    with pytest.raises(InvalidResourceIdError):
        backend.store.claim(bad, A, 5)


# --- claim / renew / release --------------------------------------------------------


def test_claim_grants_generation_and_bumps_revision(backend: Backend, rid: str) -> None:
    s = backend.store
    claim = s.claim(rid, A, 30)
    assert claim is not None
    assert (claim.resource_id, claim.owner, claim.generation, claim.revision) == (rid, A, 1, 1)
    assert len(claim.token) == 43
    state = s.get(rid)
    assert state.revision == 1 and state.lease.owner == A and state.lease.held
    assert state.lease.expires_at == claim.expires_at
    [event] = s.events(rid)
    assert (event.type, event.revision, event.actor, event.lease_generation) == (
        "lease.claimed",
        1,
        A,
        1,
    )
    assert event.lease_expires_at == claim.expires_at


def test_claim_returns_none_while_held_and_changes_nothing(backend: Backend, rid: str) -> None:
    s = backend.store
    assert s.claim(rid, A, 30) is not None
    before = snapshot(backend, rid)
    assert s.claim(rid, B, 30) is None
    assert s.claim(rid, A, 30) is None  # the holder renews, it does not re-claim
    assert snapshot(backend, rid) == before


def test_takeover_after_expiry_fences_the_stale_owner(backend: Backend, rid: str) -> None:
    s = backend.store
    old = s.claim(rid, A, 10, now=at(0))
    assert old is not None
    assert s.claim(rid, B, 10, now=at(9.999)) is None
    new = s.claim(rid, B, 10, now=at(10))
    # Revision 2 is the old generation's `lease.expired`, written by the takeover.
    assert new is not None and new.generation == 2 and new.revision == 3
    before = snapshot(backend, rid)
    superseded = "is no longer current: superseded by generation 2$"
    with pytest.raises(LeaseLostError, match=superseded):
        s.renew(old, 10, now=at(11))
    with pytest.raises(LeaseLostError, match=superseded):
        s.release(old, now=at(11))
    with pytest.raises(LeaseLostError, match=superseded):
        s.mutate(Permit(rid, new.revision, old), "run.step", now=at(11))
    assert snapshot(backend, rid) == before
    assert s.get(rid, now=at(11)).lease.owner == B


def test_takeover_of_expired_lease_records_its_expiry_first(backend: Backend, rid: str) -> None:
    s = backend.store
    old = s.claim(rid, A, 10, now=at(0))
    assert old is not None
    new = s.claim(rid, B, 10, now=at(12))
    assert new is not None and (new.generation, new.revision) == (2, 3)
    assert s.get(rid, now=at(12)).revision == 3
    events = s.events(rid)
    assert [
        (e.type, e.revision, e.actor, e.lease_generation, e.lease_expires_at) for e in events
    ] == [
        ("lease.claimed", 1, A, 1, at(10)),
        ("lease.expired", 2, A, 1, at(10)),  # the old holder, its generation and expiry
        ("lease.claimed", 3, B, 2, at(22)),
    ]
    # The claim's revision is its own event's; a fenced write with it works.
    assert s.mutate(Permit(rid, new.revision, new), "run.step", now=at(13)).revision == 4
    # An expired holder re-claiming is a takeover too: its old generation expired.
    again = s.claim(rid, B, 10, now=at(40))
    assert again is not None and (again.generation, again.revision) == (3, 6)
    assert [e.type for e in s.events(rid, after_revision=4)] == [
        "lease.expired",
        "lease.claimed",
    ]


def test_claim_after_release_or_refused_writes_no_expired_event(backend: Backend, rid: str) -> None:
    s = backend.store
    first = s.claim(rid, A, 10, now=at(0))
    assert first is not None
    s.release(first, now=at(50))  # released after its expiry: no longer a holder
    assert s.claim(rid, B, 10, now=at(60)) is not None
    assert s.claim(rid, A, 10, now=at(65)) is None  # refused: B is live
    assert [e.type for e in s.events(rid)] == [
        "lease.claimed",
        "lease.released",
        "lease.claimed",
    ]


def test_renew_extends_and_bumps_revision(backend: Backend, rid: str) -> None:
    s = backend.store
    claim = s.claim(rid, A, 10, now=at(0))
    assert claim is not None
    renewed = s.renew(claim, 20, now=at(5))
    assert renewed.expires_at == at(25) and renewed.revision == 2
    assert renewed.generation == claim.generation and renewed.token == claim.token
    assert [e.type for e in s.events(rid)] == ["lease.claimed", "lease.renewed"]
    assert s.claim(rid, B, 10, now=at(24)) is None


def test_renew_of_expired_lease_is_refused(backend: Backend, rid: str) -> None:
    s = backend.store
    claim = s.claim(rid, A, 10, now=at(0))
    assert claim is not None
    before = snapshot(backend, rid)
    with pytest.raises(LeaseExpiredError):
        s.renew(claim, 10, now=at(10))
    assert snapshot(backend, rid) == before


def test_release_keeps_generation_and_works_after_expiry(backend: Backend, rid: str) -> None:
    s = backend.store
    claim = s.claim(rid, A, 10, now=at(0))
    assert claim is not None
    assert s.release(claim, now=at(50)) == 2
    state = s.get(rid, now=at(50))
    assert state.lease.owner is None and state.lease.generation == 1 and not state.lease.held
    with pytest.raises(LeaseLostError):
        s.release(claim, now=at(51))
    again = s.claim(rid, B, 10, now=at(52))
    assert again is not None and again.generation == 2


def test_wrong_token_is_not_current(backend: Backend, rid: str) -> None:
    s = backend.store
    claim = s.claim(rid, A, 30)
    assert claim is not None
    forged = replace(claim, token="B" * 43 if claim.token != "B" * 43 else "C" * 43)
    before = snapshot(backend, rid)
    # The message names the real reason, the same on both backends.
    token = "is no longer current: the token does not match the holder's$"
    with pytest.raises(LeaseLostError, match=f"^lease generation 1 of host:a on {rid} {token}"):
        s.renew(forged, 30)
    with pytest.raises(LeaseLostError, match=token):
        s.release(forged)
    owner = r"of host:b on .* the owner does not match \(it is held by host:a\)$"
    with pytest.raises(LeaseLostError, match=owner):
        s.renew(replace(claim, owner=B), 30)
    with pytest.raises(LeaseLostError, match=owner):
        s.release(replace(claim, owner=B))
    ahead = r"there is no such generation yet \(current generation 1\)$"
    with pytest.raises(LeaseLostError, match=ahead):
        s.release(replace(claim, generation=2))
    assert snapshot(backend, rid) == before
    assert s.release(claim) is not None
    with pytest.raises(LeaseLostError, match=r"is no longer current: it was released$"):
        s.release(claim)
    with pytest.raises(LeaseLostError, match=r"is no longer current: it was released$"):
        s.renew(claim, 30)


@pytest.mark.parametrize("token", ["", "short", "x" * 44, "!" * 43, None])
def test_malformed_tokens_are_refused(backend: Backend, rid: str, token: Any) -> None:
    s = backend.store
    claim = s.claim(rid, A, 30)
    assert claim is not None
    before = snapshot(backend, rid)
    with pytest.raises(InvalidTokenError):
        s.renew(replace(claim, token=token), 30)
    with pytest.raises(InvalidTokenError):
        s.release(replace(claim, token=token))
    assert snapshot(backend, rid) == before


@pytest.mark.parametrize(
    "ttl", [0, -1, math.nan, math.inf, -math.inf, 1e12, 0.0001, "5", True, None]
)
def test_bad_ttls_are_refused(backend: Backend, rid: str, ttl: Any) -> None:
    s = backend.store
    with pytest.raises(InvalidTTLError):
        s.claim(rid, A, ttl)
    claim = s.claim(rid, A, 30)
    assert claim is not None
    before = snapshot(backend, rid)
    with pytest.raises(InvalidTTLError):
        s.renew(claim, ttl)
    assert snapshot(backend, rid) == before


@pytest.mark.parametrize(
    "make_owner",
    [
        lambda: Owner("Host", "a"),
        lambda: Owner("host", ""),
        lambda: Owner("host", "a\x00"),
        lambda: Owner("host", "x" * 257),
        lambda: Owner.parse("hostonly"),
    ],
)
def test_bad_owners_are_refused(make_owner: Any) -> None:
    with pytest.raises(InvalidOwnerError):
        make_owner()


def test_owner_parse_keeps_colons_in_id() -> None:
    assert Owner.parse("session:abc:def") == Owner("session", "abc:def")
    assert str(Owner("host", "h1")) == "host:h1"


def test_expected_revision_is_checked_everywhere(backend: Backend, rid: str) -> None:
    s = backend.store
    with pytest.raises(StaleResourceError) as info:
        s.claim(rid, A, 30, expected_revision=5)
    assert info.value.actual == 0
    claim = s.claim(rid, A, 30, expected_revision=0)
    assert claim is not None
    before = snapshot(backend, rid)
    with pytest.raises(StaleResourceError):
        s.renew(claim, 30, expected_revision=0)
    with pytest.raises(StaleResourceError):
        s.release(claim, expected_revision=7)
    with pytest.raises(StaleResourceError):
        s.mutate(Permit(rid, 0, claim), "run.step")
    assert snapshot(backend, rid) == before
    claim = s.renew(claim, 30, expected_revision=1)
    assert s.release(claim, expected_revision=2) == 3


@pytest.mark.parametrize("rev", [-1, 1.5, "1", True])
def test_bad_expected_revisions_are_refused(backend: Backend, rid: str, rev: Any) -> None:
    s = backend.store
    with pytest.raises(InvalidRevisionError):
        s.claim(rid, A, 30, expected_revision=rev)
    with pytest.raises(InvalidRevisionError):
        s.mutate(Permit(rid, rev), "run.step")
    assert snapshot(backend, rid) == (0, 0, 0)


def test_naive_now_is_refused(backend: Backend, rid: str) -> None:
    with pytest.raises(ValidationError):
        backend.store.claim(rid, A, 30, now=datetime(2030, 1, 1))


def test_generations_rise_by_one_per_claim_and_never_reset(backend: Backend, rid: str) -> None:
    s = backend.store
    for expected in range(1, 6):
        claim = s.claim(rid, A if expected % 2 else B, 5, now=at(expected * 10))
        assert claim is not None and claim.generation == expected
        if expected % 2:
            s.release(claim, now=at(expected * 10 + 1))  # others simply expire
    events = s.events(rid)
    assert [e.revision for e in events] == list(range(1, len(events) + 1))
    assert [e.lease_generation for e in events if e.type == "lease.claimed"] == [1, 2, 3, 4, 5]


# --- mutate -----------------------------------------------------------------------


def test_leased_mutation_commits_apply_with_the_event(backend: Backend, rid: str) -> None:
    s = backend.store
    backend.side_table()
    claim = s.claim(rid, A, 30)
    assert claim is not None
    result = s.mutate(
        Permit(rid, claim.revision, claim),
        "run.step",
        backend.insert_apply("v1"),
        {"b": 2, "a": [1, "x"]},
    )
    assert (result.revision, result.value) == (2, "ok")
    assert backend.side_rows() == ["v1"]
    event = s.events(rid)[-1]
    assert (event.type, event.revision, event.actor, event.lease_generation) == (
        "run.step",
        2,
        A,
        1,
    )
    assert event.payload == {"a": [1, "x"], "b": 2}
    assert event.id == result.event_id


def test_unleased_mutation_works_only_while_nobody_holds(backend: Backend, rid: str) -> None:
    s = backend.store
    result = s.mutate(Permit(rid, 0), "run.created", payload={"n": 1}, actor=Owner("system", "x"))
    assert result.revision == 1
    event = s.events(rid)[-1]
    assert event.actor == Owner("system", "x") and event.lease_generation is None
    claim = s.claim(rid, A, 10, now=at(0))
    assert claim is not None
    before = snapshot(backend, rid)
    with pytest.raises(ResourceLeasedError):
        s.mutate(Permit(rid, 2), "run.step", now=at(5))
    assert snapshot(backend, rid) == before
    assert s.mutate(Permit(rid, 2), "run.step", now=at(10)).revision == 3


def test_mutation_with_expired_lease_is_refused(backend: Backend, rid: str) -> None:
    s = backend.store
    claim = s.claim(rid, A, 10, now=at(0))
    assert claim is not None
    with pytest.raises(LeaseExpiredError):
        s.mutate(Permit(rid, 1, claim), "run.step", now=at(10))
    assert snapshot(backend, rid) == (1, 1, 1)


def test_lease_from_another_resource_is_refused(backend: Backend, rid: str) -> None:
    s = backend.store
    other = s.ensure_resource("run", "r2")
    claim = s.claim(other, A, 30)
    assert claim is not None
    with pytest.raises(LeaseMismatchError):
        s.mutate(Permit(rid, 0, claim), "run.step")
    assert snapshot(backend, rid) == (0, 0, 0)


def test_failing_apply_rolls_everything_back(backend: Backend, rid: str) -> None:
    s = backend.store
    backend.side_table()
    claim = s.claim(rid, A, 30)
    assert claim is not None
    before = snapshot(backend, rid)
    payloads_before = backend.payload_count()
    with pytest.raises(RuntimeError, match="on purpose"):
        s.mutate(
            Permit(rid, 1, claim),
            "run.step",
            backend.failing_apply("gone"),
            {"unique": "payload-that-must-not-stay"},
        )
    assert snapshot(backend, rid) == before
    assert backend.side_rows() == []
    assert backend.payload_count() == payloads_before
    # the lease itself is untouched and still usable
    assert s.mutate(Permit(rid, 1, claim), "run.step", backend.insert_apply("kept")).revision == 2
    assert backend.side_rows() == ["kept"]


def test_payloads_are_canonical_and_stored_once(backend: Backend, rid: str) -> None:
    s = backend.store
    s.mutate(Permit(rid, 0), "run.a", payload={"x": 1, "y": [True, None, "é"]})
    s.mutate(Permit(rid, 1), "run.b", payload={"y": [True, None, "é"], "x": 1})
    first, second = s.events(rid)
    assert first.payload == second.payload
    assert first.payload_sha256 == second.payload_sha256 and first.payload_sha256 is not None
    assert backend.payload_count() == 1


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"x": math.nan}, InvalidPayloadError),
        ({"x": math.inf}, InvalidPayloadError),
        ({"x": object()}, InvalidPayloadError),
        ({"x": {1, 2}}, InvalidPayloadError),
        ({"s": "\udc80"}, InvalidPayloadError),
        ({"big": "x" * MAX_PAYLOAD_BYTES}, PayloadTooLargeError),
    ],
)
def test_bad_payloads_are_refused(
    backend: Backend, rid: str, payload: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        backend.store.mutate(Permit(rid, 0), "run.step", payload=payload)
    assert snapshot(backend, rid) == (0, 0, 0)
    assert backend.payload_count() == 0


@pytest.mark.parametrize(
    "etype", ["", "Run.step", "run..step", "run.", "lease.claimed", "lease.custom", "x" * 129, None]
)
def test_bad_event_types_are_refused(backend: Backend, rid: str, etype: Any) -> None:
    with pytest.raises(InvalidEventTypeError):
        backend.store.mutate(Permit(rid, 0), etype)
    assert snapshot(backend, rid) == (0, 0, 0)


# --- reading the log ------------------------------------------------------------------


def test_every_change_has_exactly_one_event(backend: Backend, rid: str) -> None:
    s = backend.store
    claim = s.claim(rid, A, 30)
    assert claim is not None
    claim = s.renew(claim, 30)
    s.mutate(Permit(rid, claim.revision, claim), "run.step")
    s.release(claim)
    events = s.events(rid)
    assert [(e.revision, e.type) for e in events] == [
        (1, "lease.claimed"),
        (2, "lease.renewed"),
        (3, "run.step"),
        (4, "lease.released"),
    ]
    assert s.get(rid).revision == 4
    assert [e.revision for e in s.events(rid, after_revision=2)] == [3, 4]
    assert [e.revision for e in s.events(rid, limit=1)] == [1]


def test_events_after_pages_through_the_whole_log(backend: Backend) -> None:
    s = backend.store
    rids = [s.ensure_resource("run", f"k{i}") for i in range(3)]
    for i in range(4):
        for r in rids:
            s.mutate(Permit(r, i), "run.step", payload={"i": i})
    seen = []
    cursor = None
    while page := s.events_after(cursor, limit=5):
        seen.extend(page)
        cursor = page[-1].cursor
    assert len(seen) == 12 and len({e.id for e in seen}) == 12
    for r in rids:
        assert [e.revision for e in seen if e.resource_id == r] == [1, 2, 3, 4]
    assert s.events_after(cursor) == []
    assert [e.id for e in s.events_after("start")] == [e.id for e in seen]


def test_list_resources_shows_holders(backend: Backend) -> None:
    s = backend.store
    r1 = s.ensure_resource("run", "a")
    s.ensure_resource("run", "b")
    s.ensure_resource("session", "c")
    assert s.claim(r1, A, 30) is not None
    runs = s.list_resources("run")
    assert [(r.key, r.lease.owner) for r in runs] == [("a", A), ("b", None)]
    assert len(s.list_resources()) == 3
    with pytest.raises(InvalidResourceTypeError):
        s.list_resources("Bad")


def test_every_timestamp_is_in_utc_with_one_tzinfo(backend: Backend, rid: str) -> None:
    """`claim` and `get` (and the log) return the same instant with the same
    tzinfo, `datetime.UTC`, on every backend and flavour."""
    s = backend.store
    claim = s.claim(rid, A, 30)
    assert claim is not None
    state = s.get(rid)
    assert state.lease.expires_at == claim.expires_at
    [event] = s.events(rid)
    for when in (claim.expires_at, state.lease.expires_at, event.created_at):
        assert when is not None and when.tzinfo is UTC
    renewed = s.renew(claim, 30)
    assert renewed.expires_at.tzinfo is UTC
