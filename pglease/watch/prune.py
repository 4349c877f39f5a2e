"""Retention: delete old events, raising the prune horizon watchers check against,
and the payloads no remaining event references, in short chunks."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Protocol

from .. import _instrument
from ..driver.maintenance import AsyncMaintenanceDriver, MaintenanceDriver, PruneRequest
from ..errors import ValidationError

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


#: Events per chunk, each chunk its own transaction; payloads go half as many
#: per chunk on PostgreSQL (`pglease.postgres.maintenance.payload_chunk`).
#: Sized so a chunk stays under ~100 ms on a busy 2-core server
#: (bench/RESULTS-scale.md): that is how long a prune can hold back any
#: watcher of the cluster.
DEFAULT_CHUNK = 1000
MAX_CHUNK = 100_000


def check_chunk(chunk: object) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise ValidationError(f"chunk must be an integer, got {chunk!r}")
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValidationError(f"chunk must be between 1 and {MAX_CHUNK}, got {chunk}")
    return chunk


def _check_flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"respect_ttl must be a bool, got {value!r}")
    return value


class _Pruner(Protocol):
    def runtime_driver(self) -> MaintenanceDriver: ...


class _AsyncPruner(Protocol):
    def runtime_driver(self) -> AsyncMaintenanceDriver: ...


def prune(
    store: _Pruner,
    older_than: float | timedelta,
    *,
    chunk: int = DEFAULT_CHUNK,
    respect_ttl: bool = False,
) -> PruneResult:
    """Delete events created more than `older_than` ago, then the payloads of
    the deleted events that no remaining event references; return the counts
    (an int: the events). Works on every store (PostgreSQL and SQLite).

    Deletes a prefix of the log in read order, never an event a watcher could
    still be about to read for the first time without noticing: a watcher whose
    cursor is below the deleted range gets `CursorExpiredError`. The work is
    done in chunks of at most `chunk` events (then, on PostgreSQL,
    ``chunk // 2`` payloads), each its own short transaction, because any open
    writing transaction holds back every watcher of the cluster (see README
    "Watching"), and on SQLite every writer of the file. A payload a writer is
    storing or reusing at that moment is left alone, never pulled out from
    under its event, and judged again by the next prune (`gc_payloads_chunk`
    in sql/functions/20_watch.sql). Chunks committed before an error stay done.

    With `respect_ttl`, an `older_than` shorter than the longest ttl of a lease
    held now is refused with `ValidationError` and nothing is deleted (the
    check ``pglease prune`` makes without ``--force``).
    """
    request = PruneRequest(_check_age(older_than), check_chunk(chunk), _check_flag(respect_ttl))
    report = store.runtime_driver().prune(request)
    _instrument.recorder.pruned(report.events, report.payloads)
    return PruneResult(report.events, report.payloads)


async def prune_async(
    store: _AsyncPruner,
    older_than: float | timedelta,
    *,
    chunk: int = DEFAULT_CHUNK,
    respect_ttl: bool = False,
) -> PruneResult:
    """Asyncio twin of `prune`."""
    request = PruneRequest(_check_age(older_than), check_chunk(chunk), _check_flag(respect_ttl))
    report = await store.runtime_driver().prune(request)
    _instrument.recorder.pruned(report.events, report.payloads)
    return PruneResult(report.events, report.payloads)
