"""What the PostgreSQL runtime drivers share without I/O: the fleet SQL, its
arguments and results, the keeper connection's settings and error wording
(`pglease.postgres.runtime` tells the whole story)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NoReturn

import psycopg
from psycopg_pool import PoolTimeout

from ..driver import (
    ClaimAttempt,
    ClaimRequest,
    HeartbeatItem,
    HeartbeatResult,
)
from ..errors import DatabaseUnavailableError, PgleaseError
from ..ids import token_hash
from ..types import Claim, Owner
from . import _core, _outcomes
from ._sqltext import for_schema

log = logging.getLogger("pglease.runtime")

#: Server-side bound on one beat (the statement never waits for locks anyway).
STATEMENT_TIMEOUT_MS = 10_000
_CONNECT_FAILED = "pglease keeper: cannot connect to PostgreSQL for heartbeats"

#: Run once on every new keeper connection. Plain SETs, not libpq startup
#: `options`: PgBouncer refuses startup parameters it does not know.
#:
#: plan_cache_mode: psycopg prepares a statement after five runs, and a
#: generic plan cannot see the heartbeat arrays' lengths. A keeper beats a few
#: leases at a time and then, once due times coalesce, thousands: measured on
#: the 2-core box, a 10,000-lease beat after seven 1-lease beats took
#: 4.4-11.6 s with the generic plan (past statement_timeout) and 260-330 ms
#: with a custom one. Planning costs well under 1 ms.
SESSION_SETUP = (
    f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}; SET plan_cache_mode = force_custom_plan"
).encode()


class FleetQueries:
    """The fleet statements of one schema."""

    def __init__(self, schema: str) -> None:
        q = for_schema(schema)
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
        self.ensure = q("SELECT {s}.ensure_resource(%s, %s)")
        self.queue_length = q(
            "SELECT count(*) FROM {s}.lease_waiters WHERE resource_id = %s"
            " AND expires_at > clock_timestamp()"
        )
        self.release = q(
            "SELECT * FROM {s}.release(%s, %s, %s, %s::bigint, %s, NULL::bigint, NULL::timestamptz)"
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


def _batch_args(batch: Sequence[HeartbeatItem]) -> list[Any]:
    return heartbeat_args([item.claim for item in batch], [item.ttl for item in batch])


def _results(rows: Sequence[Sequence[Any]]) -> list[HeartbeatResult]:
    # Each row is (resource_id, status, expires_at, current_generation).
    return [HeartbeatResult(*row) for row in rows]


def _release_args(claim: Claim) -> list[Any]:
    return [
        claim.resource_id,
        claim.owner.type,
        claim.owner.id,
        claim.generation,
        token_hash(claim.token),
    ]


def _claim_query(q: FleetQueries, request: ClaimRequest) -> tuple[bytes, list[Any]]:
    base = [
        request.resource_id,
        request.owner.type,
        request.owner.id,
        token_hash(request.token),
        request.ttl,
    ]
    if request.waiter is not None:
        return q.claim_fair, [*base, request.waiter, request.waiter_ttl]
    return q.claim, base


def _attempt(row: Sequence[Any]) -> ClaimAttempt:
    claimed, generation, expires_at, revision, htype, hid, position, head_exp, db_now = row
    holder = Owner(htype, hid) if hid is not None and htype is not None else None
    judged: datetime = db_now
    return ClaimAttempt(
        bool(claimed), generation, expires_at, revision, holder, position or 0, head_exp, judged
    )


def application_name(schema: str) -> str:
    """How a keeper's backend is named in pg_stat_activity (63 bytes at most)."""
    return f"pglease-keeper-{schema}"[:63]


def _connect_kwargs(connect_timeout: float, schema: str, pooler: bool = False) -> dict[str, Any]:
    """The keeper connection's options. In pooler mode psycopg prepares nothing
    (`prepare_threshold=None`); unnamed statements are planned for their own
    arguments, so plan_cache_mode needs no SET either."""
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(1, math.ceil(connect_timeout)),
        "application_name": application_name(schema),
        # TCP only (libpq ignores them on a Unix socket): notice a dead peer
        # while idle between beats (keepalives) and while a request stays
        # unacknowledged (tcp_user_timeout), instead of the kernel's ~15 min.
        # A peer that acknowledges but never answers (a frozen server, a
        # half-open proxy) is caught by the keeper's beat limit instead.
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": STATEMENT_TIMEOUT_MS,
        "context": _core.UTC_ADAPTERS,  # timestamps in UTC, as the store reads them
    }
    if pooler:
        kwargs["prepare_threshold"] = None
    return kwargs


def _connect_error(exc: psycopg.Error, dsn: str) -> PgleaseError:
    """A failed connect or session setup, as the holder sees it."""
    if isinstance(exc, psycopg.OperationalError):
        # Refused, unreachable, auth, "too many connections" (53300): no connection.
        return _core.unavailable(exc, _CONNECT_FAILED, dsn)
    return _core.driver_error(exc, None, dsn)


def _abort(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Make a statement blocked on `conn` fail now (from another thread, or a loop
    callback while the keeper task awaits it).

    Shuts the socket down through a duplicate descriptor: the blocked wait
    returns with end-of-file and psycopg raises OperationalError there, so the
    connection is dropped and replaced by the channel's next call. The
    descriptor itself is not closed here (it could be reused under the blocked
    thread's feet), and nothing here waits for the network.

    Not task cancellation: psycopg answers a cancelled query by sending a cancel
    request and waiting (up to 5 s, twice) for the server to confirm, which on
    a dead connection outlasts the trust window.
    """
    with contextlib.suppress(OSError, psycopg.Error):
        dup = socket.socket(fileno=os.dup(conn.pgconn.socket))
        try:
            dup.shutdown(socket.SHUT_RDWR)
        finally:
            dup.close()


def _limits(store: object) -> _core.Limits | None:
    """The store's time limits, to word its errors (None for a bare dsn/schema)."""
    limits = getattr(store, "limits", None)
    return limits if isinstance(limits, _core.Limits) else None


def _busy(exc: psycopg.Error) -> bool:
    """The claim waited out the store's lock_timeout on the lease row: nothing changed."""
    return isinstance(exc, psycopg.errors.LockNotAvailable)


def _attempt_error(
    exc: psycopg.Error, broken: bool, store: Any, request: ClaimRequest
) -> PgleaseError:
    """A claim attempt's driver error as a PgleaseError (`broken`: the connection died)."""
    if broken:
        unknown = _outcomes.claim_unknown(
            request.resource_id, request.owner, request.token, request.ttl, store.dsn
        )
        return unknown(exc)
    return _core.driver_error(exc, _limits(store), store.dsn)


def _limit(store: object, timeout: float | None) -> float | None:
    """How long a runtime call waits for an answer before its connection is shut
    down (`_stall`): the caller's `timeout` (an acquire's time left), at most the
    store's own client deadline; None when neither bounds it."""
    limits = _limits(store)
    own = limits.client_deadline if limits is not None else None
    if timeout is None:
        return own
    return timeout if own is None else min(own, timeout)


def _until(limit: float | None) -> float | None:
    """The real `time.monotonic()` instant a runtime call with `limit` must end
    by: one bound for its checkout and its round trip together (a checkout that
    took most of the limit leaves the statement only the rest)."""
    return None if limit is None else time.monotonic() + limit


def _rest(until: float | None, limit: float | None) -> float | None:
    """What is left of a call's limit once its connection is checked out (see
    `_until`); nothing left raises before anything is sent."""
    if until is None:
        return None
    left = until - time.monotonic()
    if left <= 0:
        raise DatabaseUnavailableError(
            f"no database connection became free within {limit:g} s (what the call had"
            " left of its timeout); nothing was sent"
        )
    return left


def _checkout_error(exc: psycopg.Error, store: Any, limit: float | None) -> PgleaseError:
    """A runtime call's error from checking out a connection or its statement
    (nothing was sent, or a plain error): a checkout cut short by the caller's
    `limit` says so instead of naming pool_timeout."""
    limits = _limits(store)
    pool_wait = limits.pool_timeout if limits is not None else None
    if (
        isinstance(exc, PoolTimeout)
        and limit is not None
        and (pool_wait is None or limit < pool_wait)
    ):
        return DatabaseUnavailableError(
            f"no database connection became free within {limit:g} s (what the call had"
            " left of its timeout); nothing was sent"
        )
    return _core.driver_error(exc, limits, store.dsn)


def _no_answer(exc: psycopg.Error, seconds: float) -> psycopg.OperationalError:
    """The error a call cut off by its client deadline reports (the original
    stays its cause): what happened, not the socket's end-of-file."""
    error = psycopg.OperationalError(
        f"no answer from PostgreSQL within {seconds:g} s; the connection was closed"
    )
    error.__cause__ = exc
    return error


def _stalled(exc: psycopg.Error, seconds: float, dsn: str) -> PgleaseError:
    """A call that changes nothing worth knowing (ensure, leaving the queue)
    got no answer by its deadline."""
    return DatabaseUnavailableError(
        f"no answer from PostgreSQL within {seconds:g} s; the connection was closed"
        f" ({_core._detail(exc, dsn)})"
    )


def _raise(error: PgleaseError, exc: psycopg.Error) -> NoReturn:
    raise error from _core.cause_of(error, exc)


# --------------------------------------------------------------------------- sync
