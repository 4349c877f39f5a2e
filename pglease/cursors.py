"""Event-log cursors: the position after an event, as (transaction id, event id).

Events are read in (xid, id) order and only below the oldest running
transaction, so a later commit can never land behind a cursor already handed out.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from .errors import InvalidCursorError
from .validation import describe

_CURSOR = re.compile(r"(\d{1,20})\.(\d{1,19})")


class Position(NamedTuple):
    xid: int
    event_id: int


START = Position(0, 0)


def encode_cursor(position: Position) -> str:
    return f"{position.xid}.{position.event_id}"


def decode_cursor(cursor: str | None) -> Position:
    """Parse a cursor; `None` and ``"start"`` mean the beginning of the log."""
    if cursor is None or cursor == "start":
        return START
    if not isinstance(cursor, str) or not (match := _CURSOR.fullmatch(cursor)):
        raise InvalidCursorError(f"cursor {describe(cursor)} is not one pglease produced")
    xid, event_id = int(match[1]), int(match[2])
    if xid >= 2**64 or event_id >= 2**63:
        raise InvalidCursorError(f"cursor {describe(cursor)} is out of range")
    return Position(xid, event_id)
