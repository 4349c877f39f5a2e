"""The watch SQL of one schema and the parsing of its rows: what the PostgreSQL
listener (`_listen`) and log reader (`_log_reader_async`) send and read.

A read is one call of `watch_read` (sql/0002_watch.sql): the skipper probe,
the snapshot bounds, the prune horizon and a page of events, in one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from .._watch_common import cannot_heal, channel_name
from ..cursors import Position, fingerprint
from ..driver.listen_ops import LogPage, LogReadError
from ..dsn import redact_text
from ..errors import DatabaseUnavailableError
from ..payloads import decode_payload
from ..types import Event, Owner
from ._sqltext import for_schema

__all__ = [
    "WatchQueries",
    "channel_name",
    "log_read_error",
    "parse_page",
    "read_args",
    "silence",
    "silence_error",
]


class WatchQueries:
    """The watch SQL of one schema."""

    def __init__(self, schema: str):
        q = for_schema(schema)
        self.read = q(
            "SELECT * FROM {s}.watch_read(%s::text::xid8, %s::bigint, %s::text::xid8,"
            " %s::bigint, %s::integer)"
        )
        # The same read as a libpq prepared statement (the hub's own connection).
        self.read_prepared = q(
            "SELECT * FROM {s}.watch_read($1::text::xid8, $2::bigint, $3::text::xid8,"
            " $4::bigint, $5::integer)"
        )
        self.frontier = q(
            "SELECT pg_snapshot_xmin(pg_current_snapshot())::text,"
            " pruned_xid::text, pruned_id FROM {s}.event_horizon"
        )


def read_args(after: Position, upto: Position, limit: int) -> list[Any]:
    return [str(after.xid), after.event_id, str(upto.xid), upto.event_id, limit]


def parse_page(rows: Sequence[Sequence[Any]], limit: int) -> LogPage:
    first = rows[0]
    xmin, xmax, skippers = int(first[0]), int(first[1]), bool(first[2])
    horizon = Position(int(first[3]), int(first[4]))
    events: list[Event] = []
    positions: list[Position] = []
    if first[5] is not None:
        # Per event: the hub parses every event its process receives, once.
        add_event, add_position = events.append, positions.append
        for r in rows:
            event_id, xid = r[5], r[6]
            add_position(Position(int(xid), event_id))
            add_event(_event(r, f"{xid}.{event_id}.{fingerprint(r[7], r[10], r[18])}"))
    # Some transaction in progress below the snapshot's xmax, or a writer that
    # skipped its NOTIFY in flight: an event may still become readable.
    held_back = xmin != xmax or skippers
    return LogPage(events, positions, Position(xmin, 0), held_back, horizon, len(events) >= limit)


_owners: dict[tuple[str, str], Owner] = {}


def _event(r: Sequence[Any], cursor: str) -> Event:
    """`parse_event` for the hot path: owners read back from the database were
    validated when written, so they are cached instead of re-validated."""
    owner = None
    if r[13] is not None:
        key = (r[12], r[13])
        owner = _owners.get(key)
        if owner is None:
            if len(_owners) > 10_000:
                _owners.clear()
            owner = _owners[key] = Owner(*key)
    body, sha = r[16], r[17]
    return Event(
        id=r[5],
        cursor=cursor,
        resource_id=r[7],
        resource_type=r[8],
        resource_key=r[9],
        revision=r[10],
        type=r[11],
        actor=owner,
        lease_generation=r[14],
        lease_expires_at=r[15],
        payload=decode_payload(body) if body is not None else None,
        payload_sha256=bytes(sha) if sha is not None else None,
        created_at=r[18],
    )


def log_read_error(exc: psycopg.Error, what: str) -> LogReadError:
    """`exc` as the listen protocol's error, classified by its SQLSTATE (see
    `_watch_common.cannot_heal`) and kept as the cause: the watch readers
    record and report the driver's own error."""
    error = LogReadError(
        f"{what} failed: {redact_text(str(exc)).strip()}", permanent=cannot_heal(exc)
    )
    error.__cause__ = exc
    return error


def silence(exc: psycopg.Error, seconds: float, where: str) -> DatabaseUnavailableError:
    """The error of a round trip that got no answer within its stall timeout
    (`exc`, psycopg's "connection lost" that the closing caused, its cause)."""
    error = DatabaseUnavailableError(
        f"no answer from the server for {seconds:g} s on {where} (stall_timeout);"
        " the connection was closed"
    )
    error.__cause__ = exc
    return error


def silence_error(cause: DatabaseUnavailableError, what: str) -> LogReadError:
    """A `silence` as the listen protocol's error: a lost line, so retrying may
    heal it. Raise it ``from cause``: the silence, not psycopg's error, is
    what the watch readers record and report."""
    return LogReadError(f"{what} failed: {cause}", permanent=False)
