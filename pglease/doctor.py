"""`pglease doctor`: is this server and schema set up the way pglease assumes?

Each check reads only (catalog views, `SHOW`, the schema's own tables) and
ends in a verdict:

- ``ok``: as pglease expects;
- ``unknown``: could not be told from here (say, a role without
  ``pg_read_all_stats`` cannot see other sessions), said so honestly;
- ``warn``: works, but something can go wrong (a failover could lose a
  grant, a stalled client keeps rows locked, ...);
- ``error``: something is wrong now (commits would hang, the schema is not
  migrated, the test clock is on, ...).

The command exits 0 when nothing is wrong (ok / unknown only), 1 with
warnings and 2 with errors (also when the server cannot be reached).

`doctor(conn_or_store, schema)` returns the `Report`; `register(subparsers)`
adds the ``doctor`` subcommand to the ``pglease`` parser.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

import psycopg
from psycopg import sql

from .errors import MigrationError, PgleaseError
from .migrations import migration_state
from .postgres import PostgresStore
from .roles import CLIENT_FUNCTIONS, READ_TABLES, READER_FUNCTIONS, SECRET_LEASE_COLUMNS
from .validation import check_schema_name

Verdict = Literal["ok", "unknown", "warn", "error"]
_RANK: dict[str, int] = {"ok": 0, "unknown": 0, "warn": 1, "error": 2}

EXIT_OK = 0
EXIT_WARN = 1
EXIT_ERROR = 2

#: A transaction holding an xid longer than this holds every watcher back.
HOLDBACK_WARN_SECONDS = 0.1

Conn = psycopg.Connection[Any]


@dataclass(frozen=True, slots=True)
class Check:
    """One finding: what was checked, the verdict, what was seen, what to do."""

    name: str
    verdict: Verdict
    detail: str
    advice: str = ""
    #: Machine-readable particulars (in --json only when there are any).
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Report:
    """Every check of one doctor run."""

    schema: str
    checks: list[Check] = field(default_factory=list)

    @property
    def worst(self) -> Verdict:
        """The most serious verdict ("ok" when there is nothing to report)."""
        worst: Verdict = "ok"
        for check in self.checks:
            if _RANK[check.verdict] > _RANK[worst]:
                worst = check.verdict
        return worst

    @property
    def exit_code(self) -> int:
        """0 nothing wrong, 1 warnings, 2 errors."""
        return _RANK[self.worst]

    def by_name(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "worst": self.worst,
            "exit_code": self.exit_code,
            "checks": [
                {k: v for k, v in asdict(c).items() if k != "facts" or v} for c in self.checks
            ],
        }


def doctor(
    conn_or_store: Conn | PostgresStore, schema: str | None = None, *, pooler: bool | None = None
) -> Report:
    """Run every check on a connection (or a store's pooled one) for `schema`.

    `schema` defaults to the store's schema, else ``pglease``. `pooler` says
    whether the client runs in pooler mode (a store's own setting by default;
    None: not known), which the `pooler` check reports. Nothing is written;
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


# ---------------------------------------------------------------------- checks


def _one(conn: Conn, query: str | sql.Composed, args: Sequence[Any] = ()) -> tuple[Any, ...]:
    row = conn.execute(query, args).fetchone()
    assert row is not None
    return tuple(row)


def _show(conn: Conn, setting: str) -> str:
    return str(_one(conn, "SELECT current_setting(%s)", [setting])[0])


def _can_see_all_sessions(conn: Conn) -> bool:
    # Other users' replication and activity columns are NULL without it.
    return bool(
        _one(
            conn,
            "SELECT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)"
            " OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')",
        )[0]
    )


def check_server(conn: Conn, schema: str) -> list[Check]:
    """Server version, and whether it takes writes at all."""
    num = int(_show(conn, "server_version_num"))
    version = _show(conn, "server_version")
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
    if _one(conn, "SELECT pg_is_in_recovery()")[0]:
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


_SYNC_NAMES = re.compile(r"^\s*(?:(FIRST|ANY)\s+)?(?:(\d+)\s*\()?(.*?)\)?\s*$", re.IGNORECASE)


def parse_sync_names(value: str) -> tuple[str, int, list[str]]:
    """`synchronous_standby_names` as (method, how many, names); ('', 0, []) when empty.

    ``a, b`` and ``n (a, b)`` are the old FIRST syntax; ``*`` matches any standby.
    """
    if not value.strip():
        return "", 0, []
    m = _SYNC_NAMES.match(value)
    if m is None:  # the server accepted it, so this is our parser's gap
        return "FIRST", 1, [value.strip()]
    method = (m.group(1) or "FIRST").upper()
    count = int(m.group(2)) if m.group(2) else 1
    names = [n.strip().strip('"') for n in m.group(3).split(",") if n.strip()]
    return method, count, names


def check_replication(conn: Conn, schema: str) -> list[Check]:
    """synchronous_commit, the synchronous standby, and inherited standby names."""
    commit = _show(conn, "synchronous_commit")
    names_value = _show(conn, "synchronous_standby_names")
    _method, wanted, names = parse_sync_names(names_value)
    privileged = _can_see_all_sessions(conn)
    rows = conn.execute(
        "SELECT application_name, state, sync_state FROM pg_catalog.pg_stat_replication"
    ).fetchall()
    streaming = [r for r in rows if r[1] == "streaming"]
    sync = [r for r in rows if r[2] in ("sync", "quorum")]
    in_recovery = bool(_one(conn, "SELECT pg_is_in_recovery()")[0])
    out: list[Check] = []

    if commit in ("on", "remote_apply"):
        out.append(Check("synchronous_commit", "ok", f"synchronous_commit = {commit}"))
    else:
        why = {
            "remote_write": "a commit is acknowledged once the standby has written it,"
            " before it is flushed: a crash of both can lose a grant",
            "local": "commits never wait for a standby: a failover can lose a grant",
            "off": "commits are acknowledged before they are flushed: even a restart"
            " of this server can lose a grant, and a generation be handed out twice",
        }.get(commit, "unexpected value")
        out.append(
            Check(
                "synchronous_commit",
                "warn",
                f"synchronous_commit = {commit}: {why}",
                "SET synchronous_commit = on (server, database or the store's role)",
            )
        )

    if not names:
        if in_recovery:
            detail = "this server is a standby; its primary decides"
            out.append(Check("synchronous_standby", "unknown", detail))
        else:
            standbys = f"{len(rows)} asynchronous standby(s) attached" if rows else "no standby"
            out.append(
                Check(
                    "synchronous_standby",
                    "warn",
                    f"synchronous_standby_names is empty ({standbys}): a failover can lose"
                    " acknowledged grants, and the new primary hand the same generation out"
                    " again",
                    "run a synchronous standby: synchronous_standby_names = 'FIRST 1 (name)'"
                    " with application_name=name in the standby's primary_conninfo",
                )
            )
        return out

    def matches(app: Any) -> bool:
        return any(n == "*" or str(app or "").lower() == n.lower() for n in names)

    connected = [r for r in streaming if matches(r[0])]
    waiting = int(
        _one(
            conn,
            "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE wait_event = 'SyncRep'",
        )[0]
    )
    hang = f"; {waiting} backend(s) are waiting for a standby right now" if waiting else ""
    if not privileged and rows and not streaming:
        out.append(
            Check(
                "synchronous_standby",
                "unknown",
                f"synchronous_standby_names = {names_value!r}; {len(rows)} WAL sender(s),"
                " their state hidden from this role",
                "run the doctor as a role with pg_read_all_stats (or pg_monitor)",
            )
        )
    elif len(connected) < wanted:
        out.append(
            Check(
                "synchronous_standby",
                "error",
                f"synchronous_standby_names = {names_value!r} wants {wanted} of"
                f" {', '.join(names)}, {len(connected)} connected: every commit waits for a"
                f" standby that is not there (claims and writes hang){hang}",
                "attach the standby, or, on a promoted standby that inherited the setting:"
                " ALTER SYSTEM SET synchronous_standby_names = ''; SELECT pg_reload_conf()"
                " (RESET does not override postgresql.conf)",
            )
        )
    elif sync:
        apps = ", ".join(f"{r[0]} ({r[2]})" for r in sync)
        out.append(Check("synchronous_standby", "ok", f"synchronous standby: {apps}"))
    else:
        out.append(
            Check(
                "synchronous_standby",
                "warn",
                f"synchronous_standby_names = {names_value!r}, standbys connected but none"
                " is synchronous yet (catching up?)",
                "wait until pg_stat_replication shows sync_state = 'sync'",
            )
        )
    return out


def check_pooler(conn: Conn, schema: str, pooler: bool | None = None) -> list[Check]:
    """Is a pooler or proxy between us and the server? (heuristic)

    A direct connection's BackendKeyData carries the backend's own pid; a
    pooler (PgBouncer, Odyssey, PgCat) hands out a key of its own. Its mode
    (session or transaction pooling) cannot be told from the client, so the
    verdict rests on the client's own pooler mode (`pooler`: None when unknown).
    """
    reported = conn.info.backend_pid
    actual = int(_one(conn, "SELECT pg_backend_pid()")[0])
    mode = {True: "; pooler mode is on", False: "; pooler mode is off", None: ""}[pooler]
    if reported == actual:
        return [Check("pooler", "ok", f"direct connection (backend pid {actual}){mode}")]
    if not reported:
        return [
            Check(
                "pooler",
                "unknown",
                "the connection reported no backend pid: cannot tell whether a pooler"
                f" is in between{mode}",
            )
        ]
    between = (
        f"a pooler or proxy is in between (connection key pid {reported}, server"
        f" backend pid {actual}); whether it pools by transaction cannot be told"
    )
    if pooler:
        return [
            Check(
                "pooler",
                "ok",
                f"{between}; pooler mode is on (no prepared statements or session SETs,"
                " time limits per transaction, watchers poll), safe for either mode",
            )
        ]
    return [
        Check(
            "pooler",
            "warn",
            f"{between}{mode}",
            "with transaction pooling, open stores in pooler mode (pooler=True, CLI"
            " --pooler, or PGLEASE_POOLER=transaction): prepared statements, session"
            " SETs and LISTEN do not survive it; session pooling needs nothing",
        )
    ]


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
    if not _one(conn, "SELECT has_schema_privilege(%s, 'USAGE')", [schema])[0]:
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
    user, superuser = _one(
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
        secret = _one(
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
                "warn",
                f"role {user} is a superuser: nothing the role model enforces applies to it",
                "run stores as a client role; migrate as a dedicated owner role",
            )
        )
    return out


def check_clock(conn: Conn, schema: str) -> list[Check]:
    """The offset between this host's clock and the server's (informational)."""
    before = time.time()
    (server,) = _one(conn, "SELECT clock_timestamp()")
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
    value = _show(conn, "idle_in_transaction_session_timeout")
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


def check_holdback(conn: Conn, schema: str) -> list[Check]:
    """The oldest transaction holding an xid: watchers read only below it.

    Watchers read the log below `pg_snapshot_xmin`, the oldest running xid of
    the whole cluster, so any long transaction that wrote something (in any
    database, pglease's or not), or a forgotten prepared transaction, delays
    every watcher by as long as it stays open. The one named is the one with
    the oldest xid (it is what holds the frontier), not the one that began
    first: a transaction that only read for a while before writing began
    earlier but holds nothing back until it writes.
    """
    row = conn.execute(
        "SELECT pid, extract(epoch FROM clock_timestamp() - xact_start), datname,"
        " application_name, state, query_start, xact_start, backend_xid::text"
        " FROM pg_catalog.pg_stat_activity"
        " WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()"
        " ORDER BY age(backend_xid) DESC, xact_start LIMIT 1"
    ).fetchone()
    prepared = conn.execute(
        "SELECT gid, extract(epoch FROM clock_timestamp() - prepared), database,"
        " transaction::text FROM pg_catalog.pg_prepared_xacts ORDER BY age(transaction) DESC"
        " LIMIT 1"
    ).fetchone()
    hidden = "" if _can_see_all_sessions(conn) else " (only this role's sessions are visible)"
    out: list[Check] = []
    if prepared is not None and float(prepared[1]) > HOLDBACK_WARN_SECONDS:
        out.append(
            Check(
                "watch_holdback",
                "warn",
                f"prepared transaction {prepared[0]!r} in {prepared[2]} is"
                f" {float(prepared[1]):.1f} s old: watchers deliver nothing committed after"
                " it began until it is resolved",
                "COMMIT PREPARED or ROLLBACK PREPARED it",
                {
                    "gid": prepared[0],
                    "database": prepared[2],
                    "age_seconds": round(float(prepared[1]), 3),
                    "xid": prepared[3],
                },
            )
        )
    if row is not None and row[1] is not None and float(row[1]) > HOLDBACK_WARN_SECONDS:
        pid, age, db, app, state, query_start, xact_start, xid = row
        since = query_start.isoformat() if query_start is not None else "unknown"
        out.append(
            Check(
                "watch_holdback",
                "warn",
                f"pid {pid} ({app or 'no application_name'}, database {db}, {state}, query"
                f" started {since}) has held transaction id {xid} for {float(age):.3f} s:"
                f" watchers deliver events only up to the oldest running transaction{hidden}",
                "keep writing transactions short; idle_in_transaction_session_timeout ends"
                f" stalled ones; SELECT pg_terminate_backend({pid}) if it is stuck",
                {
                    "pid": pid,
                    "application_name": app,
                    "database": db,
                    "state": state,
                    "age_seconds": round(float(age), 3),
                    "xact_start": xact_start.isoformat() if xact_start is not None else None,
                    "query_start": query_start.isoformat() if query_start is not None else None,
                    "xid": xid,
                },
            )
        )
    if not out:
        out.append(
            Check(
                "watch_holdback",
                "ok",
                f"no transaction older than {HOLDBACK_WARN_SECONDS * 1000:.0f} ms holds"
                f" watchers back{hidden}",
            )
        )
    return out


_CHECKS: list[tuple[str, Callable[[Conn, str], list[Check]]]] = [
    ("server_version", check_server),
    ("synchronous_standby", check_replication),
    ("pooler", check_pooler),
    ("migrations", check_migrations),
    ("role", check_privileges),
    ("clock_offset", check_clock),
    ("idle_in_transaction_session_timeout", check_idle_timeout),
    ("test_clock", check_test_clock),
    ("watch_holdback", check_holdback),
]


# ---------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``doctor`` subcommand to the ``pglease`` parser."""
    # "resolve": the main parser adds its own --json to every subcommand.
    p = subparsers.add_parser(
        "doctor",
        conflict_handler="resolve",
        help="check the server and schema against what pglease assumes (exit 0/1/2)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="one JSON object")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .cli.support import connect_direct, fail, print_json
    from .postgres._core import pooler_mode

    try:
        with connect_direct(args) as conn:
            report = doctor(conn, args.schema, pooler=pooler_mode(getattr(args, "pooler", False)))
    except (PgleaseError, psycopg.Error) as exc:
        # Not reaching the server is an error, not the "warnings" exit 1.
        return fail(f"doctor: {exc}", EXIT_ERROR)
    if getattr(args, "json", False):
        print_json(report.as_dict())
    else:
        for check in report.checks:
            print(f"{check.verdict:<8} {check.name}: {check.detail}")
            if check.advice and check.verdict != "ok":
                print(f"{'':<8} -> {check.advice}")
        sys.stdout.flush()
    return report.exit_code


def main_args(argv: Sequence[str]) -> int:
    """Run ``[--dsn DSN] [--schema S] [--json] doctor [--json]`` without `pglease.cli`."""
    parser = argparse.ArgumentParser(prog="pglease")
    parser.add_argument("--dsn")
    parser.add_argument("--schema", default="pglease")
    parser.add_argument("--json", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(list(argv))
    code: int = args.func(args)
    return code
