"""pglease: PostgreSQL-backed leases with fencing generations and a durable event log."""

from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .ids import resource_id
from .payloads import MAX_PAYLOAD_BYTES, MAX_PAYLOAD_DEPTH, RawPayload
from .postgres import AsyncPostgresStore, PostgresStore
from .sqlite import AsyncSqliteStore, SqliteStore
from .types import Claim, Event, LeaseState, MutationResult, Owner, Permit, ResourceState

__all__ = [
    "AsyncPostgresStore",
    "AsyncSqliteStore",
    "Claim",
    "Event",
    "MAX_PAYLOAD_BYTES",
    "MAX_PAYLOAD_DEPTH",
    "LeaseState",
    "MutationResult",
    "Owner",
    "Permit",
    "PostgresStore",
    "RawPayload",
    "ResourceState",
    "SqliteStore",
    "resource_id",
    *_errors_all,
]
