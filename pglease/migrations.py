"""Ordered SQL migrations, recorded with checksums, safe to run from many hosts at once."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import psycopg
from psycopg import sql

from .errors import MigrationChecksumError, MigrationError
from .validation import check_schema_name

_FILE_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")
SCHEMA_PLACEHOLDER = "@schema@"


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def render(self, schema: str) -> str:
        return self.text.replace(SCHEMA_PLACEHOLDER, check_schema_name(schema))


def migrations_dir() -> Path:
    """`pglease/sql` inside an installed wheel, else the repository's `sql/`."""
    packaged = resources.files("pglease") / "sql"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "sql"


def load_migrations(directory: Path | None = None) -> list[Migration]:
    directory = directory or migrations_dir()
    found: list[Migration] = []
    for path in sorted(directory.glob("*.sql")):
        match = _FILE_NAME.fullmatch(path.name)
        if not match:
            raise MigrationError(f"migration file name {path.name!r} is not NNNN_name.sql")
        found.append(Migration(int(match[1]), match[2], path.read_text(encoding="utf-8")))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration versions in {directory}")
    if not found:
        raise MigrationError(f"no migrations found in {directory}")
    return found


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(f"pglease.migrate:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _bootstrap_sql(schema: str) -> list[sql.Composed]:
    ident = sql.Identifier(schema)
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ).format(ident),
    ]


def _plan(
    schema: str, available: list[Migration], applied: dict[int, tuple[str, str]]
) -> list[Migration]:
    """Return the migrations still to apply; refuse changed or unknown applied ones."""
    known = {m.version: m for m in available}
    for version, (name, checksum) in sorted(applied.items()):
        migration = known.get(version)
        if migration is None:
            raise MigrationError(
                f"schema {schema!r} has migration {version:04d}_{name} which this pglease"
                " version does not know; upgrade pglease"
            )
        if migration.checksum != checksum:
            raise MigrationChecksumError(
                f"migration {version:04d}_{name} was applied to schema {schema!r} with checksum"
                f" {checksum[:12]}..., but the file now has {migration.checksum[:12]}...;"
                " applied migrations must never change (add a new one instead)"
            )
    return [m for m in available if m.version not in applied]


def _applied_query(schema: str) -> sql.Composed:
    return sql.SQL("SELECT version, name, checksum FROM {}.schema_migrations").format(
        sql.Identifier(schema)
    )


def _record_query(schema: str) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {}.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)"
    ).format(sql.Identifier(schema))


def migrate(conn: psycopg.Connection[object], schema: str = "pglease") -> list[Migration]:
    """Apply pending migrations in one transaction; return those applied."""
    check_schema_name(schema)
    available = load_migrations()
    with conn.transaction():
        # Serialise concurrent migrators for this schema; released at commit.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [_lock_key(schema)])
        for statement in _bootstrap_sql(schema):
            conn.execute(statement)
        rows = conn.execute(_applied_query(schema)).fetchall()
        pending = _plan(schema, available, {r[0]: (r[1], r[2]) for r in rows})  # type: ignore[index]
        for migration in pending:
            conn.execute(migration.render(schema).encode("utf-8"))
            conn.execute(
                _record_query(schema), [migration.version, migration.name, migration.checksum]
            )
    return pending


async def migrate_async(
    conn: psycopg.AsyncConnection[object], schema: str = "pglease"
) -> list[Migration]:
    """Asyncio twin of `migrate`."""
    check_schema_name(schema)
    available = load_migrations()
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", [_lock_key(schema)])
        for statement in _bootstrap_sql(schema):
            await conn.execute(statement)
        cur = await conn.execute(_applied_query(schema))
        rows = await cur.fetchall()
        pending = _plan(schema, available, {r[0]: (r[1], r[2]) for r in rows})  # type: ignore[index]
        for migration in pending:
            await conn.execute(migration.render(schema).encode("utf-8"))
            await conn.execute(
                _record_query(schema), [migration.version, migration.name, migration.checksum]
            )
    return pending
