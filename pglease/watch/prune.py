"""Retention: delete old events, raising the prune horizon watchers check against,
and the payloads no remaining event references, in short chunks."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import psycopg

from .. import _instrument
from ..errors import DatabaseError, PgleaseError, ValidationError
from ..postgres._core import pooler_local_limits, translate
from ..postgres._sqltext import for_schema
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


#: Events per chunk, each chunk its own transaction; payloads go half as many
#: per chunk (each costs an index probe of the events, through the entries the
#: deleted events left until vacuum). Sized so a chunk stays under ~100 ms on a
#: busy 2-core server (bench/RESULTS-scale.md): that is how long a prune can
#: hold back any watcher of the cluster.
DEFAULT_CHUNK = 1000
MAX_CHUNK = 100_000


def _payload_chunk(chunk: int) -> int:
    return max(1, chunk // 2)


def check_chunk(chunk: object) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise ValidationError(f"chunk must be an integer, got {chunk!r}")
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValidationError(f"chunk must be between 1 and {MAX_CHUNK}, got {chunk}")
    return chunk


class _Queries:
    """The three statements of a chunked prune, for one schema."""

    def __init__(self, schema: str) -> None:
        q = for_schema(schema)
        # By the database clock, once: later chunks keep the same cutoff, so
        # a prune ends even while new events keep arriving.
        self.cutoff = q("SELECT clock_timestamp() - make_interval(secs => %s)")
        self.events = q("SELECT events, done FROM {s}.prune_chunk(%s, %s)")
        self.payloads = q("SELECT payloads, last_sha256, done FROM {s}.gc_payloads_chunk(%s, %s)")


def _failed(exc: psycopg.Error) -> PgleaseError:
    known = translate(exc)
    if known is not None:
        return known
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DatabaseError(f"prune failed: {first}", sqlstate=exc.diag.sqlstate)


def prune(
    store: SyncStore, older_than: float | timedelta, *, chunk: int = DEFAULT_CHUNK
) -> PruneResult:
    """Delete events created more than `older_than` ago, then the payloads of
    the deleted events that no remaining event references; return the counts
    (an int: the events).

    Deletes a prefix of the log in read order, never an event a watcher could
    still be about to read for the first time without noticing: a watcher whose
    cursor is below the deleted range gets `CursorExpiredError`. The work is
    done in chunks of at most `chunk` events (then ``chunk // 2`` payloads),
    each its own short transaction, because any open writing transaction holds back every
    watcher of the cluster (see README "Watching"). A payload a writer is
    storing or reusing at that moment is left alone, never pulled out from
    under its event, and judged again by the next prune (`gc_payloads_chunk`
    in sql/functions/20_watch.sql).
    """
    seconds = _check_age(older_than)
    size = check_chunk(chunk)
    q = _Queries(store.schema)
    events = payloads = 0
    # Behind a transaction pooler no session SET bounds a statement: each
    # chunk then runs in a transaction that sets the store's limits first.
    bound = pooler_local_limits(store)
    try:
        with store.connection() as conn:

            def one(query: bytes, args: list[Any]) -> tuple[Any, ...]:
                if bound is None:
                    return _row(conn.execute(query, args).fetchone())
                with conn.transaction():
                    conn.execute(bound)
                    return _row(conn.execute(query, args).fetchone())

            cutoff = one(q.cutoff, [seconds])[0]
            done = False
            while not done:
                n, done = one(q.events, [cutoff, size])
                events += int(n)
            after, done = b"", False
            while not done:
                n, after, done = one(q.payloads, [after, _payload_chunk(size)])
                payloads += int(n)
    except psycopg.Error as exc:
        # Chunks already committed stay done; the next prune carries on.
        raise _failed(exc) from exc
    _instrument.recorder.pruned(events, payloads)
    return PruneResult(events, payloads)


async def prune_async(
    store: AsyncStore, older_than: float | timedelta, *, chunk: int = DEFAULT_CHUNK
) -> PruneResult:
    """Asyncio twin of `prune`."""
    seconds = _check_age(older_than)
    size = check_chunk(chunk)
    q = _Queries(store.schema)
    events = payloads = 0
    bound = pooler_local_limits(store)
    try:
        async with store.connection() as conn:

            async def one(query: bytes, args: list[Any]) -> tuple[Any, ...]:
                if bound is None:
                    return _row(await (await conn.execute(query, args)).fetchone())
                async with conn.transaction():
                    await conn.execute(bound)
                    return _row(await (await conn.execute(query, args)).fetchone())

            cutoff = (await one(q.cutoff, [seconds]))[0]
            done = False
            while not done:
                n, done = await one(q.events, [cutoff, size])
                events += int(n)
            after, done = b"", False
            while not done:
                n, after, done = await one(q.payloads, [after, _payload_chunk(size)])
                payloads += int(n)
    except psycopg.Error as exc:
        raise _failed(exc) from exc
    _instrument.recorder.pruned(events, payloads)
    return PruneResult(events, payloads)


def _row(row: Any) -> tuple[Any, ...]:
    assert row is not None  # each function returns exactly one row
    return tuple(row)
