"""Commands that read never write: no resource rows, no schema for a typo'd --schema."""

from __future__ import annotations

import subprocess
import sys

import psycopg
import pytest

from pglease import PostgresStore
from pglease.ids import new_token

from .test_cli import ROOT, run


def _resources(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".resources').fetchone()
    assert row is not None
    return int(row[0])


def _schema_exists(pg_dsn: str, schema: str) -> bool:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = %s", [schema]
        ).fetchone()
    assert row is not None
    return bool(row[0])


@pytest.mark.parametrize(
    "args",
    [
        ["events", "run", "nosuch"],
        ["release", "run", "nosuch", "--owner", "host:a", "--token", new_token()],
        ["renew", "run", "nosuch", "--owner", "host:a", "--token", new_token(), "--ttl", "5"],
    ],
)
def test_unknown_resource_exits_2_and_creates_nothing(
    pg_store: PostgresStore, pg_dsn: str, schema: str, args: list[str]
) -> None:
    pg_store.ensure_resource("run", "other")
    result = run(pg_dsn, schema, *args)
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr
        == "pglease: error: unknown resource run/nosuch (nothing was ever claimed there)\n"
    )
    assert _resources(pg_dsn, schema) == 1


@pytest.mark.parametrize("ttl", ["0", "nan", "-1", "1e9"])
def test_claim_refused_for_its_ttl_leaves_no_row(
    pg_store: PostgresStore, pg_dsn: str, schema: str, ttl: str
) -> None:
    result = run(pg_dsn, schema, "claim", "run", "r1", "--owner", "host:a", "--ttl", ttl)
    assert result.returncode == 2
    assert "ttl must be" in result.stderr
    assert _resources(pg_dsn, schema) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["ls"],
        ["events", "run", "r1"],
        ["watch", "--after", "start", "--limit", "1"],
        ["session", "ls"],
        ["--no-migrate", "claim", "run", "r1", "--owner", "host:a", "--ttl", "5"],
        ["--no-migrate", "prune", "--older-than", "1d"],
    ],
)
def test_typod_schema_is_never_created(pg_dsn: str, schema: str, args: list[str]) -> None:
    # `schema` is a fresh name nobody migrated: the typo.
    result = subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.startswith("pglease: error:")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert not _schema_exists(pg_dsn, schema)


def test_migrate_still_migrates_under_no_migrate(pg_dsn: str, schema: str) -> None:
    result = run(pg_dsn, schema, "--no-migrate", "migrate")
    assert result.returncode == 0, result.stderr
    assert _schema_exists(pg_dsn, schema)
    assert _resources(pg_dsn, schema) == 0
