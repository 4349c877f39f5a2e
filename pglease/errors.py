"""One error hierarchy for everything pglease raises on purpose.

Every exception a caller is expected to handle derives from `PgleaseError`.
Bad input raises a `ValidationError` subclass (also a `ValueError`) before
anything is written; conflicts with the database state raise a
`ConflictError` subclass after the transaction was rolled back.
"""

from __future__ import annotations

__all__ = [
    "ConflictError",
    "DatabaseUnavailableError",
    "EmbeddedPostgresError",
    "EventOrderError",
    "InvalidCursorError",
    "InvalidEventTypeError",
    "InvalidKeyError",
    "InvalidOwnerError",
    "InvalidPayloadError",
    "InvalidResourceIdError",
    "InvalidResourceTypeError",
    "InvalidRevisionError",
    "InvalidSchemaNameError",
    "InvalidTTLError",
    "InvalidTokenError",
    "LeaseExpiredError",
    "LeaseLostError",
    "LeaseMismatchError",
    "MigrationChecksumError",
    "MigrationError",
    "PayloadConflictError",
    "PayloadTooLargeError",
    "PgleaseError",
    "ResourceLeasedError",
    "SchemaNotMigratedError",
    "StaleResourceError",
    "UnknownResourceError",
    "ValidationError",
]


class PgleaseError(Exception):
    """Root of every error pglease raises deliberately."""


# --- bad input -------------------------------------------------------------


class ValidationError(PgleaseError, ValueError):
    """An argument is malformed; nothing was changed."""


class InvalidResourceTypeError(ValidationError):
    """A resource type is not an identifier of the documented shape."""


class InvalidKeyError(ValidationError):
    """A resource key is empty, too long, or contains NUL."""


class InvalidResourceIdError(ValidationError):
    """A resource id is not of the form `type-<40 hex>`."""


class InvalidOwnerError(ValidationError):
    """An owner type or owner id is malformed."""


class InvalidTTLError(ValidationError):
    """A TTL is not a positive, finite number within bounds."""


class InvalidTokenError(ValidationError):
    """A lease token does not have the shape pglease issues."""


class InvalidRevisionError(ValidationError):
    """An expected revision is negative or not an integer."""


class InvalidEventTypeError(ValidationError):
    """An event type is malformed or uses the reserved `lease.` prefix."""


class InvalidPayloadError(ValidationError):
    """A payload is not canonical-JSON serialisable (NaN, non-str keys, ...)."""


class PayloadTooLargeError(InvalidPayloadError):
    """A payload's canonical JSON exceeds the size limit."""


class InvalidCursorError(ValidationError):
    """An event cursor is not one pglease produced."""


class InvalidSchemaNameError(ValidationError):
    """A schema name is not a plain lowercase identifier."""


class LeaseMismatchError(ValidationError):
    """A permit carries a lease of a different resource."""


class InvalidBatchError(ValidationError):
    """A batch (`claim_many`, `renew_many`, `release_many`) is empty, larger than
    `MAX_BATCH` items, not a sequence, or names one resource more than once."""


# --- state conflicts ----------------------------------------------------------


class UnknownResourceError(PgleaseError, LookupError):
    """The resource id does not exist (call `ensure_resource` first)."""


class ConflictError(PgleaseError):
    """The database state does not allow the operation; nothing was changed."""


class StaleResourceError(ConflictError):
    """The expected revision differs from the resource's current revision."""

    def __init__(self, message: str, *, expected: int | None = None, actual: int | None = None):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class LeaseLostError(ConflictError):
    """The lease is no longer current: released, taken over, or wrong token."""


class LeaseExpiredError(LeaseLostError):
    """The lease is still recorded but its TTL ran out (renew refused)."""


class ResourceLeasedError(ConflictError):
    """An unleased write was attempted while another holder's lease is live."""


class PayloadConflictError(ConflictError):
    """A stored payload has the same sha256 but different bytes."""


class EventOrderError(ConflictError):
    """A transaction would have written a resource's event out of order; retry it.

    Watchers read the log in transaction-id order, so revision n+1 of a
    resource must not come from a transaction with a smaller id than revision
    n. pglease's own calls lock the lease row before writing anything, so they
    never trip this; it happens when a caller runs pglease's SQL functions
    inside its own transaction after that transaction already wrote something
    (took its id) and another writer of the same resource committed meanwhile.
    The transaction was refused (SQLSTATE 40001, a serialization failure):
    roll back and retry the whole transaction, calling the pglease function
    first.
    """


# --- infrastructure -----------------------------------------------------------


class MigrationError(PgleaseError):
    """Applying or verifying schema migrations failed."""


class MigrationChecksumError(MigrationError):
    """An applied migration's file changed since it was applied."""


class SchemaNotMigratedError(MigrationError):
    """The schema lacks pglease's tables or is behind on migrations, and they were
    not applied here (a read-only command, ``auto_migrate=False``, or a role that
    may not apply them).

    The message is one line naming the schema and the command to run; a schema
    with no pglease tables at all is most often a typo in its name, so that is
    said first. `.schema`, `.pending` (labels of the missing migrations and
    function set, in order), `.has_tables` and `.reason` keep the detail.
    """

    def __init__(
        self, schema: str, pending: tuple[str, ...], *, has_tables: bool, reason: str | None
    ):
        self.schema = schema
        self.pending = pending
        self.has_tables = has_tables
        self.reason = reason
        why = f" ({reason})" if reason else ""
        create = f"`pglease --schema {schema} migrate`"
        if not has_tables:
            message = (
                f"schema {schema!r} has no pglease tables{why}: check the schema name"
                f" (--schema, PGLEASE_SCHEMA), or create them with {create}"
            )
        else:
            work = ", ".join(pending)
            if len(pending) > 3:
                work = f"{len(pending)} updates ({pending[0]} to {pending[-1]})"
            message = f"schema {schema!r} needs {work}{why}; run {create} as the schema's owner"
        super().__init__(message)


class EmbeddedPostgresError(PgleaseError):
    """The embedded PostgreSQL server could not be started."""


class DatabaseUnavailableError(PgleaseError):
    """PostgreSQL could not be reached (bad DSN, server down, auth refused)."""


# --- watchers -------------------------------------------------------------------


class WatchError(PgleaseError):
    """A watcher cannot continue."""


class CursorExpiredError(WatchError):
    """The cursor is older than the pruned horizon: events after it were deleted.

    Like etcd after a compaction: the watcher must resync (for example list the
    resources and watch from ``"now"``); resuming silently would lose events.
    """


class WatchClosedError(WatchError):
    """The watcher was closed."""


__all__ += ["CursorExpiredError", "WatchClosedError", "WatchError"]


# --- fleet runtime ----------------------------------------------------------------


class InvalidTimingError(ValidationError):
    """Heartbeat timing settings are unsafe (interval not well below the TTL, margin
    not below the interval, ...)."""


class AcquireTimeoutError(PgleaseError, TimeoutError):
    """A blocking acquire gave up after its timeout; nothing was left behind."""


__all__ += ["AcquireTimeoutError", "InvalidTimingError"]


# --- trust ------------------------------------------------------------------------


class ClockOverrideError(ValidationError):
    """A caller-supplied time (``now=``) was refused: the schema judges expiry by the
    database clock only. Only the schema's owner can switch its test clock on."""


class InvalidRoleError(ValidationError):
    """A role named for a grant does not exist, or the grant was not permitted."""


class PermissionDeniedError(PgleaseError):
    """The database role may not do this (see the role model: owner, client, reader)."""


__all__ += ["ClockOverrideError", "InvalidRoleError", "PermissionDeniedError"]


# --- connection settings -------------------------------------------------------------


class InvalidDsnError(ValidationError):
    """A PostgreSQL DSN cannot be parsed (the message shows it without its password)."""


class ConfigurationError(ValidationError):
    """The configuration names something pglease does not know: an unknown
    ``PGLEASE_*`` environment variable (a misspelt ``PGLEASE_DSN`` must not fall
    back to the embedded server), or, for a CLI command that writes, a schema
    that ``pglease migrate`` never set up. Nothing was changed."""


__all__ += ["ConfigurationError", "InvalidDsnError"]


# --- watcher health --------------------------------------------------------------------


class WatchFailedError(WatchError):
    """A watcher's reads keep failing: an error that cannot heal (privileges, a
    missing schema or table, a pooler that refuses LISTEN) or one that
    persisted past the retry window. ``__cause__`` is the last error; the
    message names it. Events are not lost: resume from `watcher.cursor` once
    the problem is fixed."""


__all__ += ["WatchFailedError"]


# --- cursor identity ------------------------------------------------------------------


class ForeignCursorError(WatchError):
    """The cursor is not a position in this store's event log.

    Resuming from it would skip events or deliver other content under revisions
    already seen. Resync: list the resources and watch from ``"now"``.
    """


class CursorAheadError(ForeignCursorError):
    """The cursor lies beyond the end of this store's log (a newer copy of the log,
    another server, or a primary whose latest events were lost in a failover)."""


class HistoryDivergedError(ForeignCursorError):
    """The event the cursor was taken after is missing here or is another event: the
    log it came from is not this one (another schema or server, a restored backup,
    an asynchronous failover that lost events)."""


__all__ += ["CursorAheadError", "ForeignCursorError", "HistoryDivergedError"]


# --- driver and connection failures ------------------------------------------------


class DatabaseError(PgleaseError):
    """PostgreSQL (or the driver) reported an error pglease has no own class for.

    `.sqlstate` is the server's code when there is one; the driver's exception is
    kept as `__cause__`.
    """

    def __init__(self, message: str, *, sqlstate: str | None = None):
        super().__init__(message)
        self.sqlstate = sqlstate


class StatementTimeoutError(DatabaseError):
    """The server cancelled a statement that ran past the store's `statement_timeout`
    (SQLSTATE 57014); its transaction was rolled back, nothing was committed."""


class PoolerModeError(DatabaseError):
    """The server side behaves like a transaction-pooling pooler (PgBouncer) and
    the store was not opened in pooler mode: a named prepared statement vanished
    (SQLSTATE 26000) or a startup parameter was refused. Open the store with
    ``pooler=True`` (or set ``PGLEASE_POOLER=transaction``); README "Deployment:
    PgBouncer"."""


class LockTimeoutError(ConflictError):
    """A lock was not granted within the store's `lock_timeout` (SQLSTATE 55P03): the
    resource is busy, say a lease row locked by a stalled transaction; nothing
    was changed."""


class CommitOutcomeUnknownError(DatabaseUnavailableError):
    """The connection broke after a write was sent: it may or may not have committed.

    Read the resource (`get(resource_id)`: its revision and lease) to find out.
    `.operation` is the call (claim, renew, release, mutate), `.resource_id` the
    resource; for a claim `.owner` and `.token` are the ones sent, so a claim
    that did commit (the lease shows that owner) can be rebuilt or released.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        resource_id: str,
        owner: object = None,
        token: str | None = None,
    ):
        super().__init__(message)
        self.operation = operation
        self.resource_id = resource_id
        self.owner = owner
        self.token = token


class BatchOutcomeUnknownError(CommitOutcomeUnknownError):
    """The connection broke after a batch was sent: either every item's outcome
    committed (one transaction) or none did.

    `.resource_ids` are the batch's resources in the order given; for
    `claim_many`, `.tokens` are the tokens sent (in that order), so a claim
    that did commit (the lease shows that owner) can be rebuilt or released.
    `.resource_id` is the first of them.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        resource_ids: tuple[str, ...],
        owner: object = None,
        tokens: tuple[str, ...] | None = None,
    ):
        super().__init__(message, operation=operation, resource_id=resource_ids[0], owner=owner)
        self.resource_ids = resource_ids
        self.tokens = tokens


__all__ += ["BatchOutcomeUnknownError", "InvalidBatchError"]


class InsufficientResourcesError(DatabaseError):
    """The server ran out of a resource (SQLSTATE class 53): out of memory (53200),
    a configuration limit (53400), or the disk (53100, `DiskFullError`).

    The statement failed with an ERROR, so its transaction was rolled back:
    nothing was committed. It does not heal by itself; the message names what
    ran out. (A server that cannot take more connections, 53300, is
    `DatabaseUnavailableError`: nothing could be sent.)
    """


class DiskFullError(InsufficientResourcesError):
    """The server could not write a file (SQLSTATE 53100, "could not extend file
    ...: No space left on device"): the disk or tablespace holding the schema's
    tables is full. Nothing was committed; every write fails until space is
    freed, reads still work. `pglease doctor` and `pglease status` report it."""


class PoolExhaustedError(DatabaseUnavailableError):
    """No connection of the store's pool became free within `pool_timeout`: all
    `max_size` are in use, or the server accepts no new ones."""


class StoreClosedError(DatabaseUnavailableError):
    """The store is closed (or, asyncio, not opened yet): it has no connection to
    the database. A DatabaseUnavailableError, as psycopg_pool's PoolClosed was an
    OperationalError, so code that retries or gives up on those treats it alike."""


__all__ += [
    "CommitOutcomeUnknownError",
    "DatabaseError",
    "DiskFullError",
    "InsufficientResourcesError",
    "LockTimeoutError",
    "PoolExhaustedError",
    "PoolerModeError",
    "StatementTimeoutError",
    "StoreClosedError",
]


# --- SQLite files ------------------------------------------------------------------------


class SqliteFileError(DatabaseUnavailableError):
    """The SQLite file cannot be opened or used as a pglease store.

    A `DatabaseUnavailableError`, like an unreachable PostgreSQL server, so
    callers can handle both backends with one except clause. The message names
    the file and SQLite's result code; the sqlite3 exception is `__cause__`.
    """


class SqliteCorruptError(SqliteFileError):
    """The file is not a SQLite database, or SQLite found it damaged
    (SQLITE_NOTADB, SQLITE_CORRUPT): no retry heals it; restore or replace it."""


class StoreBusyError(SqliteFileError, LockTimeoutError):
    """Another connection held the SQLite file's write lock (or kept it busy) past
    `busy_timeout`: the SQLite twin of `LockTimeoutError`; nothing was changed."""


__all__ += ["SqliteCorruptError", "SqliteFileError", "StoreBusyError"]


# --- metrics -----------------------------------------------------------------------------


class MetricsError(PgleaseError):
    """The metrics endpoint cannot be served (the port is taken, the address is
    not this host's), or metrics were already enabled on another registry."""


class MetricsUnavailableError(MetricsError, ImportError):
    """`pglease.metrics` needs prometheus-client: ``pip install 'pglease[metrics]'``."""


__all__ += ["MetricsError", "MetricsUnavailableError"]
