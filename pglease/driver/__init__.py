"""The driver protocols, as typed operations.

The runtime driver protocol (`protocol`): what the fleet runtime (keeper,
acquire, rooms, elections) needs from a backend. PostgreSQL implements it in
`pglease.postgres.runtime`, SQLite in `pglease.sqlite.runtime`; the runtime
reaches a store's driver through ``store.runtime_driver()`` and nothing else.

The store driver protocol (`store`, `store_async`, with one frozen parameter
type per operation in `ops`): what the one lease store (`pglease.store`)
needs from a backend; `pglease.postgres._driver` and `pglease.sqlite._driver`
(and their asyncio sources) implement it.

Log maintenance (`maintenance`): the reaper's and prune's operations, which
the same runtime drivers implement."""

from .maintenance import (
    AsyncMaintenanceDriver,
    MaintenanceDriver,
    PruneReport,
    PruneRequest,
    ReapReport,
    ReapRequest,
)
from .protocol import (
    AsyncChangeFeed,
    AsyncHeartbeatChannel,
    AsyncRuntimeDriver,
    ChangeFeed,
    ClaimAttempt,
    ClaimRequest,
    HeartbeatChannel,
    HeartbeatItem,
    HeartbeatResult,
    HeartbeatStatus,
    LeaveQueue,
    RuntimeDriver,
)
from .store import StoreDriver
from .store_async import AsyncStoreDriver

__all__ = [
    "AsyncChangeFeed",
    "AsyncHeartbeatChannel",
    "AsyncMaintenanceDriver",
    "AsyncRuntimeDriver",
    "AsyncStoreDriver",
    "ChangeFeed",
    "ClaimAttempt",
    "ClaimRequest",
    "HeartbeatChannel",
    "HeartbeatItem",
    "HeartbeatResult",
    "HeartbeatStatus",
    "LeaveQueue",
    "MaintenanceDriver",
    "PruneReport",
    "PruneRequest",
    "ReapReport",
    "ReapRequest",
    "RuntimeDriver",
    "StoreDriver",
]
