"""The PostgreSQL maintenance statements and error wording (`maintenance` tells
the story): what the reaper and prune of both flavours share without I/O."""

from __future__ import annotations

from typing import Any

import psycopg

from ..driver.maintenance import (
    PruneRequest,
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
