"""Retention: delete old events, raising the prune horizon watchers check against,
and the payloads no remaining event references."""

from __future__ import annotations

import re
from datetime import timedelta

from psycopg import sql

from .. import _instrument
from ..errors import ValidationError
from .watcher import AsyncStore, SyncStore

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``15m``, ``12h``, ``7d``, ``1h30m`` or a bare number of seconds."""
    text = text.strip().lower()
    try:
        return _check_age(float(text))
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _DURATION.finditer(text):
        if match.start() != pos:
            break
        total += float(match[1]) * _UNITS[match[2]]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValidationError(f"duration {text!r} is not like 90s, 15m, 12h, 7d or 1h30m")
    return _check_age(total)


def _check_age(seconds: object) -> float:
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValidationError("older_than must be seconds (a number) or a timedelta")
    if not 0 <= seconds < 1e10 or seconds != seconds:
        raise ValidationError("older_than must be a non-negative, finite duration")
    return float(seconds)


class PruneResult(int):
    """What `prune` deleted. Its int value is the number of events, as `prune`
    returned before it also collected payloads, so ``prune(store, 0) == 3``
    still reads the same; `payloads` is the number of payloads deleted."""

    payloads: int

    def __new__(cls, events: int, payloads: int) -> PruneResult:
        result = super().__new__(cls, events)
        result.payloads = payloads
        return result

    @property
    def events(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        return f"PruneResult(events={int(self)}, payloads={self.payloads})"


def _query(schema: str) -> bytes:
    # prune_log (sql/0007): the events, then the payloads nothing references.
    return (
        sql.SQL("SELECT events, payloads FROM {}.prune_log(make_interval(secs => %s))")
        .format(sql.Identifier(schema))
        .as_string(None)
        .encode()
    )


def prune(store: SyncStore, older_than: float | timedelta) -> PruneResult:
    """Delete events created more than `older_than` ago, then every payload no
    remaining event references; return the counts (an int: the events).

    Deletes a prefix of the log in read order, never an event a watcher could
    still be about to read for the first time without noticing: a watcher whose
    cursor is below the deleted range gets `CursorExpiredError`. A payload a
    writer is storing or reusing at that moment is left alone, never pulled
    out from under its event (see `_gc_payloads` in sql/0007_expiry_gc.sql).
    """
    seconds = _check_age(older_than)
    with store.connection() as conn:
        row = conn.execute(_query(store.schema), [seconds]).fetchone()
    assert row is not None
    _instrument.recorder.pruned(int(row[0]), int(row[1]))
    return PruneResult(int(row[0]), int(row[1]))


async def prune_async(store: AsyncStore, older_than: float | timedelta) -> PruneResult:
    """Asyncio twin of `prune`."""
    seconds = _check_age(older_than)
    async with store.connection() as conn:
        cur = await conn.execute(_query(store.schema), [seconds])
        row = await cur.fetchone()
    assert row is not None
    _instrument.recorder.pruned(int(row[0]), int(row[1]))
    return PruneResult(int(row[0]), int(row[1]))
