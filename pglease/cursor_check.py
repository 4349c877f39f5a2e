"""Is a cursor a position in this store's log? Checked once per resume.

A cursor is refused when

- it lies beyond the end of the log (PostgreSQL: its xid was never assigned
  here, `pg_snapshot_xmax`; SQLite: its event id is past the last event):
  `CursorAheadError`;
- it carries a check (format v2, see `pglease.cursors`) and the last event at
  or before its position here is missing or has another fingerprint:
  `HistoryDivergedError`. Pruned positions keep the existing rule instead: a
  cursor below the prune horizon is expired (`CursorExpiredError`), one at or
  above it whose anchor was pruned is accepted (nothing after it was lost).

Only the events and event_horizon tables are read (client and reader roles may
SELECT them); for `events_after` the check and the page are one statement,
so they share a snapshot and a round trip.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from ._common import check_limit, parse_event
from .cursors import (
    START,
    Cursor,
    Position,
    encode_cursor,
    fingerprint,
    fingerprint_us,
    parse_cursor,
)
from .errors import CursorAheadError, CursorExpiredError, HistoryDivergedError
from .postgres._sqltext import for_schema
from .types import Event

_RESYNC = "resync: list the resources and watch from 'now'"


def check_resume(
    cursor: Cursor,
    *,
    end: str | None,
    horizon: Position,
    anchor: str | None,
    refuse_expired: bool,
) -> None:
    """Refuse `cursor` unless it is a position in this log.

    `end` describes the log's end when the cursor lies beyond it (else None),
    `anchor` is the fingerprint of the last event here at or before the
    cursor's position. A cursor below the horizon raises `CursorExpiredError`
    when `refuse_expired`; watchers pass False and fail on their first read, as
    they always have.
    """
    if cursor.position == START and cursor.check is None:
        return
    if end is not None:
        raise CursorAheadError(
            f"cursor {cursor.text} is ahead of this store's log ({end}): it comes from"
            " another server or a newer copy of this log, or this server lost events"
            f" (a restored backup, an asynchronous failover); {_RESYNC}"
        )
    if cursor.position < horizon:
        if refuse_expired:
            raise _expired(cursor.text, horizon)
        return
    if cursor.check is None or anchor == cursor.check:
        return  # v1 carries nothing more to check
    if anchor is None and horizon > START:
        return  # its event was pruned; the horizon rule above covers it
    found = "missing" if anchor is None else "another event"
    raise HistoryDivergedError(
        f"cursor {cursor.text} does not match this store's log: the event it was taken"
        f" after is {found} here. The log it came from is not this one (another schema"
        " or server, a restored backup, or an asynchronous failover that lost events);"
        f" {_RESYNC}"
    )


def _anchor(
    resource_id: str | None, revision: int | None, created_at: datetime | None
) -> str | None:
    if resource_id is None or revision is None or created_at is None:
        return None
    return fingerprint(resource_id, revision, created_at)


# --- PostgreSQL ------------------------------------------------------------------------

# One snapshot for the bounds and the anchor: the snapshot's xmax (no xid at or
# above it was ever assigned here), the prune horizon, and the last event at or
# before the cursor's position.
_PG_CHECK = """
WITH snap AS MATERIALIZED (SELECT pg_current_snapshot() AS s)
SELECT pg_snapshot_xmax(snap.s)::text, h.pruned_xid::text, h.pruned_id,
       a.resource_id, a.revision, a.created_at{extra}
  FROM snap CROSS JOIN {s}.event_horizon h
  LEFT JOIN LATERAL (
    SELECT e.resource_id, e.revision, e.created_at FROM {s}.events e
     WHERE (e.xid, e.id) <= (%s::text::xid8, %s::bigint)
     ORDER BY e.xid DESC, e.id DESC LIMIT 1) a ON true"""

# The same page as `PostgresStore.events_after`, joined to the check.
_PG_PAGE = """
  LEFT JOIN LATERAL (
    SELECT e.xid AS sort_xid, e.id, e.xid::text AS xid_text, e.resource_id AS rid,
           r.type AS rtype, r.key, e.revision AS rev, e.type AS etype, e.actor_type,
           e.actor_id, e.lease_generation, e.lease_expires_at, p.body, e.payload_sha256,
           e.created_at AS created
      FROM {s}.events e
      JOIN {s}.resources r ON r.id = e.resource_id
      LEFT JOIN {s}.payloads p ON p.sha256 = e.payload_sha256
     WHERE (e.xid, e.id) > (%s::text::xid8, %s::bigint)
       AND e.xid < pg_snapshot_xmin(snap.s)
     ORDER BY e.xid, e.id LIMIT %s) ev ON true
 ORDER BY ev.sort_xid, ev.id"""

_PG_PAGE_COLS = (
    ", ev.id, ev.xid_text, ev.rid, ev.rtype, ev.key, ev.rev, ev.etype, ev.actor_type,"
    " ev.actor_id, ev.lease_generation, ev.lease_expires_at, ev.body, ev.payload_sha256,"
    " ev.created"
)

# "now" for a watcher: the readable frontier and the last event below it.
_PG_NOW = """
WITH snap AS MATERIALIZED (SELECT pg_current_snapshot() AS s)
SELECT pg_snapshot_xmin(snap.s)::text, a.resource_id, a.revision, a.created_at
  FROM snap LEFT JOIN LATERAL (
    SELECT e.resource_id, e.revision, e.created_at FROM {s}.events e
     WHERE e.xid < pg_snapshot_xmin(snap.s)
     ORDER BY e.xid DESC, e.id DESC LIMIT 1) a ON true"""


@dataclass(frozen=True, slots=True)
class PgCursorQueries:
    """The cursor SQL of one schema."""

    check: bytes
    events_after: bytes
    now: bytes


@lru_cache(maxsize=256)
def pg_queries(schema: str) -> PgCursorQueries:
    q = for_schema(schema)
    return PgCursorQueries(
        check=q(_PG_CHECK.replace("{extra}", "")),
        events_after=q(_PG_CHECK.replace("{extra}", _PG_PAGE_COLS) + _PG_PAGE),
        now=q(_PG_NOW),
    )


def pg_check_args(cursor: Cursor) -> list[Any]:
    return [str(cursor.position.xid), cursor.position.event_id]


def pg_verify(cursor: Cursor, row: Sequence[Any], *, refuse_expired: bool) -> None:
    """Check `cursor` against a row of `PgCursorQueries.check` (or of events_after)."""
    xmax = int(row[0])
    end = None
    if cursor.position.xid > xmax:
        end = f"its transaction id {cursor.position.xid} was never assigned here; next is {xmax}"
    check_resume(
        cursor,
        end=end,
        horizon=Position(int(row[1]), int(row[2])),
        anchor=_anchor(row[3], row[4], row[5]),
        refuse_expired=refuse_expired,
    )


def pg_now(row: Sequence[Any]) -> tuple[Position, str | None]:
    """The watcher's "now" position and its anchor's fingerprint, from `PgCursorQueries.now`."""
    return Position(int(row[0]), 0), _anchor(row[1], row[2], row[3])


@dataclass(frozen=True, slots=True)
class PgEventsAfter:
    """`events_after` as one statement: run `query` with `args`, pass the rows to `events`."""

    cursor: Cursor
    query: bytes
    args: list[Any]

    def events(self, rows: Sequence[Sequence[Any]]) -> list[Event]:
        pg_verify(self.cursor, rows[0], refuse_expired=True)
        return [parse_event(r[6:]) for r in rows if r[6] is not None]


def pg_events_after(schema: str, cursor: str | None, limit: int) -> PgEventsAfter:
    """Validate the arguments of `events_after` and build its checked read."""
    parsed = parse_cursor(cursor)
    return pg_read_after(schema, parsed, check_limit(limit))


def pg_read_after(schema: str, parsed: Cursor, limit: int) -> PgEventsAfter:
    """The checked read of a parsed cursor (`limit` already checked)."""
    position = parsed.position
    args = [*pg_check_args(parsed), str(position.xid), position.event_id, limit]
    return PgEventsAfter(parsed, pg_queries(schema).events_after, args)


# --- SQLite -------------------------------------------------------------------------------

_SQLITE_CHECK = (
    "SELECT max(m.tip, h.pruned_id), h.pruned_id, a.resource_id, a.revision, a.created_at"
    " FROM (SELECT coalesce(max(id), 0) AS tip FROM events) m"
    " CROSS JOIN event_horizon h"
    " LEFT JOIN (SELECT resource_id, revision, created_at FROM events WHERE id <= ?"
    " ORDER BY id DESC LIMIT 1) a ON 1"
)
SQLITE_NOW = "SELECT id, resource_id, revision, created_at FROM events ORDER BY id DESC LIMIT 1"
_SQLITE_HORIZON = "SELECT pruned_id FROM event_horizon"


@contextmanager
def sqlite_snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """One read transaction on an autocommit connection: the statements inside
    see one snapshot of the file (WAL mode), so a check and the page it guards
    cannot straddle a prune."""
    conn.execute("BEGIN")
    try:
        yield
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")  # read-only: nothing to keep or undo


def _expired(text: str, horizon: Position) -> CursorExpiredError:
    return CursorExpiredError(
        f"cursor {text} is older than the pruned horizon {encode_cursor(horizon)}: events"
        " after it were deleted; resume from 'now' or 'start' and resync"
    )


def sqlite_verify(conn: sqlite3.Connection, cursor: Cursor, *, refuse_expired: bool) -> None:
    """Check a SQLite cursor (xid 0, already checked) against the file's own log."""
    if cursor.position == START and cursor.check is None:
        return
    tip, pruned_id, rid, revision, created_us = conn.execute(
        _SQLITE_CHECK, (cursor.position.event_id,)
    ).fetchone()
    end = None
    if cursor.position.event_id > tip:
        end = f"its event {cursor.position.event_id} is past the last event here, {tip}"
    anchor = None if rid is None else fingerprint_us(rid, revision, created_us)
    # Prune (pglease.sqlite.maintenance) deletes a prefix of ids: the horizon
    # is the last deleted id, and the tip never falls below it.
    horizon = Position(0, int(pruned_id))
    check_resume(cursor, end=end, horizon=horizon, anchor=anchor, refuse_expired=refuse_expired)


def sqlite_check_horizon(conn: sqlite3.Connection, event_id: int) -> None:
    """Refuse a watcher's position a prune has passed (`CursorExpiredError`):
    events after it were deleted before it read them. Position 0 is "start",
    which means the start of what is left, as on PostgreSQL."""
    row = conn.execute(_SQLITE_HORIZON).fetchone()
    pruned_id = int(row[0])
    if 0 < event_id < pruned_id:
        raise _expired(encode_cursor(Position(0, event_id)), Position(0, pruned_id))


def sqlite_now(conn: sqlite3.Connection) -> str:
    """The cursor after the last event of a SQLite log (``0.0`` when it was
    always empty, the horizon when a prune deleted every event)."""
    row = conn.execute(SQLITE_NOW).fetchone()
    if row is None:
        pruned_id = int(conn.execute(_SQLITE_HORIZON).fetchone()[0])
        return encode_cursor(Position(0, pruned_id))

    event_id, rid, revision, created_us = row
    return encode_cursor(Position(0, event_id), fingerprint_us(rid, revision, created_us))
