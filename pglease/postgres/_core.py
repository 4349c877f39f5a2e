"""What the sync and asyncio PostgreSQL stores share: SQL text, arguments, row parsing.

The two store classes only move these values over a connection, so their
semantics cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

# Backend-neutral helpers live in `pglease._common`; re-exported here so existing
# imports (`_core.claim_args`, ...) keep working.
from .._common import MAX_EVENT_PAGE as MAX_EVENT_PAGE
from .._common import check_claim as _check_claim  # noqa: F401
from .._common import check_now as check_now
from .._common import claim_args as claim_args
from .._common import ensure_args as ensure_args
from .._common import events_of_args as events_of_args
from .._common import mutate_args as mutate_args
from .._common import parse_event as parse_event
from .._common import parse_resource as parse_resource
from .._common import release_args as release_args
from .._common import renew_args as renew_args
from ..errors import (
    ClockOverrideError,
    DatabaseUnavailableError,
    EventOrderError,
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
    PayloadConflictError,
    PermissionDeniedError,
    PgleaseError,
    ResourceLeasedError,
    StaleResourceError,
    UnknownResourceError,
    ValidationError,
)
from ..migrations import MigrationState
from ..types import Claim, Owner

DEFAULT_SCHEMA = "pglease"

_ERRORS: dict[str, type[PgleaseError]] = {
    "PGL01": UnknownResourceError,
    "PGL02": StaleResourceError,
    "PGL03": LeaseLostError,
    "PGL04": LeaseExpiredError,
    "PGL05": ResourceLeasedError,
    "PGL06": PayloadConflictError,
    # The SQL functions' own input checks (sql/functions/10_core.sql): the same
    # classes as pglease/validation.py raises before anything is sent.
    "PGL10": ClockOverrideError,
    "PGL11": InvalidTTLError,
    "PGL12": InvalidResourceIdError,
    "PGL13": InvalidOwnerError,
    "PGL14": InvalidTokenError,
    "PGL15": InvalidRevisionError,
    "PGL16": InvalidResourceTypeError,
    "PGL17": InvalidKeyError,
    "PGL18": InvalidEventTypeError,
    "PGL19": InvalidPayloadError,
    "PGL20": ValidationError,
}
# `_bump`'s order guard (sql/0002, 0006) raises a serialization failure whose
# message starts with this. Only that one is mapped: any other 40001 (say from
# the caller's own SQL under SERIALIZABLE) is not pglease's to name.
_SERIALIZATION_FAILURE = "40001"
_INSUFFICIENT_PRIVILEGE = "42501"
_EVENT_ORDER_PREFIX = "event order:"


def unavailable(exc: psycopg.OperationalError) -> DatabaseUnavailableError:
    """One line naming the server (libpq's first line has host and port), no password."""
    from ..dsn import redact_text  # here: pglease.dsn imports the store's errors module

    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    detail = redact_text("; ".join(lines) or "no detail")
    return DatabaseUnavailableError(f"cannot connect to PostgreSQL: {detail}")


def require_migrated(state: MigrationState) -> None:
    """Refuse to open a store on a schema with pending work (auto_migrate=False)."""
    if not state.up_to_date:
        raise state.not_migrated_error("the store was opened without auto_migrate")


def translate(exc: psycopg.Error) -> PgleaseError | None:
    """Map an error raised by a pglease SQL function to its Python class."""
    sqlstate = exc.diag.sqlstate
    message = exc.diag.message_primary or str(exc)
    if sqlstate == _SERIALIZATION_FAILURE:
        if message.startswith(_EVENT_ORDER_PREFIX):
            return EventOrderError(message)
        return None
    if sqlstate == _INSUFFICIENT_PRIVILEGE:
        return PermissionDeniedError(
            f"{message} (the role model: a client role claims, renews, releases, mutates and"
            " watches; a reader reads; only the schema's owner migrates and prunes)"
        )
    cls = _ERRORS.get(sqlstate or "")
    if cls is None:
        return None
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
        # `held` is judged once per statement by `_clock_now`: the database
        # clock, or a test time where the schema's owner switched that on.
        resource_cols = (
            "r.id, r.type, r.key, r.revision, r.created_at, r.updated_at, l.generation,"
            " l.owner_type, l.owner_id, l.acquired_at, l.heartbeat_at, l.expires_at,"
            " (l.owner_id IS NOT NULL AND l.expires_at > c.now)"
        )
        resource_from = (
            " FROM (SELECT {s}._clock_now(%s::timestamptz) AS now) c"
            " CROSS JOIN {s}.resources r JOIN {s}.leases l ON l.resource_id = r.id"
        )
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


def parse_claim(resource_id: str, owner: Owner, token: str, row: Sequence[Any]) -> Claim | None:
    claimed, generation, expires_at, revision, _holder_type, _holder_id = row
    if not claimed:
        return None
    return Claim(resource_id, owner, token, generation, expires_at, revision)
