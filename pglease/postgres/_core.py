"""What the sync and asyncio PostgreSQL stores share: SQL text, arguments, row parsing.

The two store classes only move these values over a connection, so their
semantics cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from ..cursors import Position, encode_cursor
from ..errors import (
    LeaseExpiredError,
    LeaseLostError,
    LeaseMismatchError,
    PayloadConflictError,
    PgleaseError,
    ResourceLeasedError,
    StaleResourceError,
    UnknownResourceError,
    ValidationError,
)
from ..ids import new_token, token_hash
from ..payloads import canonical_payload
from ..types import Claim, Event, LeaseState, Owner, Permit, ResourceState
from ..validation import (
    check_event_type,
    check_key,
    check_optional_revision,
    check_resource_id,
    check_resource_type,
    check_revision,
    check_token,
    check_ttl,
)

DEFAULT_SCHEMA = "pglease"
MAX_EVENT_PAGE = 10_000

_ERRORS: dict[str, type[PgleaseError]] = {
    "PGL01": UnknownResourceError,
    "PGL02": StaleResourceError,
    "PGL03": LeaseLostError,
    "PGL04": LeaseExpiredError,
    "PGL05": ResourceLeasedError,
    "PGL06": PayloadConflictError,
}


def translate(exc: psycopg.Error) -> PgleaseError | None:
    """Map an error raised by a pglease SQL function to its Python class."""
    sqlstate = exc.diag.sqlstate
    cls = _ERRORS.get(sqlstate or "")
    if cls is None:
        return None
    message = exc.diag.message_primary or str(exc)
    if cls is StaleResourceError:
        detail = exc.diag.message_detail
        return StaleResourceError(message, actual=int(detail) if detail else None)
    return cls(message)


class Queries:
    """The SQL of one schema, composed once per store."""

    def __init__(self, schema: str):
        s = sql.Identifier(schema)

        def q(text: str) -> bytes:
            return sql.SQL(text).format(s=s).as_string(None).encode()

        self.ensure = q("SELECT {s}.ensure_resource(%s, %s)")
        self.claim = q(
            "SELECT * FROM {s}.claim(%s, %s, %s, %s, %s::float8, %s::bigint, %s::timestamptz)"
        )
        self.renew = q(
            "SELECT * FROM {s}.renew(%s, %s, %s, %s::bigint, %s, %s::float8, %s::bigint,"
            " %s::timestamptz)"
        )
        self.release = q(
            "SELECT * FROM {s}.release(%s, %s, %s, %s::bigint, %s, %s::bigint, %s::timestamptz)"
        )
        self.mutate_begin = q(
            "SELECT * FROM {s}.mutate_begin(%s, %s::bigint, %s, %s, %s, %s::bigint, %s, %s, %s,"
            " %s, %s::timestamptz)"
        )
        resource_cols = (
            "r.id, r.type, r.key, r.revision, r.created_at, r.updated_at, l.generation,"
            " l.owner_type, l.owner_id, l.acquired_at, l.heartbeat_at, l.expires_at,"
            " (l.owner_id IS NOT NULL AND l.expires_at > coalesce(%s::timestamptz,"
            " clock_timestamp()))"
        )
        resource_from = " FROM {s}.resources r JOIN {s}.leases l ON l.resource_id = r.id"
        self.get = q("SELECT " + resource_cols + resource_from + " WHERE r.id = %s")
        self.list_all = q("SELECT " + resource_cols + resource_from + " ORDER BY r.type, r.key")
        self.list_type = q(
            "SELECT " + resource_cols + resource_from + " WHERE r.type = %s ORDER BY r.key"
        )
        event_cols = (
            "SELECT e.id, e.xid::text, e.resource_id, r.type, r.key, e.revision, e.type,"
            " e.actor_type, e.actor_id, e.lease_generation, e.lease_expires_at, p.body,"
            " e.payload_sha256, e.created_at FROM {s}.events e"
            " JOIN {s}.resources r ON r.id = e.resource_id"
            " LEFT JOIN {s}.payloads p ON p.sha256 = e.payload_sha256"
        )
        self.resource_exists = q("SELECT 1 FROM {s}.resources WHERE id = %s")
        self.events_of = q(
            event_cols + " WHERE e.resource_id = %s AND e.revision > %s"
            " ORDER BY e.revision LIMIT %s"
        )
        # Only events of finished transactions: nothing can commit below xmin later.
        self.events_after = q(
            event_cols + " WHERE (e.xid, e.id) > (%s::text::xid8, %s::bigint)"
            " AND e.xid < pg_snapshot_xmin(pg_current_snapshot())"
            " ORDER BY e.xid, e.id LIMIT %s"
        )


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


def parse_claim(resource_id: str, owner: Owner, token: str, row: Sequence[Any]) -> Claim | None:
    claimed, generation, expires_at, revision, _holder_type, _holder_id = row
    if not claimed:
        return None
    return Claim(resource_id, owner, token, generation, expires_at, revision)


def _check_claim(claim: Claim) -> Claim:
    if not isinstance(claim, Claim):
        raise ValidationError(f"expected a Claim, got {type(claim).__name__}")
    check_resource_id(claim.resource_id)
    check_token(claim.token)
    check_revision(claim.generation, "generation")
    return claim


def renew_args(
    claim: Claim, ttl: float, expected_revision: int | None, now: datetime | None
) -> list[Any]:
    _check_claim(claim)
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
    _check_claim(claim)
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
    if not isinstance(permit, Permit):
        raise ValidationError(f"expected a Permit, got {type(permit).__name__}")
    check_resource_id(permit.resource_id)
    check_revision(permit.expected_revision)
    check_event_type(event_type)
    if actor is not None and not isinstance(actor, Owner):
        raise ValidationError(f"actor must be an Owner, got {type(actor).__name__}")
    lease = permit.lease
    if lease is not None:
        _check_claim(lease)
        if lease.resource_id != permit.resource_id:
            raise LeaseMismatchError(
                f"the permit is for {permit.resource_id} but its lease is on {lease.resource_id}"
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
    (rid, rtype, key, revision, created, updated, generation, otype, oid, acquired, heartbeat,
     expires, held) = row
    owner = Owner(otype, oid) if oid is not None else None
    lease = LeaseState(generation, owner, acquired, heartbeat, expires, bool(held))
    return ResourceState(rid, rtype, key, revision, created, updated, lease)


def parse_event(row: Sequence[Any]) -> Event:
    (event_id, xid, rid, rtype, key, revision, etype, atype, aid, generation, lease_expires, body,
     sha, created) = row
    return Event(
        id=event_id,
        cursor=encode_cursor(Position(int(xid), event_id)),
        resource_id=rid,
        resource_type=rtype,
        resource_key=key,
        revision=revision,
        type=etype,
        actor=Owner(atype, aid) if aid is not None else None,
        lease_generation=generation,
        lease_expires_at=lease_expires,
        payload=json.loads(body) if body is not None else None,
        payload_sha256=bytes(sha) if sha is not None else None,
        created_at=created,
    )


def events_of_args(resource_id: str, after_revision: int, limit: int) -> list[Any]:
    return [
        check_resource_id(resource_id),
        check_revision(after_revision, "after_revision"),
        check_limit(limit),
    ]


def events_after_args(position: Position, limit: int) -> list[Any]:
    return [str(position.xid), position.event_id, check_limit(limit)]
