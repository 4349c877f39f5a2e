"""pglease: PostgreSQL-backed leases with fencing generations and a durable event log."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from . import runtime as _runtime  # noqa: F401  (registers the runtime behind SqliteStore.hold)
from . import watch as _watch  # noqa: F401  (registers the watchers behind store.watch)
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .ids import resource_id
from .payloads import MAX_PAYLOAD_BYTES, MAX_PAYLOAD_DEPTH, RawPayload
from .postgres import AsyncPostgresStore, PostgresStore
from .sqlite import AsyncSqliteStore, SqliteStore
from .types import Claim, Event, LeaseState, MutationResult, Owner, Permit, ResourceState
from .validation import MAX_BATCH

try:
    __version__: str = _version("pglease")
except _PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0.1.0"

__all__ = [
    "AsyncPostgresStore",
    "AsyncSqliteStore",
    "Claim",
    "Event",
    "MAX_BATCH",
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
    "__version__",
    "resource_id",
    *_errors_all,
]
