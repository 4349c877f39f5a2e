"""Event-log cursors: the position after an event, as (transaction id, event id).

Events are read in (xid, id) order and only below the oldest running
transaction, so a later commit can never land behind a cursor already handed out.

Format v2, ``<xid>.<id>.<check>``: `check` is the fingerprint (a 64-bit
BLAKE2b, hex) of the *anchor*, the last event at or before the position:
the event itself for an event's cursor, the last event read for a watcher
standing between events. On resume the store looks that event up
(`pglease.cursor_check`), so a cursor from another log is refused instead of
silently skipping or re-delivering. Format v1, ``<xid>.<id>`` (pglease before
v2, and positions with no event before them), carries no check: only "not
beyond the end of the log" can be verified for it.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from hashlib import blake2b
from typing import NamedTuple

from .errors import InvalidCursorError
from .validation import describe

_CURSOR = re.compile(r"(\d{1,20})\.(\d{1,19})(?:\.([0-9a-f]{16}))?")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


class Position(NamedTuple):
    xid: int
    event_id: int


START = Position(0, 0)


class Cursor(NamedTuple):
    """A decoded cursor: its position and the anchor's fingerprint (None for v1)."""

    position: Position
    check: str | None
    text: str


def fingerprint(resource_id: str, revision: int, created_at: datetime) -> str:
    """The check of an event: its resource, revision and creation time (to the
    microsecond), so the same revision written again after a restore or a
    failover does not pass for the event a cursor was taken after."""
    return fingerprint_us(resource_id, revision, (created_at - _EPOCH) // _US)


def fingerprint_us(resource_id: str, revision: int, created_us: int) -> str:
    """`fingerprint` with the creation time in microseconds since the Unix epoch."""
    # BLAKE2b-64: a check, not a secret; it is computed for every event read,
    # and costs half of a truncated sha256.
    return blake2b(f"{resource_id}:{revision}:{created_us}".encode(), digest_size=8).hexdigest()


def encode_cursor(position: Position, check: str | None = None) -> str:
    if check is None:
        return f"{position.xid}.{position.event_id}"
    return f"{position.xid}.{position.event_id}.{check}"


def cursor_check(cursor: str) -> str | None:
    """The fingerprint part of a cursor pglease produced (None for v1)."""
    head, _, tail = cursor.rpartition(".")
    return tail if head.count(".") == 1 else None


def parse_cursor(cursor: str | None) -> Cursor:
    """Parse a cursor; `None` and ``"start"`` mean the beginning of the log."""
    if cursor is None or cursor == "start":
        return Cursor(START, None, "start")
    if not isinstance(cursor, str) or not (match := _CURSOR.fullmatch(cursor)):
        raise InvalidCursorError(f"cursor {describe(cursor)} is not one pglease produced")
    xid, event_id = int(match[1]), int(match[2])
    if xid >= 2**64 or event_id >= 2**63:
        raise InvalidCursorError(f"cursor {describe(cursor)} is out of range")
    return Cursor(Position(xid, event_id), match[3], cursor)


def decode_cursor(cursor: str | None) -> Position:
    """The position of a cursor (see `parse_cursor`)."""
    return parse_cursor(cursor).position
