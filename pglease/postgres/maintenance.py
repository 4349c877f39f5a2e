"""Log maintenance (`pglease.driver.maintenance`) on PostgreSQL, sync and asyncio.

`reap_async` / `prune_async` are written once (`_maintenance_async.py`); the
blocking `reap` / `prune` are generated from them (`_maintenance.py`).

The reaper calls `reap_next` (sql/0008_reap_per_lease.sql) once per
transaction; prune calls `prune_chunk` and then `gc_payloads_chunk`
(sql/functions/20_watch.sql), each chunk its own short transaction, with the
cutoff read once by the database clock so a prune ends while events keep
arriving. Behind a transaction pooler no session SET bounds a statement, so
each of those transactions sets the store's limits first
(`_core.pooler_local_limits`). Work committed before an error stays done.
"""

from __future__ import annotations

from ._maintenance import prune, reap
from ._maintenance_async import prune_async, reap_async
from ._maintenance_sql import MaintenanceQueries, payload_chunk, prune_error, reap_error

__all__ = [
    "MaintenanceQueries",
    "payload_chunk",
    "prune",
    "prune_async",
    "prune_error",
    "reap",
    "reap_async",
    "reap_error",
]
