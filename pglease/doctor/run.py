"""Run every check on one connection, each in its own transaction."""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from ..postgres import PostgresStore
from ..validation import check_schema_name
from .checks import (
    check_clock,
    check_idle_timeout,
    check_migrations,
    check_privileges,
    check_server,
    check_test_clock,
)
from .holdback import check_holdback
from .replication import check_pooler, check_replication
from .report import Check, Conn, Report
from .writes import check_writes


def doctor(
    conn_or_store: Conn | PostgresStore, schema: str | None = None, *, pooler: bool | None = None
) -> Report:
    """Run every check on a connection (or a store's pooled one) for `schema`.

    `schema` defaults to the store's schema, else ``pglease``. `pooler` says
    whether the client runs in pooler mode (a store's own setting by default;
    None: not known), which the `pooler` check reports. Nothing is written:
    the `writes` check's claim is rolled back (`pglease.doctor.writes`);
    each check runs in its own transaction (a savepoint when the connection is
    not in autocommit), so one failing check does not stop the others: it is
    reported as that check's error.
    """
    if isinstance(conn_or_store, PostgresStore):
        with conn_or_store.connection() as conn:
            mode = conn_or_store.pooler if pooler is None else pooler
            return doctor(conn, schema or conn_or_store.schema, pooler=mode)
    schema = check_schema_name(schema or "pglease")
    report = Report(schema)
    conn = conn_or_store
    for name, run in _CHECKS:
        try:
            with conn.transaction():
                found = (
                    check_pooler(conn, schema, pooler) if name == "pooler" else run(conn, schema)
                )
        except psycopg.Error as exc:
            if conn.broken:
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            found = [Check(name, "error", f"the check itself failed: {first}")]
        report.checks.extend(found)
    return report


_CHECKS: list[tuple[str, Callable[[Conn, str], list[Check]]]] = [
    ("server_version", check_server),
    ("synchronous_standby", check_replication),
    ("pooler", check_pooler),
    ("migrations", check_migrations),
    ("role", check_privileges),
    ("clock_offset", check_clock),
    ("idle_in_transaction_session_timeout", check_idle_timeout),
    ("test_clock", check_test_clock),
    ("writes", check_writes),
    ("watch_holdback", check_holdback),
]
