"""Does a write go through? A claim through pglease's own SQL, always rolled back.

Reads cannot tell: a server whose disk is full (SQLSTATE 53100), that is out
of memory, or that refuses writes answers every read as usual. PostgreSQL
keeps no count of failed statements that a client could read, and free disk
space is not visible through SQL. So the probe does what a claim does: it
creates a resource of its own (type `PROBE_TYPE`, a new random key each
time) and claims it with the store's statements (`Queries.ensure`,
`Queries.claim`), which inserts into ``resources``, ``leases`` and ``events``
and their indexes, extending their files when their pages are full: the
step a full disk refuses. Then it rolls back.

A rolled-back transaction leaves no row, no event, no notification (NOTIFY is
sent at commit) and no lease: no reader, watcher or holder can see it. What
it does leave is what any aborted write leaves: one transaction id, one
value of the event id sequence (ids have gaps after every aborted write
anyway), dead tuples that vacuum removes and a little WAL. While it runs (a
few milliseconds) it holds a transaction id, like any claim.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import psycopg
import psycopg.errors

from ..postgres._queries import Queries
from .report import Check, Conn

#: The resource type of the probe's resources (never committed).
PROBE_TYPE = "pglease_doctor"

#: Undefined function, table, column, schema: functions older than the store's
#: statements (a schema behind on migrations), not a failing write.
_NOT_MIGRATED = ("42883", "42P01", "42703", "3F000")

_ADVICE = {
    "53100": "free space on the server's filesystem that holds the file named (the data"
    " directory, or a tablespace under pg_tblspc/); reads still work, every claim, renew,"
    " release and mutation fails until then",
    "53200": "the server is out of memory: see its log; lower work_mem or max_connections",
    "25006": "the server or this session is read-only (a standby, or"
    " default_transaction_read_only = on): connect to the primary",
    "55P03": "a write waited more than 5 s for a lock: see pg_locks and pg_stat_activity",
    "57014": "a write ran more than 5 s: the server is overloaded or waits on its disk",
}


@dataclass(frozen=True, slots=True)
class WriteProbe:
    """What the probe found: `ok` True (a claim went through), False (it failed:
    `sqlstate`, `condition`, `message`) or None (not tried: `message` says why)."""

    ok: bool | None
    message: str
    sqlstate: str | None = None
    condition: str | None = None
    advice: str = ""

    def line(self) -> str:
        """One line for `pglease status`."""
        if self.ok:
            return "ok (a claim through pglease's SQL, rolled back)"
        if self.ok is None:
            return f"not tried: {self.message}"
        return f"failing: {self.sqlstate} {self.condition}: {self.message}"


def _condition(sqlstate: str) -> str:
    """PostgreSQL's condition name for a SQLSTATE, in words ("disk full")."""
    try:
        name = psycopg.errors.lookup(sqlstate).__name__
    except KeyError:
        return "error"
    return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def probe_writes(conn: Conn, schema: str) -> WriteProbe:
    """Claim a new resource of `PROBE_TYPE` with pglease's statements, and roll back.

    Runs in a transaction of its own (a savepoint inside an open one), which
    is always rolled back. Not tried when the role may not claim (a reader)
    or the schema has no pglease functions. A connection that breaks raises
    the driver's error (the caller reports an unreachable server)."""
    found = conn.execute(
        "SELECT count(*), coalesce(bool_and(has_schema_privilege(n.oid, 'USAGE')"
        " AND has_function_privilege(p.oid, 'EXECUTE')), false)"
        " FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND p.proname IN ('ensure_resource', 'claim')",
        [schema],
    ).fetchone()
    assert found is not None
    if found[0] < 2:
        return WriteProbe(None, f"schema {schema!r} has no pglease functions to write with")
    if not found[1]:
        return WriteProbe(None, "this role may not claim (a reader): it cannot write anyway")
    q = Queries(schema)
    key = f"write-probe-{os.urandom(8).hex()}"
    token_sha256 = hashlib.sha256(os.urandom(32)).digest()
    try:
        with conn.transaction(force_rollback=True):
            # A lock it would wait for, a stalled disk: a failing write, never a hang.
            conn.execute("SET LOCAL statement_timeout = '5s'")
            conn.execute("SET LOCAL lock_timeout = '5s'")
            row = conn.execute(q.ensure, [PROBE_TYPE, key]).fetchone()
            assert row is not None
            claimed = conn.execute(
                q.claim, [row[0], PROBE_TYPE, "doctor", token_sha256, 1.0, None, None]
            ).fetchone()
    except psycopg.Error as exc:
        if conn.broken:
            raise
        sqlstate = exc.diag.sqlstate or ""
        first = exc.diag.message_primary or (str(exc).strip().splitlines() or ["?"])[0]
        if sqlstate in _NOT_MIGRATED:  # says nothing about writes: the migrations check does
            return WriteProbe(None, f"the schema is behind pglease's SQL ({first})")
        return WriteProbe(
            False,
            first,
            sqlstate or "?",
            _condition(sqlstate) if sqlstate else "no SQLSTATE",
            _ADVICE.get(sqlstate, f"see the server log for SQLSTATE {sqlstate or '?'}"),
        )
    if claimed is None or not claimed[0]:
        return WriteProbe(None, f"the probe's claim of a new resource was refused ({claimed})")
    return WriteProbe(True, "a claim through pglease's SQL went through (rolled back)")


def check_writes(conn: Conn, schema: str) -> list[Check]:
    """A write the way pglease writes: a rolled-back claim of a probe resource."""
    found = probe_writes(conn, schema)
    facts = {"sqlstate": found.sqlstate} if found.sqlstate else {}
    if found.ok:
        return [
            Check(
                "writes",
                "ok",
                "a claim through pglease's SQL functions went through (rolled back: nothing"
                " was written)",
            )
        ]
    if found.ok is None:
        return [Check("writes", "unknown", f"not tried: {found.message}")]
    return [
        Check(
            "writes",
            "error",
            f"writes fail: SQLSTATE {found.sqlstate} ({found.condition}): {found.message}",
            found.advice,
            facts,
        )
    ]
