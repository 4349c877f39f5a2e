"""The sans-I/O part of PostgreSQL migrations: state, plan and statements.

`pglease._migrate_async` (and its generated twin `pglease._migrate`) only
move these values over a connection.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from .errors import MigrationError, SchemaNotMigratedError
from .migration_files import (
    FunctionSet,
    Migration,
    load_functions,
    load_migrations,
    pending_migrations,
)


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(f"pglease.migrate:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass(frozen=True, slots=True)
class MigrationState:
    """What a schema still needs; read without writing anything."""

    schema: str
    schema_exists: bool
    pending: list[Migration]
    functions: FunctionSet | None  # the function set to apply, None when current
    applied: dict[int, tuple[str, str]] = field(default_factory=dict)

    @property
    def up_to_date(self) -> bool:
        return not self.pending and self.functions is None

    def describe(self) -> str:
        work = [m.label for m in self.pending]
        if self.functions is not None:
            work.append(self.functions.label)
        return ", ".join(work) or "nothing"

    def not_migrated_error(self, reason: str | None) -> SchemaNotMigratedError:
        work = [m.label for m in self.pending]
        if self.functions is not None:
            work.append(self.functions.label)
        return SchemaNotMigratedError(
            self.schema, tuple(work), has_tables=bool(self.applied), reason=reason
        )


# Catalog reads need no privilege on the schema itself.
_EXISTS = (
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(s)s),"
    " EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
    "  ON n.oid = c.relnamespace WHERE n.nspname = %(s)s AND c.relname = 'schema_migrations'),"
    " EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
    "  ON n.oid = c.relnamespace WHERE n.nspname = %(s)s AND c.relname = 'schema_functions')"
)


def _applied_query(schema: str) -> sql.Composed:
    return sql.SQL("SELECT version, name, checksum FROM {}.schema_migrations").format(
        sql.Identifier(schema)
    )


def _functions_query(schema: str) -> sql.Composed:
    return sql.SQL("SELECT checksum FROM {}.schema_functions").format(sql.Identifier(schema))


def _state(
    schema: str,
    exists: tuple[Any, ...],
    applied_rows: list[tuple[Any, ...]],
    functions_checksum: str | None,
) -> MigrationState:
    schema_exists, has_migrations, _ = exists
    applied = {int(r[0]): (str(r[1]), str(r[2])) for r in applied_rows}
    pending = pending_migrations(f"schema {schema!r}", load_migrations(), applied)
    functions = load_functions()
    current = has_migrations and functions_checksum == functions.checksum
    return MigrationState(
        schema, bool(schema_exists), pending, None if current else functions, applied
    )


def _unreadable(schema: str, exc: psycopg.Error) -> MigrationError:
    return MigrationError(
        f"cannot read the migration state of schema {schema!r}:"
        f" {exc.diag.message_primary or exc}; the schema's owner can grant this role access"
        f" with `pglease --schema {schema} migrate --grant-reader ROLE` (or --grant-client)"
    )


def _apply_statements(state: MigrationState) -> list[tuple[bytes | sql.Composed, list[Any] | None]]:
    """Everything one migration transaction runs, in order, for `state`."""
    schema = state.schema
    ident = sql.Identifier(schema)
    out: list[tuple[bytes | sql.Composed, list[Any] | None]] = []
    if not state.schema_exists:
        out.append((sql.SQL("CREATE SCHEMA {}").format(ident), None))
    out.append(
        (
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(ident),
            [],
        )
    )
    record = sql.SQL(
        "INSERT INTO {}.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)"
    ).format(ident)
    for migration in state.pending:
        out.append((migration.render(schema).encode("utf-8"), None))
        out.append((record, [migration.version, migration.name, migration.checksum]))
    functions = state.functions
    if functions is not None:
        for text in functions.render(schema):
            out.append((text.encode("utf-8"), None))
        # CREATE makes a function EXECUTE-able by PUBLIC; only granted roles may.
        out.append(
            (sql.SQL("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {} FROM PUBLIC").format(ident), None)
        )
        out.append(
            (
                sql.SQL(
                    "INSERT INTO {}.schema_functions (singleton, checksum) VALUES (true, %s)"
                    " ON CONFLICT (singleton) DO UPDATE SET checksum = EXCLUDED.checksum,"
                    " applied_at = clock_timestamp()"
                ).format(ident),
                [functions.checksum],
            )
        )
    return out


#: Lease rows per chunk of the revision move (sql/0018), each chunk its own
#: short transaction: a claim of a row in the chunk waits at most for one
#: chunk (about 10-30 ms at 1,000 rows on a 1,000,000-row table, see
#: bench/RESULTS.md).
MOVE_CHUNK = 1000


def _move_chunk_query(schema: str) -> sql.Composed:
    return sql.SQL("SELECT {}.move_revisions_chunk(%s)").format(sql.Identifier(schema))


# Whether this role can move rows: the function exists (migration 0018 and
# its function set are applied) and it may run it (the schema owner).
_CAN_MOVE = (
    "SELECT coalesce(pg_catalog.has_function_privilege("
    " pg_catalog.to_regprocedure(%s), 'EXECUTE'), false)"
)


def _move_function(schema: str) -> str:
    return sql.Identifier(schema, "move_revisions_chunk").as_string(None) + "(integer)"


def _refused(state: MigrationState, exc: psycopg.Error) -> MigrationError:
    return state.not_migrated_error(
        f"this role may not apply it: {exc.diag.message_primary or exc}"
    )


Applied = list[Migration | FunctionSet]


def _applied(state: MigrationState) -> Applied:
    work: Applied = list(state.pending)
    if state.functions is not None:
        work.append(state.functions)
    return work
