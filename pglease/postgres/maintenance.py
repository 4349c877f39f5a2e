"""Log maintenance (`pglease.driver.maintenance`) on PostgreSQL, sync and asyncio.

The reaper calls `reap_next` (sql/0008_reap_per_lease.sql) once per
transaction; prune calls `prune_chunk` and then `gc_payloads_chunk`
(sql/functions/20_watch.sql), each chunk its own short transaction, with the
cutoff read once by the database clock so a prune ends while events keep
arriving. Behind a transaction pooler no session SET bounds a statement, so
each of those transactions sets the store's limits first
(`_core.pooler_local_limits`). Work committed before an error stays done.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ..driver.maintenance import (
    PruneReport,
    PruneRequest,
    ReapReport,
    ReapRequest,
    ttl_refusal,
)
from ..errors import DatabaseError, PgleaseError, ValidationError
from . import _core
from ._sqltext import for_schema


class MaintenanceQueries:
    """The reaper's and prune's statements, for one schema."""

    def __init__(self, schema: str) -> None:
        q = for_schema(schema)
        self.reap_next = q("SELECT lease_resource, reaped FROM {s}.reap_next(%s)")
        self.cutoff = q("SELECT clock_timestamp() - make_interval(secs => %s)")
        self.events = q("SELECT events, done FROM {s}.prune_chunk(%s, %s)")
        self.payloads = q("SELECT payloads, last_sha256, done FROM {s}.gc_payloads_chunk(%s, %s)")
        # The longest lease length among live leases, from the last renewal.
        self.longest_ttl = q(
            "SELECT extract(epoch FROM max(expires_at - coalesce(heartbeat_at, acquired_at)))"
            "::float8 FROM {s}.leases WHERE owner_id IS NOT NULL AND expires_at > clock_timestamp()"
        )


def payload_chunk(chunk: int) -> int:
    """Payloads go half as many per chunk as events: each costs an index probe
    of the events, through the entries the deleted events left until vacuum."""
    return max(1, chunk // 2)


def reap_error(store: object, exc: psycopg.Error) -> PgleaseError:
    """A driver error of a reap as a PgleaseError, worded with the store's limits."""
    limits = getattr(store, "limits", None)
    dsn = getattr(store, "dsn", None)
    return _core.driver_error(
        exc,
        limits if isinstance(limits, _core.Limits) else None,
        dsn if isinstance(dsn, str) else None,
    )


def prune_error(exc: psycopg.Error) -> PgleaseError:
    known = _core.translate(exc)
    if known is not None:
        return known
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DatabaseError(f"prune failed: {first}", sqlstate=exc.diag.sqlstate)


def _check_ttl(request: PruneRequest, row: tuple[Any, ...]) -> None:
    refusal = ttl_refusal(request.older_than, None if row[0] is None else float(row[0]))
    if refusal is not None:
        raise ValidationError(refusal)


def _row(row: Any) -> tuple[Any, ...]:
    assert row is not None  # each function returns exactly one row
    return tuple(row)


# --------------------------------------------------------------------------- sync


def reap(store: Any, request: ReapRequest) -> ReapReport:
    """Reap up to `request.limit` leases, one per transaction."""
    q = MaintenanceQueries(store.schema)
    reaped: list[str] = []
    after = ""
    bound = _core.pooler_local_limits(store)
    try:
        with store.connection() as conn:
            for _ in range(request.limit):
                if bound is None:
                    row = conn.execute(q.reap_next, [after]).fetchone()
                    conn.commit()
                else:
                    with conn.transaction():
                        conn.execute(bound)
                        row = conn.execute(q.reap_next, [after]).fetchone()
                if row is None or row[0] is None:
                    break
                after = row[0]
                if row[1]:
                    reaped.append(row[0])
    except psycopg.Error as exc:
        # Leases reaped before the error stay reaped (one per transaction).
        raise reap_error(store, exc) from exc
    return ReapReport(tuple(reaped))


def prune(store: Any, request: PruneRequest) -> PruneReport:
    """Prune in chunks, each its own transaction."""
    q = MaintenanceQueries(store.schema)
    size = request.chunk
    events = payloads = 0
    bound = _core.pooler_local_limits(store)
    try:
        with store.connection() as conn:

            def one(query: bytes, args: list[Any]) -> tuple[Any, ...]:
                if bound is None:
                    return _row(conn.execute(query, args).fetchone())
                with conn.transaction():
                    conn.execute(bound)
                    return _row(conn.execute(query, args).fetchone())

            if request.respect_ttl:
                _check_ttl(request, one(q.longest_ttl, []))
            cutoff = one(q.cutoff, [request.older_than])[0]
            done = False
            while not done:
                n, done = one(q.events, [cutoff, size])
                events += int(n)
            after, done = b"", False
            while not done:
                n, after, done = one(q.payloads, [after, payload_chunk(size)])
                payloads += int(n)
    except psycopg.Error as exc:
        # Chunks already committed stay done; the next prune carries on.
        raise prune_error(exc) from exc
    return PruneReport(events, payloads)


# --------------------------------------------------------------------------- asyncio


async def reap_async(store: Any, request: ReapRequest) -> ReapReport:
    """Asyncio twin of `reap`."""
    q = MaintenanceQueries(store.schema)
    reaped: list[str] = []
    after = ""
    bound = _core.pooler_local_limits(store)
    try:
        async with store.connection() as conn:
            for _ in range(request.limit):
                if bound is None:
                    row = await (await conn.execute(q.reap_next, [after])).fetchone()
                    await conn.commit()
                else:
                    async with conn.transaction():
                        await conn.execute(bound)
                        row = await (await conn.execute(q.reap_next, [after])).fetchone()
                if row is None or row[0] is None:
                    break
                after = row[0]
                if row[1]:
                    reaped.append(row[0])
    except psycopg.Error as exc:
        raise reap_error(store, exc) from exc
    return ReapReport(tuple(reaped))


async def prune_async(store: Any, request: PruneRequest) -> PruneReport:
    """Asyncio twin of `prune`."""
    q = MaintenanceQueries(store.schema)
    size = request.chunk
    events = payloads = 0
    bound = _core.pooler_local_limits(store)
    try:
        async with store.connection() as conn:

            async def one(query: bytes, args: list[Any]) -> tuple[Any, ...]:
                if bound is None:
                    return _row(await (await conn.execute(query, args)).fetchone())
                async with conn.transaction():
                    await conn.execute(bound)
                    return _row(await (await conn.execute(query, args)).fetchone())

            if request.respect_ttl:
                _check_ttl(request, await one(q.longest_ttl, []))
            cutoff = (await one(q.cutoff, [request.older_than]))[0]
            done = False
            while not done:
                n, done = await one(q.events, [cutoff, size])
                events += int(n)
            after, done = b"", False
            while not done:
                n, after, done = await one(q.payloads, [after, payload_chunk(size)])
                payloads += int(n)
    except psycopg.Error as exc:
        raise prune_error(exc) from exc
    return PruneReport(events, payloads)
