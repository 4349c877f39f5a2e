"""Listing resources in pages: bounded memory however many there are.

`iter_resources` walks ``resources JOIN leases`` by keyset on ``(type, key)``
(the table's UNIQUE (type, key) index serves both the order and the
``(r.type, r.key) > (last type, last key)`` bound), one connection borrowed
per page, so a caller can print the first page before the last is read and
no page holds a connection while the caller works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

import psycopg
from psycopg import sql

from ._common import parse_event, parse_resource
from .types import Event, Owner, ResourceState
from .validation import check_resource_type, check_schema_name

__all__ = ["Listed", "fetch_resource", "iter_resources"]

ConnFactory = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


@runtime_checkable
class _HasConnection(Protocol):
    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...


@dataclass(frozen=True, slots=True)
class Listed:
    """One resource and the database clock its page was read at."""

    state: ResourceState
    #: clock_timestamp() of the page's statement: what `held` was judged by.
    now: datetime

    @property
    def seconds_left(self) -> float | None:
        """Seconds until the lease expires, by the database clock; None when free."""
        expires = self.state.lease.expires_at
        if not self.state.lease.held or expires is None:
            return None
        return max(0.0, (expires - self.now).total_seconds())


def _page_query(
    schema: str,
    *,
    after: bool,
    resource_type: str | None,
    held: bool | None,
    owner: Owner | None,
    expiring_within: float | None,
) -> tuple[sql.Composed, list[str]]:
    """The SELECT of one page, and the names of its parameters in order."""
    s = sql.Identifier(schema)
    where: list[str] = []
    params: list[str] = []
    if after:
        where.append("(r.type, r.key) > (%s, %s)")
        params += ["after_type", "after_key"]
    if resource_type is not None:
        where.append("r.type = %s")
        params.append("type")
    live = "(l.owner_id IS NOT NULL AND l.expires_at > c.now)"
    if held is True or owner is not None or expiring_within is not None:
        where.append(live)
    elif held is False:
        where.append(f"NOT {live}")
    if owner is not None:
        where.append("l.owner_type = %s AND l.owner_id = %s")
        params += ["owner_type", "owner_id"]
    if expiring_within is not None:
        where.append("l.expires_at <= c.now + make_interval(secs => %s)")
        params.append("within")
    text = (
        "SELECT r.id, r.type, r.key, coalesce(l.revision, r.revision), r.created_at,"
        " coalesce(l.updated_at, r.updated_at), l.generation,"
        " l.owner_type, l.owner_id, l.acquired_at, l.heartbeat_at, l.expires_at, " + live + ","
        " c.now, CASE WHEN l.owner_id IS NULL AND l.revoked_until > c.now THEN l.revoked_until END"
        " FROM (SELECT clock_timestamp() AS now) c"
        " CROSS JOIN {s}.resources r JOIN {s}.leases l ON l.resource_id = r.id"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY r.type, r.key LIMIT %s"
    )
    params.append("limit")
    return sql.SQL(text).format(s=s), params


def iter_resources(
    source: _HasConnection | ConnFactory,
    schema: str,
    *,
    resource_type: str | None = None,
    held: bool | None = None,
    owner: Owner | None = None,
    expiring_within: float | None = None,
    page_size: int = 1000,
    limit: int | None = None,
) -> Iterator[Listed]:
    """Resources in (type, key) order, read `page_size` at a time.

    `source` is a store (its `connection()` is borrowed per page) or a
    callable returning a connection context manager. Filters: `held` True
    (live leases) or False (free or expired), `owner` (its live leases),
    `expiring_within` seconds (live leases ending that soon), and `limit`
    rows in all. Each page is judged by its own database clock: a walk over
    many pages is not one snapshot, as a listing of a changing table cannot be.
    """
    check_schema_name(schema)
    if resource_type is not None:
        check_resource_type(resource_type)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit!r}")
    factory: ConnFactory = source.connection if isinstance(source, _HasConnection) else source
    values: dict[str, Any] = {
        "type": resource_type,
        "owner_type": owner.type if owner else None,
        "owner_id": owner.id if owner else None,
        "within": expiring_within,
    }
    filters: dict[str, Any] = {
        "resource_type": resource_type,
        "held": held,
        "owner": owner,
        "expiring_within": expiring_within,
    }
    first = _page_query(schema, after=False, **filters)
    rest = _page_query(schema, after=True, **filters)
    remaining = limit
    after: tuple[str, str] | None = None
    while remaining is None or remaining > 0:
        values["limit"] = page_size if remaining is None else min(page_size, remaining)
        if after is not None:
            values["after_type"], values["after_key"] = after
        query, names = first if after is None else rest
        with factory() as conn:
            rows = conn.execute(query, [values[n] for n in names]).fetchall()
        for row in rows:
            yield Listed(parse_resource(row[:13] + row[14:]), row[13])
        if remaining is not None:
            remaining -= len(rows)
        if len(rows) < values["limit"]:
            return
        after = (rows[-1][1], rows[-1][2])


def _one_query(schema: str) -> sql.Composed:
    live = "(l.owner_id IS NOT NULL AND l.expires_at > c.now)"
    return sql.SQL(
        "SELECT r.id, r.type, r.key, coalesce(l.revision, r.revision), r.created_at,"
        " coalesce(l.updated_at, r.updated_at), l.generation,"
        " l.owner_type, l.owner_id, l.acquired_at, l.heartbeat_at, l.expires_at, " + live + ","
        " c.now, CASE WHEN l.owner_id IS NULL AND l.revoked_until > c.now THEN l.revoked_until END"
        " FROM (SELECT clock_timestamp() AS now) c"
        " CROSS JOIN {s}.resources r JOIN {s}.leases l ON l.resource_id = r.id WHERE r.id = %s"
    ).format(s=sql.Identifier(schema))


def _last_event_query(schema: str) -> sql.Composed:
    return sql.SQL(
        "SELECT e.id, e.xid::text, e.resource_id, r.type, r.key, e.revision, e.type,"
        " e.actor_type, e.actor_id, e.lease_generation, e.lease_expires_at, p.body,"
        " e.payload_sha256, e.created_at FROM {s}.events e"
        " JOIN {s}.resources r ON r.id = e.resource_id"
        " LEFT JOIN {s}.payloads p ON p.sha256 = e.payload_sha256"
        " WHERE e.resource_id = %s ORDER BY e.revision DESC LIMIT 1"
    ).format(s=sql.Identifier(schema))


def fetch_resource(
    conn: psycopg.Connection[Any], schema: str, resource_id: str
) -> tuple[Listed, Event | None] | None:
    """One resource with the clock it was judged by, and its last event still in
    the log (None once pruned); None when the resource does not exist. Reads only."""
    check_schema_name(schema)
    row = conn.execute(_one_query(schema), [resource_id]).fetchone()
    if row is None:
        return None
    listed = Listed(parse_resource(row[:13] + row[14:]), row[13])
    last = conn.execute(_last_event_query(schema), [resource_id]).fetchone()
    return listed, (parse_event(last) if last is not None else None)
