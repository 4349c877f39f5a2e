"""Backend-neutral pieces every store shares: argument checks, argument lists, row parsing.

Each store turns the argument lists built here into its own statements, so
validation happens once, before anything reaches a database, and identically
for every backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from .cursors import Position, encode_cursor, fingerprint, parse_cursor
from .driver import ops
from .errors import InvalidBatchError, InvalidOwnerError, LeaseMismatchError, ValidationError
from .ids import new_token, token_hash
from .payloads import canonical_payload, decode_payload
from .types import Claim, Event, LeaseState, Owner, Permit, ResourceState
from .validation import (
    MAX_BATCH,
    check_event_type,
    check_key,
    check_optional_revision,
    check_resource_id,
    check_resource_type,
    check_revision,
    check_token,
    check_ttl,
)

MAX_EVENT_PAGE = 10_000


def check_now(now: datetime | None) -> datetime | None:
    if now is not None and (not isinstance(now, datetime) or now.tzinfo is None):
        raise ValidationError("now must be a timezone-aware datetime")
    return now


def check_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_EVENT_PAGE:
        raise ValidationError(f"limit must be an int between 1 and {MAX_EVENT_PAGE}")
    return limit


def ensure_op(resource_type: str, key: str) -> ops.EnsureOp:
    return ops.EnsureOp(check_resource_type(resource_type), check_key(key))


def claim_op(
    resource_id: str,
    owner: Owner,
    ttl: float,
    expected_revision: int | None,
    now: datetime | None,
) -> ops.ClaimOp:
    """The checked claim, with a fresh token and its sha256."""
    check_resource_id(resource_id)
    if not isinstance(owner, Owner):
        raise ValidationError(f"owner must be an Owner, got {type(owner).__name__}")
    token = new_token()
    return ops.ClaimOp(
        resource_id,
        owner,
        token,
        token_hash(token),
        check_ttl(ttl),
        check_optional_revision(expected_revision),
        check_now(now),
    )


def check_claim(claim: Claim) -> Claim:
    if not isinstance(claim, Claim):
        raise ValidationError(f"expected a Claim, got {type(claim).__name__}")
    check_resource_id(claim.resource_id)
    # Claims are plain dataclasses: `replace(claim, owner=...)` can smuggle in anything.
    if not isinstance(claim.owner, Owner):
        raise ValidationError(f"claim owner must be an Owner, got {type(claim.owner).__name__}")
    check_token(claim.token)
    check_revision(claim.generation, "generation")
    return claim


def renew_op(
    claim: Claim, ttl: float, expected_revision: int | None, now: datetime | None
) -> ops.RenewOp:
    check_claim(claim)
    return ops.RenewOp(
        claim,
        token_hash(claim.token),
        check_ttl(ttl),
        check_optional_revision(expected_revision),
        check_now(now),
    )


def release_op(claim: Claim, expected_revision: int | None, now: datetime | None) -> ops.ReleaseOp:
    check_claim(claim)
    return ops.ReleaseOp(
        claim, token_hash(claim.token), check_optional_revision(expected_revision), check_now(now)
    )


def _batch(what: str, items: Iterable[Any]) -> tuple[Any, ...]:
    """The batch's items as a tuple: 1 to MAX_BATCH of them (a str is refused,
    though it is a sequence: it would be a batch of its characters)."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise InvalidBatchError(f"{what} takes a sequence, got {type(items).__name__}")
    batch = tuple(items)
    if not 1 <= len(batch) <= MAX_BATCH:
        raise InvalidBatchError(f"{what} takes 1 to {MAX_BATCH} leases, got {len(batch)}")
    return batch


def _distinct(what: str, resource_ids: Sequence[str]) -> None:
    seen: set[str] = set()
    for rid in resource_ids:
        if rid in seen:
            raise InvalidBatchError(f"{what} names resource {rid} more than once")
        seen.add(rid)


def claim_many_op(
    resource_ids: Iterable[str], owner: Owner, ttl: float, now: datetime | None
) -> ops.ClaimManyOp:
    """The checked batch of claims, with a fresh token and its sha256 per item."""
    rids = _batch("claim_many", resource_ids)
    for rid in rids:
        check_resource_id(rid)
    _distinct("claim_many", rids)
    if not isinstance(owner, Owner):
        raise ValidationError(f"owner must be an Owner, got {type(owner).__name__}")
    tokens = tuple(new_token() for _ in rids)
    return ops.ClaimManyOp(
        rids,
        owner,
        tokens,
        tuple(token_hash(t) for t in tokens),
        check_ttl(ttl),
        check_now(now),
    )


def _claims(what: str, claims: Iterable[Claim]) -> tuple[Claim, ...]:
    batch: tuple[Claim, ...] = _batch(what, claims)
    for claim in batch:
        check_claim(claim)
    _distinct(what, [c.resource_id for c in batch])
    return batch


def renew_many_op(claims: Iterable[Claim], ttl: float, now: datetime | None) -> ops.RenewManyOp:
    batch = _claims("renew_many", claims)
    return ops.RenewManyOp(
        batch, tuple(token_hash(c.token) for c in batch), check_ttl(ttl), check_now(now)
    )


def release_many_op(claims: Iterable[Claim], now: datetime | None) -> ops.ReleaseManyOp:
    batch = _claims("release_many", claims)
    return ops.ReleaseManyOp(batch, tuple(token_hash(c.token) for c in batch), check_now(now))


def mutate_op(
    permit: Permit,
    event_type: str,
    payload: Any,
    actor: Owner | None,
    now: datetime | None,
) -> ops.MutateOp:
    """The checked mutation: the lease's token hash (None for an unleased write)
    and the payload's canonical text."""
    if not isinstance(permit, Permit):
        raise ValidationError(f"expected a Permit, got {type(permit).__name__}")
    check_resource_id(permit.resource_id)
    check_revision(permit.expected_revision)
    check_event_type(event_type)
    if actor is not None and not isinstance(actor, Owner):
        raise ValidationError(f"actor must be an Owner, got {type(actor).__name__}")
    lease = permit.lease
    if lease is not None:
        check_claim(lease)
        if lease.resource_id != permit.resource_id:
            raise LeaseMismatchError(
                f"the permit is for {permit.resource_id} but its lease is on {lease.resource_id}"
            )
        if actor is not None and actor != lease.owner:
            # A fenced write's actor is its lease owner, whom the token proves;
            # recording a different name would be a claim nobody checked.
            raise InvalidOwnerError(
                f"actor {actor} differs from the lease owner {lease.owner}: a leased write"
                " is recorded with its lease owner as actor (put other identities in the"
                " payload)"
            )
    body = None if payload is None else canonical_payload(payload).text
    sha = token_hash(lease.token) if lease is not None else None
    return ops.MutateOp(permit, event_type, sha, actor, body, check_now(now))


def get_op(resource_id: str, now: datetime | None) -> ops.GetOp:
    return ops.GetOp(check_resource_id(resource_id), check_now(now))


def list_op(resource_type: str | None, now: datetime | None) -> ops.ListOp:
    now = check_now(now)
    if resource_type is not None:
        check_resource_type(resource_type)
    return ops.ListOp(resource_type, now)


def events_op(resource_id: str, after_revision: int, limit: int) -> ops.EventsOp:
    return ops.EventsOp(
        check_resource_id(resource_id),
        check_revision(after_revision, "after_revision"),
        check_limit(limit),
    )


def read_log_op(cursor: str | None, limit: int) -> ops.ReadLogOp:
    """The parsed cursor; the driver checks its position against its own log."""
    parsed = parse_cursor(cursor)
    return ops.ReadLogOp(parsed, check_limit(limit))


def parse_resource(row: Sequence[Any]) -> ResourceState:
    """Build a ResourceState from ``(id, type, key, revision, created_at, updated_at,
    generation, owner type, owner id, acquired_at, heartbeat_at, expires_at, held[,
    claimable_at])``."""
    claimable = row[13] if len(row) > 13 else None
    (
        rid,
        rtype,
        key,
        revision,
        created,
        updated,
        generation,
        otype,
        oid,
        acquired,
        heartbeat,
        expires,
        held,
    ) = row[:13]
    owner = Owner(otype, oid) if oid is not None else None
    lease = LeaseState(generation, owner, acquired, heartbeat, expires, bool(held), claimable)
    return ResourceState(rid, rtype, key, revision, created, updated, lease)


def parse_event(row: Sequence[Any]) -> Event:
    """Build an Event from ``(id, xid, resource id, type, key, revision, event type,
    actor type, actor id, generation, lease_expires_at, payload text, payload sha256,
    created_at)``."""
    (
        event_id,
        xid,
        rid,
        rtype,
        key,
        revision,
        etype,
        atype,
        aid,
        generation,
        lease_expires,
        body,
        sha,
        created,
    ) = row
    return Event(
        id=event_id,
        cursor=encode_cursor(Position(int(xid), event_id), fingerprint(rid, revision, created)),
        resource_id=rid,
        resource_type=rtype,
        resource_key=key,
        revision=revision,
        type=etype,
        actor=Owner(atype, aid) if aid is not None else None,
        lease_generation=generation,
        lease_expires_at=lease_expires,
        payload=decode_payload(body),
        payload_sha256=bytes(sha) if sha is not None else None,
        created_at=created,
    )
