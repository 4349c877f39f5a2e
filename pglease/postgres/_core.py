"""What every PostgreSQL part of pglease shares: error translation, time limits,
pooler mode and connection settings.

The store driver's statements are in `_queries`, the prepared fast path in
`_fastpath`, and the wording of unknown commit outcomes in `_outcomes`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import psycopg.adapt
from psycopg.abc import Buffer
from psycopg.types.datetime import TimestamptzBinaryLoader, TimestamptzLoader
from psycopg_pool import PoolClosed, PoolTimeout

# Backend-neutral row parsing lives in `pglease._common`; the drivers call it from here.
from .._common import parse_event as parse_event
from .._common import parse_resource as parse_resource
from ..errors import (
    ClockOverrideError,
    CommitOutcomeUnknownError,
    DatabaseError,
    DatabaseUnavailableError,
    DiskFullError,
    EventOrderError,
    InsufficientResourcesError,
    InvalidBatchError,
    InvalidEventTypeError,
    InvalidKeyError,
    InvalidOwnerError,
    InvalidPayloadError,
    InvalidResourceIdError,
    InvalidResourceTypeError,
    InvalidRevisionError,
    InvalidTokenError,
    InvalidTTLError,
    LeaseExpiredError,
    LeaseLostError,
    LockTimeoutError,
    PayloadConflictError,
    PermissionDeniedError,
    PgleaseError,
    PoolerModeError,
    PoolExhaustedError,
    ResourceLeasedError,
    StaleResourceError,
    StatementTimeoutError,
    StoreClosedError,
    UnknownResourceError,
    ValidationError,
)
from ..migrations import MigrationState
from ..types import Owner
from ..validation import check_positive_seconds

DEFAULT_SCHEMA = "pglease"

_ERRORS: dict[str, type[PgleaseError]] = {
    "PGL01": UnknownResourceError,
    "PGL02": StaleResourceError,
    "PGL03": LeaseLostError,
    "PGL04": LeaseExpiredError,
    "PGL05": ResourceLeasedError,
    "PGL06": PayloadConflictError,
    # The SQL functions' own input checks (sql/functions/10_core.sql): the same
    # classes as pglease/validation.py raises before anything is sent.
    "PGL10": ClockOverrideError,
    "PGL11": InvalidTTLError,
    "PGL12": InvalidResourceIdError,
    "PGL13": InvalidOwnerError,
    "PGL14": InvalidTokenError,
    "PGL15": InvalidRevisionError,
    "PGL16": InvalidResourceTypeError,
    "PGL17": InvalidKeyError,
    "PGL18": InvalidEventTypeError,
    "PGL19": InvalidPayloadError,
    "PGL20": ValidationError,
    "PGL21": InvalidBatchError,  # sql/functions/15_batch.sql
}


def lease_error(code: str, message: str) -> LeaseLostError:
    """A batch item's error (sql/functions/15_batch.sql reports the SQLSTATE and
    message a single call raised): PGL04 expired, else PGL03 not current."""
    return LeaseExpiredError(message) if code == "PGL04" else LeaseLostError(message)


# `_bump`'s order guard (sql/0002, 0006) raises a serialization failure whose
# message starts with this. Only that one is mapped: any other 40001 (say from
# the caller's own SQL under SERIALIZABLE) is not pglease's to name.
_SERIALIZATION_FAILURE = "40001"
_INSUFFICIENT_PRIVILEGE = "42501"
_LOCK_NOT_AVAILABLE = "55P03"
_QUERY_CANCELED = "57014"
_EVENT_ORDER_PREFIX = "event order:"


def unavailable(
    exc: psycopg.Error,
    what: str = "cannot connect to PostgreSQL",
    dsn: str | None = None,
) -> DatabaseUnavailableError | PoolerModeError:
    """One line naming the server (libpq's first line has host and port), no password."""
    if (hint := pooler_hint(exc)) is not None:
        return PoolerModeError(f"{what}: {_detail(exc, dsn)}{hint}", sqlstate=exc.diag.sqlstate)
    return DatabaseUnavailableError(f"{what}: {_detail(exc, dsn)}")


class PoolConnectErrors(logging.Handler):
    """The last connection error of one pool while it opens.

    psycopg_pool retries a failed connection in the background, logs the error
    (`error connecting in 'name': ...` on the `psycopg.pool` logger) and, when
    `wait()` runs out, closes the pool and raises a bare PoolTimeout. The logged
    error (e.g. `too many clients already`) is what an operator needs; it is
    kept here and put into the store's error. Use as a context manager."""

    def __init__(self, pool_name: str) -> None:
        super().__init__(logging.WARNING)
        self.pool_name = pool_name
        self.last: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        named = isinstance(args, tuple) and len(args) == 2 and args[0] == self.pool_name
        if named and isinstance(args, tuple) and isinstance(args[1], BaseException):
            self.last = args[1]

    def __enter__(self) -> PoolConnectErrors:
        logging.getLogger("psycopg.pool").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("psycopg.pool").removeHandler(self)


def pool_unavailable(
    exc: psycopg.Error, cause: BaseException | None, dsn: str | None = None
) -> DatabaseUnavailableError | PoolerModeError:
    """The pool did not fill in time: its own message, then the last error its
    connection attempts got (`PoolConnectErrors`), when there was one."""
    if isinstance(cause, psycopg.Error):
        return unavailable(cause, f"cannot open the connection pool ({_detail(exc)})", dsn)
    if cause is not None:
        return DatabaseUnavailableError(
            f"cannot open the connection pool ({_detail(exc)}): {_detail(cause, dsn)}"
        )
    return unavailable(exc, "cannot open the connection pool", dsn)


def _detail(exc: BaseException, dsn: str | None = None) -> str:
    from ..dsn import redact_text  # here: pglease.dsn imports the store's errors module

    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return redact_text("; ".join(lines) or "no detail", dsn)


def require_migrated(state: MigrationState) -> None:
    """Refuse to open a store on a schema with pending work (auto_migrate=False)."""
    if not state.up_to_date:
        # A schema with no pglease tables is most often a typo in its name: the
        # error says so, and how to create them; auto_migrate is beside the point.
        reason = "the store was opened without auto_migrate" if state.applied else None
        raise state.not_migrated_error(reason)


def translate(exc: psycopg.Error, limits: Limits | None = None) -> PgleaseError | None:
    """Map an error raised by a pglease SQL function to its Python class; None for
    anything else.

    The store's time limits (55P03, 57014) are mapped only with `limits`, on the
    store's own calls: other callers of this (the watch hub, fleet acquire)
    retry or report on the driver's errors and keep seeing those.
    """
    sqlstate = exc.diag.sqlstate
    message = exc.diag.message_primary or str(exc)
    if sqlstate == _SERIALIZATION_FAILURE:
        if message.startswith(_EVENT_ORDER_PREFIX):
            return EventOrderError(message)
        return None
    if sqlstate == _INSUFFICIENT_PRIVILEGE:
        return PermissionDeniedError(
            f"{message} (the role model: a client role claims, renews, releases, mutates and"
            " watches; a reader reads; only the schema's owner migrates and prunes)"
        )
    if limits is not None:
        if sqlstate == _LOCK_NOT_AVAILABLE:
            waited = _seconds(limits.lock_timeout, "lock_timeout")
            return LockTimeoutError(f"resource busy: waited {waited} for its lock ({message})")
        # 57014 is also an explicit cancel (pg_cancel_backend): only the server's own
        # statement-timeout message is named as one; other cancels stay DatabaseError.
        if sqlstate == _QUERY_CANCELED and "statement timeout" in message:
            limit = _seconds(limits.statement_timeout, "statement_timeout")
            return StatementTimeoutError(
                f"statement cancelled after {limit}; nothing was committed ({message})",
                sqlstate=sqlstate,
            )
    cls = _ERRORS.get(sqlstate or "")
    if cls is None:
        return None
    if cls is StaleResourceError:
        detail = exc.diag.message_detail
        return StaleResourceError(message, actual=int(detail) if detail else None)
    return cls(message)


def _seconds(value: float | None, setting: str) -> str:
    return f"{setting}={value:g} s" if value is not None else setting


#: Seconds past statement_timeout that a call waits for the server's answer on a
#: path that went silent (a network stall, a hung server) before it closes the
#: connection (`Limits.client_deadline`).
CLIENT_GRACE = 5.0

# Server-side time limits: PostgreSQL takes whole milliseconds up to INT_MAX.
_MAX_LIMIT_SECONDS = 2_147_483


@dataclass(frozen=True)
class Limits:
    """A store's waits: server-side statement and lock limits, pool checkout."""

    statement_timeout: float | None
    lock_timeout: float | None
    pool_timeout: float
    max_size: int

    @classmethod
    def of(
        cls,
        statement_timeout: object,
        lock_timeout: object,
        pool_timeout: object,
        max_size: int,
    ) -> Limits:
        """Checked limits (ValidationError for negative, NaN, infinite or huge values)."""
        return cls(
            _server_limit(statement_timeout, "statement_timeout"),
            _server_limit(lock_timeout, "lock_timeout"),
            check_positive_seconds(pool_timeout, "pool_timeout"),
            max_size,
        )

    @property
    def local_settings(self) -> bytes | None:
        """The same limits as SET LOCAL: pooler mode runs them at the start of each
        transaction pglease opens, since a session SET would stay on whichever
        server connection the pooler happened to pick."""
        sets = self.settings
        return sets.replace(b"SET ", b"SET LOCAL ") if sets is not None else None

    @property
    def local_config(self) -> bytes | None:
        """The same limits as one `set_config(..., true)` statement (transaction-local,
        like SET LOCAL), for a pipeline: the extended protocol takes one statement
        per message."""
        sets = [
            f"set_config('{name}', '{math.ceil(value * 1000)}', true)"
            for name, value in (
                ("statement_timeout", self.statement_timeout),
                ("lock_timeout", self.lock_timeout),
            )
            if value is not None
        ]
        return ("SELECT " + ", ".join(sets)).encode() if sets else None

    @property
    def settings(self) -> bytes | None:
        """The SET statements every store connection runs once (None: nothing to set).

        Plain SETs after connecting, not libpq `options`: PgBouncer refuses
        startup options it does not know."""
        sets = [
            f"SET {name} = {math.ceil(value * 1000)}"
            for name, value in (
                ("statement_timeout", self.statement_timeout),
                ("lock_timeout", self.lock_timeout),
            )
            if value is not None
        ]
        return "; ".join(sets).encode() if sets else None

    @property
    def client_deadline(self) -> float | None:
        """How long the client waits for the answer of any one round trip on a
        store connection (a statement, BEGIN, COMMIT; `StoreConnection.wait`)
        before it gives the connection up: `statement_timeout` (the server's
        own bound on the statement, lock waits included) plus `CLIENT_GRACE`
        for the round trip and the server's error on its way back. None
        without a statement_timeout."""
        if self.statement_timeout is None:
            return None
        return self.statement_timeout + CLIENT_GRACE

    def pool_exhausted(self) -> PoolExhaustedError:
        return PoolExhaustedError(
            f"no database connection became free within pool_timeout={self.pool_timeout:g} s"
            f" (max_size={self.max_size}: all in use, or the server accepts no new ones)"
        )


def _server_limit(value: object, what: str) -> float | None:
    if value is None:
        return None
    # 0 would mean "no limit" to PostgreSQL: ask for None instead of surprising.
    seconds = check_positive_seconds(value, what)
    if seconds > _MAX_LIMIT_SECONDS:
        raise ValidationError(f"{what} must be at most {_MAX_LIMIT_SECONDS} s (or None)")
    return seconds


def pooler_local_limits(store: object) -> bytes | None:
    """Pooler mode: the store's limits as one `set_config(..., true)` statement,
    to run first in a transaction pglease opens (no session SET bounds a call
    behind a transaction pooler). None for a direct store or another store."""
    limits = getattr(store, "limits", None)
    if not isinstance(limits, Limits) or not getattr(store, "pooler", False):
        return None
    return limits.local_config


class _UtcTimestamptzLoader(TimestamptzLoader):
    def load(self, data: Buffer) -> datetime:
        return super().load(data).astimezone(UTC)


class _UtcTimestamptzBinaryLoader(TimestamptzBinaryLoader):
    def load(self, data: Buffer) -> datetime:
        return super().load(data).astimezone(UTC)


#: psycopg's adapters, except that a timestamptz is read as a datetime in
#: `datetime.UTC`, whatever the server's TimeZone: psycopg would give a
#: ZoneInfo of that setting, so the same instant read by `get` and returned by
#: `claim` (built from integer microseconds, in UTC) had different tzinfo
#: objects, and another server's setting showed through.
UTC_ADAPTERS = psycopg.adapt.AdaptersMap(psycopg.adapters)
UTC_ADAPTERS.register_loader("timestamptz", _UtcTimestamptzLoader)
UTC_ADAPTERS.register_loader("timestamptz", _UtcTimestamptzBinaryLoader)


def connect_kwargs(schema: str, pooler: bool = False) -> dict[str, Any]:
    """Connection options of every store connection.

    `fallback_application_name` names the store in pg_stat_activity unless the
    DSN or PGAPPNAME already gives an application_name. In pooler mode psycopg
    never prepares statements (`prepare_threshold=None`): a named statement lives
    on one server connection and the pooler hands out another one next time.
    Timestamps are read in UTC (`UTC_ADAPTERS`)."""
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "fallback_application_name": f"pglease-{schema}",
        "context": UTC_ADAPTERS,
    }
    if pooler:
        kwargs["prepare_threshold"] = None
    return kwargs


#: The environment switch for pooler mode (README "Deployment: PgBouncer").
POOLER_ENV = "PGLEASE_POOLER"


def pooler_mode(pooler: object) -> bool:
    """The store's `pooler` option, or ``PGLEASE_POOLER=transaction`` from the
    environment (either one turns pooler mode on)."""
    if not isinstance(pooler, bool):
        raise ValidationError(f"pooler must be True or False, got {type(pooler).__name__}")
    value = os.environ.get(POOLER_ENV, "").strip().lower()
    if value in ("", "0", "off", "none", "session"):
        return pooler
    if value == "transaction":
        return True
    raise ValidationError(f"{POOLER_ENV} must be 'transaction' (or empty/unset), got {value!r}")


_POOLER_HINT = (
    " (this looks like a transaction-pooling pooler such as PgBouncer: open the store"
    f' with pooler=True or set {POOLER_ENV}=transaction; README "Deployment: PgBouncer")'
)


def pooler_hint(exc: psycopg.Error) -> str | None:
    """The advice to switch pooler mode on, for the errors a transaction pooler
    causes when it is off; None for any other error."""
    text = str(exc)
    if exc.diag.sqlstate == "26000" and "prepared statement" in text:
        return _POOLER_HINT
    if "unsupported startup parameter" in text:
        return _POOLER_HINT
    return None


# Connection trouble the server reports before it hangs up (class 08: connection
# exception; 57P01-57P03: shutdown, crash, not accepting connections yet).
_CONNECTION_STATES = ("08", "57P")


def driver_error(
    exc: psycopg.Error, limits: Limits | None = None, dsn: str | None = None
) -> PgleaseError:
    """Any driver error as a PgleaseError: pglease's own class, a time limit, a
    connection problem (DatabaseUnavailableError) or DatabaseError."""
    if isinstance(exc, PoolTimeout):
        if limits is not None:
            return limits.pool_exhausted()
        return PoolExhaustedError(f"no database connection became free: {_detail(exc, dsn)}")
    if isinstance(exc, PoolClosed):
        return StoreClosedError("the store is closed")
    known = translate(exc, limits)
    if known is not None:
        return known
    sqlstate = exc.diag.sqlstate
    if (hint := pooler_hint(exc)) is not None:
        return PoolerModeError(f"PostgreSQL error: {_detail(exc, dsn)}{hint}", sqlstate=sqlstate)
    if isinstance(exc, psycopg.OperationalError) and (
        sqlstate is None or sqlstate.startswith(_CONNECTION_STATES) or sqlstate == _TOO_MANY
    ):
        return unavailable(exc, "connection to PostgreSQL failed", dsn)
    if sqlstate is not None and sqlstate.startswith("53"):
        return insufficient_resources(exc, dsn)
    code = f" {sqlstate}" if sqlstate else ""
    return DatabaseError(f"PostgreSQL error{code}: {_detail(exc, dsn)}", sqlstate=sqlstate)


_TOO_MANY = "53300"
_DISK_FULL = "53100"
#: What ran out, by SQLSTATE (class 53, "insufficient resources").
_RAN_OUT = {
    _DISK_FULL: "the server's disk is full",
    "53200": "the server is out of memory",
    "53400": "a server configuration limit was exceeded",
}


def insufficient_resources(
    exc: psycopg.Error, dsn: str | None = None
) -> InsufficientResourcesError:
    """A class-53 error in one line: what ran out, the server's own first line
    (for a full disk, the file it could not extend), and that nothing was
    committed (an ERROR rolls its transaction back)."""
    sqlstate = exc.diag.sqlstate or ""
    what = _RAN_OUT.get(sqlstate, "the server ran out of a resource")
    primary = exc.diag.message_primary
    detail = _detail(exc if primary is None else Exception(primary), dsn)
    cls = DiskFullError if sqlstate == _DISK_FULL else InsufficientResourcesError
    return cls(f"{what} (SQLSTATE {sqlstate}): {detail}; nothing was committed", sqlstate=sqlstate)


# pglease's own refusals: the SQL error behind them adds nothing for the caller.
_OWN_CLASSES = (*_ERRORS.values(), EventOrderError, PermissionDeniedError)


def cause_of(error: PgleaseError, exc: psycopg.Error) -> psycopg.Error | None:
    """The driver error to keep as `__cause__` of `error` (None for pglease's own)."""
    return None if type(error) in _OWN_CLASSES else exc


NOTHING_COMMITTED = "connection to PostgreSQL lost before COMMIT; nothing was committed"


def lost(
    exc: psycopg.Error, dsn: str | None = None, what: str = "connection to PostgreSQL lost"
) -> DatabaseUnavailableError:
    """A connection that broke while nothing was committed (or only read)."""
    return DatabaseUnavailableError(f"{what}: {_detail(exc, dsn)}")


def stalled(exc: psycopg.Error, dsn: str | None = None) -> DatabaseUnavailableError:
    """A read that got no answer by the client deadline (`exc`, a StalledError,
    says within how long): it changed nothing."""
    return DatabaseUnavailableError(f"{_detail(exc, dsn)} (a read: nothing was changed)")


def outcome_unknown(
    exc: psycopg.Error,
    operation: str,
    resource_id: str,
    check: str,
    dsn: str | None = None,
    *,
    owner: Owner | None = None,
    token: str | None = None,
) -> CommitOutcomeUnknownError:
    """A write was sent and then the connection broke: say so, and how to find out."""
    return CommitOutcomeUnknownError(
        f"connection to PostgreSQL lost during {operation} of {resource_id}: it may or may"
        f" not have been committed; {check} ({_detail(exc, dsn)})",
        operation=operation,
        resource_id=resource_id,
        owner=owner,
        token=token,
    )
