"""`pglease doctor`: is this server and schema set up the way pglease assumes?

Each check reads only (catalog views, `SHOW`, the schema's own tables), but
one: ``writes`` claims a probe resource through pglease's own SQL and rolls
back, so a server that answers reads but refuses writes (a full disk,
SQLSTATE 53100) is named with its SQLSTATE. Each ends in a verdict:

- ``ok``: as pglease expects;
- ``unknown``: could not be told from here (say, a role without
  ``pg_read_all_stats`` cannot see other sessions), said so honestly;
- ``advice``: nothing is wrong, but a production deployment would do more
  (a superuser role, a single server without a standby);
- ``warn``: works, but something can go wrong (a failover could lose a
  grant, a stalled client keeps rows locked, ...);
- ``error``: something is wrong now (commits would hang, the schema is not
  migrated, the test clock is on, ...).

The command exits 0 when nothing is wrong (ok / unknown / advice only), 1
with warnings and 2 with errors (also when the server cannot be reached).

`doctor(conn_or_store, schema)` returns the `Report`; the ``doctor``
subcommand is `pglease.cli.doctor`.
"""

from .replication import parse_sync_names
from .report import EXIT_ERROR, EXIT_OK, EXIT_WARN, HOLDBACK_WARN_SECONDS, Check, Report, Verdict
from .run import doctor

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_WARN",
    "HOLDBACK_WARN_SECONDS",
    "Check",
    "Report",
    "Verdict",
    "doctor",
    "parse_sync_names",
]
