"""Schema migrations on PostgreSQL: recorded with checksums, safe from many hosts at once.

Opening a store reads the migration state first and changes nothing when it is
current, so a role without CREATE (a client or reader role) can open a
migrated schema. Only pending work takes the migration lock and needs the
owner's privileges: the ordered migrations of `sql/`, then the current
function set of `sql/functions/` whenever its text changed, then (in short
transactions of their own) the data moves a migration left to do in chunks
(`move_revisions`: sql/0018's lease-row revisions).

The blocking functions (`migrate`, `migration_state`, `grant`, `revoke`) are
generated from their asyncio twins (`migrate_async`, ...): see
`pglease/_migrate_async.py`.
"""

from __future__ import annotations

from ._migrate import (
    grant,
    migrate,
    migration_state,
    move_revisions,
    regrant_statements,
    revoke,
)
from ._migrate_async import (
    grant_async,
    migrate_async,
    migration_state_async,
    move_revisions_async,
    regrant_statements_async,
    revoke_async,
)
from ._migration_core import Applied, MigrationState
from .migration_files import (
    SCHEMA_PLACEHOLDER,
    FunctionSet,
    Migration,
    load_functions,
    load_migrations,
    migrations_dir,
)

__all__ = [
    "SCHEMA_PLACEHOLDER",
    "Applied",
    "FunctionSet",
    "Migration",
    "MigrationState",
    "grant",
    "grant_async",
    "load_functions",
    "load_migrations",
    "migrate",
    "migrate_async",
    "migration_state",
    "migration_state_async",
    "migrations_dir",
    "move_revisions",
    "move_revisions_async",
    "regrant_statements",
    "regrant_statements_async",
    "revoke",
    "revoke_async",
]
