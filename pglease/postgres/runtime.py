"""The runtime driver protocol (`pglease.driver`) on PostgreSQL, sync and asyncio.

`AsyncPgRuntime` and `AsyncPgHeartbeatChannel` are written once, in
`_runtime_async.py`; the blocking `PgRuntime` / `PgHeartbeatChannel` in
`_runtime.py` are generated from them; what both share without I/O is in
`_runtime_core.py`.

The statements are the fleet functions of migration 0005 (`heartbeat`,
`claim_fair`, `leave_queue`) and the core `claim`/`release`, called exactly as
the runtime called them before it went through the protocol: one round trip
per attempt, psycopg's automatic preparation on a direct store, pooler mode's
transaction-local limits (`_core.pooler_local_limits`) behind PgBouncer.

Client deadlines: `ensure_resource`, `attempt_claim` and `leave_queue` take
a `timeout` (what an acquire has left, plus its grace): the wait for a pooled
connection ends by it, and a statement unanswered by it (or by the store's
`Limits.client_deadline`, whichever is first) has its socket shut down
(`pglease.postgres._stall`). A claim cut off that way is a
`CommitOutcomeUnknownError` with the request's token; the others are
`DatabaseUnavailableError`s (ensuring and leaving the queue are harmless to
repeat). A keeper line's `connect(timeout)` shortens its connect timeout.

Keeper lines: a keeper's heartbeats run on a dedicated connection, never a
pooled one, so application work that exhausts the pool cannot starve them.
The session is set up with plain ``SET`` statements after connecting, never
libpq startup ``options`` (PgBouncer refuses those), and is named
``pglease-keeper-<schema>`` in ``pg_stat_activity``. In pooler mode there is
no session setup and psycopg prepares nothing. `abort` shuts the socket down
(see `_abort`), so a statement stuck on a dead connection fails at once.

The same drivers implement log maintenance (`pglease.driver.maintenance`):
the reaper and prune, in `pglease.postgres.maintenance`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._runtime import PgHeartbeatChannel, PgRuntime
from ._runtime_async import AsyncPgHeartbeatChannel, AsyncPgRuntime
from ._runtime_core import (
    SESSION_SETUP,
    STATEMENT_TIMEOUT_MS,
    FleetQueries,
    _connect_kwargs,
    application_name,
    heartbeat_args,
)

if TYPE_CHECKING:
    from ..driver import (
        AsyncMaintenanceDriver,
        AsyncRuntimeDriver,
        MaintenanceDriver,
        RuntimeDriver,
    )

    # mypy checks here that both drivers implement the protocols.
    def _sync_driver(driver: PgRuntime) -> RuntimeDriver:
        return driver

    def _async_driver(driver: AsyncPgRuntime) -> AsyncRuntimeDriver:
        return driver

    def _sync_maintenance(driver: PgRuntime) -> MaintenanceDriver:
        return driver

    def _async_maintenance(driver: AsyncPgRuntime) -> AsyncMaintenanceDriver:
        return driver


__all__ = [
    "SESSION_SETUP",
    "STATEMENT_TIMEOUT_MS",
    "AsyncPgHeartbeatChannel",
    "AsyncPgRuntime",
    "FleetQueries",
    "PgHeartbeatChannel",
    "PgRuntime",
    "_connect_kwargs",
    "application_name",
    "heartbeat_args",
]
