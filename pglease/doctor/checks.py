"""The checks of the server, the schema's migrations, the role, the clocks and the timeouts."""

from __future__ import annotations

import time
from datetime import datetime

from psycopg import sql

from ..errors import MigrationError
from ..migrations import migration_state
from ..roles import CLIENT_FUNCTIONS, READ_TABLES, READER_FUNCTIONS, SECRET_LEASE_COLUMNS
from .report import Check, Conn, one_row, show_setting


def check_server(conn: Conn, schema: str) -> list[Check]:
    """Server version, and whether it takes writes at all."""
    num = int(show_setting(conn, "server_version_num"))
    version = show_setting(conn, "server_version")
    out: list[Check] = []
    if num < 130000:
        out.append(
            Check(
                "server_version",
                "error",
                f"PostgreSQL {version}",
                "pglease needs PostgreSQL 13 or later (xid8, pg_current_snapshot)",
            )
        )
    elif num < 150000:
        out.append(
            Check(
                "server_version",
                "warn",
                f"PostgreSQL {version}",
                "pglease is tested on PostgreSQL 15 and 18; upgrade",
            )
        )
    else:
        out.append(Check("server_version", "ok", f"PostgreSQL {version}"))
    if one_row(conn, "SELECT pg_is_in_recovery()")[0]:
        out.append(
            Check(
                "server_role",
                "error",
                "this server is a standby in recovery (read-only): claims and writes fail",
                "connect to the primary: list every server in the DSN with"
                " target_session_attrs=read-write (host=a,b port=5432,5432)",
            )
        )
    else:
        out.append(Check("server_role", "ok", "primary (accepts writes)"))
    return out


def check_migrations(conn: Conn, schema: str) -> list[Check]:
    try:
        state = migration_state(conn, schema)
    except MigrationError as exc:
        return [Check("migrations", "error", str(exc))]
    if not state.schema_exists:
        return [
            Check(
                "migrations",
                "error",
                f"schema {schema!r} does not exist",
                f"pglease --schema {schema} migrate (as the schema's owner); or check --schema",
            )
        ]
    if not state.up_to_date:
        return [
            Check(
                "migrations",
                "warn",
                f"schema {schema!r} needs {state.describe()}",
                f"pglease --schema {schema} migrate (as the schema's owner); a store with"
                " auto_migrate applies it when its role may",
            )
        ]
    return [Check("migrations", "ok", f"schema {schema!r} is current")]


def _role_kind(conn: Conn, schema: str) -> tuple[str, list[str], list[str]]:
    """(kind, what a client misses, what a reader misses) for the current role."""
    row = conn.execute(
        "SELECT pg_has_role(current_user, nspowner, 'USAGE')"
        " FROM pg_catalog.pg_namespace WHERE nspname = %s",
        [schema],
    ).fetchone()
    if row is None:
        return "none", ["the schema"], ["the schema"]
    if row[0]:
        return "owner", [], []
    missing: list[str] = []
    if not one_row(conn, "SELECT has_schema_privilege(%s, 'USAGE')", [schema])[0]:
        missing.append(f"USAGE on schema {schema}")
    # By oid from the catalog: naming a table of a schema without USAGE fails.
    tables = dict(
        conn.execute(
            "SELECT c.relname, CASE WHEN c.relname = 'leases'"
            " THEN has_column_privilege(c.oid, 'generation', 'SELECT')"  # column grants
            " ELSE has_table_privilege(c.oid, 'SELECT') END"
            " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind IN ('r', 'p')",
            [schema],
        ).fetchall()
    )
    missing.extend(f"SELECT on {t}" for t in (*READ_TABLES, "leases") if not tables.get(t))
    executable = dict(
        conn.execute(
            "SELECT p.proname, bool_and(has_function_privilege(p.oid, 'EXECUTE'))"
            " FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = %s GROUP BY p.proname",
            [schema],
        ).fetchall()
    )
    reader_missing = missing + [
        f"EXECUTE on {f}" for f in READER_FUNCTIONS if not executable.get(f)
    ]
    client_missing = reader_missing + [
        f"EXECUTE on {f}" for f in CLIENT_FUNCTIONS if not executable.get(f)
    ]
    if not client_missing:
        return "client", [], []
    if not reader_missing:
        return "reader", client_missing, []
    return "none", client_missing, reader_missing


def check_privileges(conn: Conn, schema: str) -> list[Check]:
    """The current role against the role model (owner / client / reader / none)."""
    user, superuser = one_row(
        conn, "SELECT current_user, rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user"
    )
    kind, client_missing, reader_missing = _role_kind(conn, schema)
    out: list[Check] = []
    if kind == "owner":
        out.append(Check("role", "ok", f"role {user} owns schema {schema!r} (owner)"))
    elif kind == "client":
        out.append(Check("role", "ok", f"role {user} is a client of {schema!r}"))
    elif kind == "reader":
        out.append(
            Check(
                "role",
                "ok",
                f"role {user} is a reader of {schema!r} (cannot claim or write; missing"
                f" {', '.join(client_missing[:3])}{'...' if len(client_missing) > 3 else ''})",
            )
        )
    else:
        out.append(
            Check(
                "role",
                "error",
                f"role {user} is neither owner, client nor reader of {schema!r}: missing"
                f" {', '.join(reader_missing[:4])}{'...' if len(reader_missing) > 4 else ''}",
                f"as the owner: pglease --schema {schema} migrate --grant-client {user}"
                " (or --grant-reader)",
            )
        )
    if kind != "owner" and kind != "none":
        secret = one_row(
            conn,
            "SELECT coalesce(bool_or(has_column_privilege(c.oid, %s, 'SELECT')), false)"
            " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relname = 'leases'",
            [SECRET_LEASE_COLUMNS[0], schema],
        )[0]
        if secret:
            out.append(
                Check(
                    "role_secrets",
                    "error",
                    f"role {user} can read leases.{SECRET_LEASE_COLUMNS[0]}, the proof of"
                    " ownership renew and release check",
                    f"as the owner: pglease --schema {schema} migrate --grant-{kind} {user}"
                    " (grants exactly the role model again)",
                )
            )
    if superuser:
        out.append(
            Check(
                "superuser",
                # Advice: pglease works; only the role model's limits do not apply.
                "advice",
                f"role {user} is a superuser: nothing the role model enforces applies to it",
                "run stores as a client role; migrate as a dedicated owner role",
            )
        )
    return out


def check_clock(conn: Conn, schema: str) -> list[Check]:
    """The offset between this host's clock and the server's (informational)."""
    before = time.time()
    (server,) = one_row(conn, "SELECT clock_timestamp()")
    after = time.time()
    assert isinstance(server, datetime)
    offset = server.timestamp() - (before + after) / 2
    return [
        Check(
            "clock_offset",
            "ok",
            f"server clock - this host's clock = {offset * 1000:+.1f} ms (+/- "
            f"{(after - before) * 500:.1f} ms); informational: expiry is judged by the"
            " server clock alone and never depends on it",
        )
    ]


def check_idle_timeout(conn: Conn, schema: str) -> list[Check]:
    value = show_setting(conn, "idle_in_transaction_session_timeout")
    if value in ("0", "0ms", "0s"):
        return [
            Check(
                "idle_in_transaction_session_timeout",
                "warn",
                "idle_in_transaction_session_timeout = 0: a client that stalls inside a"
                " transaction keeps the lease row locked until it is killed",
                "ALTER SYSTEM SET idle_in_transaction_session_timeout = '60s'",
            )
        ]
    return [Check("idle_in_transaction_session_timeout", "ok", f"{value}")]


def check_test_clock(conn: Conn, schema: str) -> list[Check]:
    readable = conn.execute(
        "SELECT has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT')"
        " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = 'settings'",
        [schema],
    ).fetchone()
    if readable is None:
        return [Check("test_clock", "unknown", f"schema {schema!r} has no settings table")]
    if not readable[0]:
        return [Check("test_clock", "unknown", f"this role may not read {schema}.settings")]
    row = conn.execute(
        sql.SQL("SELECT test_clock FROM {}.settings").format(sql.Identifier(schema))
    ).fetchone()
    if row is not None and row[0]:
        return [
            Check(
                "test_clock",
                "error",
                f"the test clock is on in schema {schema!r}: callers may pass now= and"
                " place claims and expiries at any instant they choose",
                "as the owner: pglease.testing.set_test_clock(conn, schema, False);"
                " never use a test schema for real hosts",
            )
        ]
    return [Check("test_clock", "ok", "off (expiry judged by the server clock only)")]
