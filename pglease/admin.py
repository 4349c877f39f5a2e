"""Operator actions that only the schema's owner may take (see the role model)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from .postgres import _core
from .types import Owner
from .validation import check_resource_id, check_schema_name


@dataclass(frozen=True, slots=True)
class Revocation:
    """The outcome of `revoke_lease`: who was fenced, and the generation now current."""

    resource_id: str
    revoked: bool
    generation: int
    revision: int
    holder: Owner | None
    #: Until when a claim is still refused (the revoked holder's last granted
    #: expiry, by the database clock); None when nothing is waited for.
    claimable_at: datetime | None = None


def revoke_lease(conn: psycopg.Connection[Any], schema: str, resource_id: str) -> Revocation:
    """End the current lease of `resource_id`: the generation rises and `lease.revoked`
    is logged, so the old holder is fenced at once. Nothing changes when it is free.

    The lease can be claimed again only from the revoked holder's last granted
    expiry on (`Revocation.claimable_at`): the database fences the holder's
    writes at once, but a process on another host stops only when its runner's
    trust window closes, which is before that expiry."""
    check_schema_name(schema)
    check_resource_id(resource_id)
    query = sql.SQL(
        "SELECT revoked, generation, revision, holder_type, holder_id FROM {}.revoke_lease(%s)"
    ).format(sql.Identifier(schema))
    # A statement of its own: it must see what revoke_lease wrote.
    until = sql.SQL(
        "SELECT revoked_until FROM {}.leases WHERE resource_id = %s"
        " AND revoked_until > clock_timestamp()"
    ).format(sql.Identifier(schema))
    try:
        row = conn.execute(query, [resource_id]).fetchone()
        wait = conn.execute(until, [resource_id]).fetchone()
    except psycopg.Error as exc:
        raise _core.translate(exc) or exc from None
    assert row is not None
    revoked, generation, revision, holder_type, holder_id = row
    holder = Owner(holder_type, holder_id) if holder_id is not None else None
    return Revocation(
        resource_id,
        bool(revoked),
        int(generation),
        int(revision),
        holder,
        wait[0] if wait is not None else None,
    )
