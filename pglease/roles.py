"""The role model: which PostgreSQL privileges a pglease role gets on one schema.

- **owner**: the role that runs `pglease migrate` owns the schema, its tables
  and functions; it alone migrates, prunes and switches the test clock.
- **client**: claims, renews, releases, mutates, heartbeats, waits, reaps and
  watches, all through SECURITY DEFINER functions; it can read the tables
  (not the lease token hashes) and write no pglease table directly. It may
  write the session tables, whose rows are the session's own content and are
  written inside a fenced mutation by pglease's session layer (or, for a
  hidden import, by the token-checked chunk functions).
- **reader**: reads resources, leases (not the token hashes), events and
  sessions, and watches; it can change nothing.

Grants are recorded in the schema's `role_grants` table, so a later migration
that adds a function grants it to the same roles again. The statements are
built here; `grant` / `revoke` (and `grant_async` / `revoke_async`) in
`pglease.migrations` run them.
"""

from __future__ import annotations

from typing import Any, Literal

import psycopg
from psycopg import sql

from .errors import InvalidRoleError
from .validation import check_schema_name

RoleKind = Literal["client", "reader"]
ROLE_KINDS: tuple[RoleKind, ...] = ("client", "reader")

#: Functions a reader may call: the watcher read, and the clock of reads.
READER_FUNCTIONS = ("watch_read", "_clock_now")
#: Functions a client may call besides the reader's.
CLIENT_FUNCTIONS = (
    "ensure_resource",
    "claim",
    "renew",
    "release",
    "claim_many",
    "renew_many",
    "release_many",
    "mutate_begin",
    "heartbeat",
    "claim_fair",
    "leave_queue",
    "reap_next",
    "reap_expired",
    "session_import_chunk",
    "session_import_registers",
)
#: Tables every pglease role reads whole.
READ_TABLES = (
    "resources",
    "events",
    "payloads",
    "event_horizon",
    "lease_waiters",
    "schema_migrations",
    "schema_functions",
    "settings",
)
#: Session tables: read by readers, written by clients (inside fenced mutations).
SESSION_TABLES = (
    "sessions",
    "session_entries",
    "session_registers",
    "session_usage_ledger",
    "session_branch_entries",
    "session_branch_meta",
)
#: The one column no role but the owner may read: a token hash is the proof of
#: ownership that renew, release and fenced writes check.
SECRET_LEASE_COLUMNS = ("token_sha256",)

_LEASE_COLUMNS = (
    "SELECT attname FROM pg_catalog.pg_attribute"
    " WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
)
_ROLE_EXISTS = "SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = %s"


def check_role_kind(kind: object) -> RoleKind:
    if kind not in ROLE_KINDS:
        raise InvalidRoleError(f"role kind must be one of {', '.join(ROLE_KINDS)}, got {kind!r}")
    return kind


def _leases(schema: str) -> str:
    return sql.Identifier(schema, "leases").as_string(None)


def grant_statements(
    schema: str, role: str, kind: RoleKind, lease_columns: list[str]
) -> list[sql.Composed]:
    """The GRANTs that make `role` a pglease `kind` on `schema` (given the lease columns)."""
    check_schema_name(schema)
    check_role_kind(kind)
    s = sql.Identifier(schema)
    who = sql.Identifier(role)

    def objects(names: tuple[str, ...]) -> sql.Composable:
        return sql.SQL(", ").join(sql.Identifier(schema, n) for n in names)

    readable = [c for c in lease_columns if c not in SECRET_LEASE_COLUMNS]
    out = [
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, who),
        sql.SQL("GRANT SELECT ON TABLE {} TO {}").format(objects(READ_TABLES), who),
        sql.SQL("GRANT SELECT ({}) ON TABLE {} TO {}").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in readable),
            sql.Identifier(schema, "leases"),
            who,
        ),
        sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(objects(READER_FUNCTIONS), who),
    ]
    if kind == "reader":
        out.append(sql.SQL("GRANT SELECT ON TABLE {} TO {}").format(objects(SESSION_TABLES), who))
    else:
        out.append(
            sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(objects(CLIENT_FUNCTIONS), who)
        )
        out.append(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE {} TO {}").format(
                objects(SESSION_TABLES), who
            )
        )
    return out


def revoke_statements(schema: str, role: str) -> list[sql.Composed]:
    """Take every pglease privilege on `schema` away from `role`."""
    check_schema_name(schema)
    s = sql.Identifier(schema)
    who = sql.Identifier(role)
    return [
        sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(s, who),
        sql.SQL("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {} FROM {}").format(s, who),
        sql.SQL("REVOKE ALL ON SCHEMA {} FROM {}").format(s, who),
        sql.SQL("DELETE FROM {}.role_grants WHERE role_name = {}").format(s, sql.Literal(role)),
    ]


def _record(schema: str, role: str, kind: RoleKind) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {}.role_grants (role_name, kind) VALUES ({}, {})"
        " ON CONFLICT (role_name) DO UPDATE SET kind = EXCLUDED.kind,"
        " granted_at = clock_timestamp()"
    ).format(sql.Identifier(schema), sql.Literal(role), sql.Literal(kind))


def _check_role(found: object, role: str) -> None:
    if not isinstance(role, str) or not role or found is None:
        raise InvalidRoleError(f"role {role!r} does not exist on this server")


def _privilege_error(schema: str, exc: psycopg.Error) -> InvalidRoleError:
    return InvalidRoleError(
        f"cannot change grants on schema {schema!r}: {exc.diag.message_primary or exc}"
        " (grants are made by the schema's owner)"
    )


_RECORDED = (
    "SELECT g.role_name, g.kind FROM {}.role_grants g"
    " JOIN pg_catalog.pg_roles r ON r.rolname = g.role_name ORDER BY g.role_name"
)


def _regrant(
    schema: str, recorded: list[tuple[Any, ...]], columns: list[str]
) -> list[sql.Composed]:
    out: list[sql.Composed] = []
    for role, kind in recorded:
        out.extend(grant_statements(schema, str(role), check_role_kind(kind), columns))
    return out


_RUNNERS = ("grant", "revoke", "grant_async", "revoke_async")


def __getattr__(name: str) -> Any:
    # `pglease.roles.grant` and friends run the statements built here; they
    # live with the migration I/O (generated sync twin), imported lazily
    # because that module imports this one.
    if name in _RUNNERS:
        from . import migrations

        return getattr(migrations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
