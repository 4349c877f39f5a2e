"""The runtime driver protocol: what the fleet runtime (keeper, acquire, rooms,
elections) needs from a backend, as typed operations. PostgreSQL implements it
in `pglease.postgres.runtime`, SQLite in `pglease.sqlite.runtime`; the runtime
reaches a store's driver through ``store.runtime_driver()`` and nothing else."""

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

__all__ = [
    "AsyncChangeFeed",
    "AsyncHeartbeatChannel",
    "AsyncRuntimeDriver",
    "ChangeFeed",
    "ClaimAttempt",
    "ClaimRequest",
    "HeartbeatChannel",
    "HeartbeatItem",
    "HeartbeatResult",
    "HeartbeatStatus",
    "LeaveQueue",
    "RuntimeDriver",
]
