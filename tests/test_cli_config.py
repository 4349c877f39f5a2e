"""A misconfiguration fails loudly: an unknown PGLEASE_* variable, or a --schema
`pglease migrate` never set up, is refused before anything is written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pglease import dsn, errors
from pglease.errors import ValidationError
from pglease.ids import new_token

from .test_cli import ROOT, migrate_schema

#: Names the tests set on purpose as the typos they are.
MISSPELT = {"PGLEASE_DNS", "PGLEASE_SCHMEA", "PGLEASE_WHATEVER"}


def _pglease(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def _schema_exists(pg_dsn: str, schema: str) -> bool:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", [schema])
        return row.fetchone() == (1,)


# --- PGLEASE_* variables -------------------------------------------------------------


def test_every_pglease_variable_in_the_tree_is_known() -> None:
    # Whatever the code, the tests, the tools or the README name must not be
    # refused: tests run the CLI with PGLEASE_TEST_DSN set, `hold` sets
    # PGLEASE_FENCE for a command that may run pglease, ...
    found: set[str] = set()
    for top in ("pglease", "tests", "bench", "tools", ".ci", "examples", "docker", "README.md"):
        path = ROOT / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            if file.suffix in (".pyc", ".sqlite", ".png") or "__pycache__" in file.parts:
                continue
            try:
                text = file.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            found.update(re.findall(r"\bPGLEASE_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert "PGLEASE_DSN" in found and "PGLEASE_TEST_DSN" in found
    assert found - MISSPELT - dsn.KNOWN_ENV == set()
    assert not set(dsn.USER_ENV) & set(dsn.DEV_ENV)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"PGLEASE_DNS": "host=db"},
            "unknown environment variable PGLEASE_DNS (did you mean PGLEASE_DSN?)",
        ),
        (
            {"pglease_schema": "x"},
            "unknown environment variable pglease_schema (did you mean PGLEASE_SCHEMA?)",
        ),
        (
            {"PGLEASE_WHATEVER": "1", "PGLEASE_SCHMEA": "x", "PGLEASE_TEST_DSN": "host=h"},
            "unknown environment variables PGLEASE_SCHMEA (did you mean PGLEASE_SCHEMA?),"
            " PGLEASE_WHATEVER; pglease reads PGLEASE_DSN, PGLEASE_SCHEMA, PGLEASE_POOLER,",
        ),
    ],
)
def test_unknown_variables_are_named(environ: dict[str, str], message: str) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        dsn.check_environment({**environ, "PGLEASE_DSN": "host=h", "HOME": "/"})
    assert str(caught.value).startswith(message)
    assert isinstance(caught.value, ValidationError)
    assert "host=" not in str(caught.value)  # never a value: it may hold a password


def test_known_variables_pass() -> None:
    dsn.check_environment({name: "x" for name in dsn.KNOWN_ENV} | {"PGHOST": "h", "PG_FOO": "1"})


def test_the_library_refuses_to_guess_from_a_misspelt_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PGLEASE_DSN", raising=False)
    monkeypatch.setenv("PGLEASE_EMBEDDED_DIR", str(tmp_path / "never"))
    monkeypatch.setenv("PGLEASE_DNS", "host=db")
    with pytest.raises(ValidationError, match=r"PGLEASE_DNS \(did you mean PGLEASE_DSN\?\)"):
        dsn.resolve_dsn_source()
    assert not (tmp_path / "never").exists()  # no embedded server started
    # An explicit DSN does not consult the environment.
    assert dsn.resolve_dsn_source("host=h") == ("host=h", "argument")


@pytest.mark.parametrize(
    "args",
    [
        ["claim", "run", "r1", "--owner", "host:a", "--ttl", "30"],
        ["ls"],
        ["embedded", "status"],  # connects to nothing, still refused
    ],
)
def test_the_cli_refuses_an_unknown_variable_whatever_the_command(
    pg_dsn: str, schema: str, args: list[str]
) -> None:
    migrate_schema(pg_dsn, schema)
    env = {**os.environ, "PGLEASE_SCHMEA": "other"}
    result = _pglease("--dsn", pg_dsn, "--schema", schema, *args, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "pglease: error: unknown environment variable PGLEASE_SCHMEA"
        " (did you mean PGLEASE_SCHEMA?)\n"
    )
    assert result.stdout == ""
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".resources').fetchone()
    assert row == (0,)


# --- a --schema migrate never set up --------------------------------------------------


WRITES = [
    ["claim", "run", "r1", "--owner", "host:a", "--ttl", "30"],
    ["renew", "run", "r1", "--owner", "host:a", "--ttl", "30", "--token", new_token()],
    ["release", "run", "r1", "--owner", "host:a", "--token", new_token()],
    ["revoke", "run", "r1"],
    ["hold", "run", "r1", "--owner", "host:a", "--ttl", "5", "--", sys.executable, "-c", ""],
    ["elect", "sched", "--owner", "host:a", "--ttl", "5", "--", sys.executable, "-c", ""],
    ["reap", "--once"],
    ["prune", "--older-than", "7d"],
    ["session", "import", "/nonexistent/session.sqlite"],
]


@pytest.mark.parametrize("args", WRITES, ids=lambda a: a[0])
def test_a_write_to_a_schema_never_migrated_is_refused(
    pg_dsn: str, schema: str, args: list[str]
) -> None:
    # `schema` is a fresh name nobody migrated: `--schema pglaese`.
    result = _pglease("--dsn", pg_dsn, "--schema", schema, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        f"pglease: error: schema {schema!r} does not exist; run `pglease --schema {schema}"
        " migrate` to set it up (only migrate creates a schema)\n"
    )
    assert not _schema_exists(pg_dsn, schema)


def test_a_schema_without_pglease_tables_is_refused_and_left_alone(
    pg_dsn: str, schema: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    result = _pglease("--dsn", pg_dsn, "--schema", schema, *WRITES[0])
    assert result.returncode == 2, result.stderr
    assert f"schema {schema!r} holds no pglease tables; run `pglease --schema" in result.stderr
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s",
            [schema],
        ).fetchone()
    assert row == (0,)


def test_migrate_creates_the_schema_and_then_writes_go_through(pg_dsn: str, schema: str) -> None:
    assert _pglease("--dsn", pg_dsn, "--schema", schema, "migrate").returncode == 0
    result = _pglease("--dsn", pg_dsn, "--schema", schema, *WRITES[0])
    assert result.returncode == 0, result.stderr
    assert "generation: 1" in result.stdout
