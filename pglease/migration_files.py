"""Migration files on disk: ordered migrations and the current function set.

Driver-free (no psycopg import), so the SQLite store can use it too.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import MigrationChecksumError, MigrationError
from .validation import check_schema_name

_FILE_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")
_FUNCTION_FILE_NAME = re.compile(r"(\d{2})_([a-z0-9_]+)\.sql")
SCHEMA_PLACEHOLDER = "@schema@"


@dataclass(frozen=True, slots=True)
class Migration:
    """One ordered migration file, `NNNN_name.sql`; applied once, never changed."""

    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    def render(self, schema: str) -> str:
        return self.text.replace(SCHEMA_PLACEHOLDER, check_schema_name(schema))


@dataclass(frozen=True, slots=True)
class FunctionSet:
    """The current definitions of every SQL function (`sql/functions/NN_name.sql`).

    Re-applied with CREATE OR REPLACE whenever their text changes, so each
    function's current body lives in exactly one file.
    """

    files: tuple[tuple[str, str], ...]  # (file name, text), in apply order

    @property
    def checksum(self) -> str:
        digest = hashlib.sha256()
        for name, text in self.files:
            digest.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
        return digest.hexdigest()

    @property
    def label(self) -> str:
        return f"functions@{self.checksum[:12]}"

    def render(self, schema: str) -> list[str]:
        check_schema_name(schema)
        return [text.replace(SCHEMA_PLACEHOLDER, schema) for _, text in self.files]


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


def load_functions(directory: Path | None = None) -> FunctionSet:
    directory = (directory or migrations_dir()) / "functions"
    files: list[tuple[str, str]] = []
    for path in sorted(directory.glob("*.sql")):
        if not _FUNCTION_FILE_NAME.fullmatch(path.name):
            raise MigrationError(f"function file name {path.name!r} is not NN_name.sql")
        files.append((path.name, path.read_text(encoding="utf-8")))
    if not files:
        raise MigrationError(f"no function files found in {directory}")
    return FunctionSet(tuple(files))


def pending_migrations(
    where: str, available: list[Migration], applied: dict[int, tuple[str, str]]
) -> list[Migration]:
    """The migrations still to apply to `where` (a schema or a file, for messages);
    refuse applied ones that this version does not know or whose file changed."""
    known = {m.version: m for m in available}
    for version, (name, checksum) in sorted(applied.items()):
        migration = known.get(version)
        if migration is None:
            raise MigrationError(
                f"{where} has migration {version:04d}_{name} which this pglease version"
                " does not know; upgrade pglease"
            )
        if migration.checksum != checksum:
            raise MigrationChecksumError(
                f"migration {version:04d}_{name} was applied to {where} with checksum"
                f" {checksum[:12]}..., but the file now has {migration.checksum[:12]}...;"
                " applied migrations must never change (add a new one instead)"
            )
    return [m for m in available if m.version not in applied]
