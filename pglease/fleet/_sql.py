"""SQL of the fleet functions (migration 0005) and their argument lists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg import sql

from ..ids import token_hash
from ..types import Claim


class FleetQueries:
    """The fleet statements of one schema."""

    def __init__(self, schema: str) -> None:
        s = sql.Identifier(schema)

        def q(text: str) -> bytes:
            return sql.SQL(text).format(s=s).as_string(None).encode()

        self.heartbeat = q(
            "SELECT resource_id, status, expires_at, current_generation FROM {s}.heartbeat("
            "%s::text[], %s::bigint[], %s::bytea[], %s::text[], %s::text[], %s::float8[])"
        )
        # clock_timestamp() after the call: the database time the answer was
        # judged at, so a waiter can turn `expires_at` into a local delay without
        # comparing its own wall clock with the server's.
        self.claim = q(
            "SELECT c.claimed, c.generation, c.expires_at, c.revision, c.holder_type,"
            " c.holder_id, 0, NULL::timestamptz, clock_timestamp()"
            " FROM {s}.claim(%s, %s, %s, %s, %s::float8, NULL::bigint, NULL::timestamptz) c"
        )
        self.claim_fair = q(
            "SELECT c.claimed, c.generation, c.expires_at, c.revision, c.holder_type,"
            " c.holder_id, c.position, c.head_expires_at, clock_timestamp()"
            " FROM {s}.claim_fair(%s, %s, %s, %s, %s::float8, %s, %s::float8) c"
        )
        self.leave_queue = q("SELECT {s}.leave_queue(%s)")
        self.queue_length = q(
            "SELECT count(*) FROM {s}.lease_waiters WHERE resource_id = %s"
            " AND expires_at > clock_timestamp()"
        )


def heartbeat_args(claims: Sequence[Claim], ttls: Sequence[float]) -> list[Any]:
    """Column arrays for `heartbeat`, sorted by resource id (one lock order everywhere)."""
    order = sorted(range(len(claims)), key=lambda i: claims[i].resource_id)
    return [
        [claims[i].resource_id for i in order],
        [claims[i].generation for i in order],
        [token_hash(claims[i].token) for i in order],
        [claims[i].owner.type for i in order],
        [claims[i].owner.id for i in order],
        [float(ttls[i]) for i in order],
    ]
