"""Backend-neutral pieces every store shares: argument checks, argument lists, row parsing.

Each store turns the argument lists built here into its own statements, so
validation happens once, before anything reaches a database, and identically
for every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from .cursors import Position, encode_cursor, fingerprint
from .errors import InvalidOwnerError, LeaseMismatchError, ValidationError
from .ids import new_token, token_hash
from .payloads import canonical_payload, decode_payload
from .types import Claim, Event, LeaseState, Owner, Permit, ResourceState
from .validation import (
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


def ensure_args(resource_type: str, key: str) -> tuple[str, str]:
    return check_resource_type(resource_type), check_key(key)


def claim_args(
    resource_id: str,
    owner: Owner,
    ttl: float,
    expected_revision: int | None,
    now: datetime | None,
) -> tuple[str, list[Any]]:
    """A fresh token and ``[resource, owner type, owner id, token sha256, ttl,
    expected revision, now]``."""
    check_resource_id(resource_id)
    if not isinstance(owner, Owner):
        raise ValidationError(f"owner must be an Owner, got {type(owner).__name__}")
    token = new_token()
    args = [
        resource_id,
        owner.type,
        owner.id,
        token_hash(token),
        check_ttl(ttl),
        check_optional_revision(expected_revision),
        check_now(now),
    ]
    return token, args


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


def renew_args(
    claim: Claim, ttl: float, expected_revision: int | None, now: datetime | None
) -> list[Any]:
    """``[resource, owner type, owner id, generation, token sha256, ttl, expected
    revision, now]``."""
    check_claim(claim)
    return [
        claim.resource_id,
        claim.owner.type,
        claim.owner.id,
        claim.generation,
        token_hash(claim.token),
        check_ttl(ttl),
        check_optional_revision(expected_revision),
        check_now(now),
    ]


def release_args(claim: Claim, expected_revision: int | None, now: datetime | None) -> list[Any]:
    """``[resource, owner type, owner id, generation, token sha256, expected revision, now]``."""
    check_claim(claim)
    return [
        claim.resource_id,
        claim.owner.type,
        claim.owner.id,
        claim.generation,
        token_hash(claim.token),
        check_optional_revision(expected_revision),
        check_now(now),
    ]


def mutate_args(
    permit: Permit,
    event_type: str,
    payload: Any,
    actor: Owner | None,
    now: datetime | None,
) -> list[Any]:
    """``[resource, expected revision, event type, owner type, owner id, generation,
    token sha256, actor type, actor id, canonical payload text, now]``; the lease
    fields are None for an unleased write."""
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
    return [
        permit.resource_id,
        permit.expected_revision,
        event_type,
        lease.owner.type if lease else None,
        lease.owner.id if lease else None,
        lease.generation if lease else None,
        token_hash(lease.token) if lease else None,
        actor.type if actor else None,
        actor.id if actor else None,
        body,
        check_now(now),
    ]


def parse_resource(row: Sequence[Any]) -> ResourceState:
    """Build a ResourceState from ``(id, type, key, revision, created_at, updated_at,
    generation, owner type, owner id, acquired_at, heartbeat_at, expires_at, held)``."""
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
    ) = row
    owner = Owner(otype, oid) if oid is not None else None
    lease = LeaseState(generation, owner, acquired, heartbeat, expires, bool(held))
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


def events_of_args(resource_id: str, after_revision: int, limit: int) -> list[Any]:
    return [
        check_resource_id(resource_id),
        check_revision(after_revision, "after_revision"),
        check_limit(limit),
    ]
