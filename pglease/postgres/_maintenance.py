# Generated from pglease/postgres/_maintenance_async.py by tools/async_to_sync.py: do not edit.
"""PostgreSQL log maintenance, asyncio source of `_maintenance.py` (see
`pglease.postgres.maintenance`)."""

from __future__ import annotations

from typing import Any

import psycopg

from ..driver.maintenance import PruneReport, PruneRequest, ReapReport, ReapRequest
from . import _core
from ._maintenance_sql import (
    MaintenanceQueries,
    _check_ttl,
    _row,
    payload_chunk,
    prune_error,
    reap_error,
)


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
