"""The command line, run as a real process: output, --json and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pglease.migrations import migrate

ROOT = Path(__file__).resolve().parent.parent


def migrate_schema(pg_dsn: str, schema: str) -> str:
    """Set `schema` up as `pglease migrate` does (a CLI command that writes needs it)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, schema)
    return schema


def run(
    pg_dsn: str, schema: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_lease_lifecycle_with_exit_codes(pg_dsn: str, schema: str) -> None:
    migrated = run(pg_dsn, schema, "--json", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "0001_core" in json.loads(migrated.stdout)["applied"]
    assert "up to date" in run(pg_dsn, schema, "migrate").stdout

    claimed = run(
        pg_dsn, schema, "claim", "run", "r1", "--owner", "host:a", "--ttl", "30", "--json"
    )
    assert claimed.returncode == 0, claimed.stderr
    claim = json.loads(claimed.stdout)
    assert (claim["generation"], claim["revision"], claim["owner"]) == (1, 1, "host:a")
    token = claim["token"]

    held = run(pg_dsn, schema, "claim", "run", "r1", "--owner", "host:b", "--ttl", "30")
    assert held.returncode == 3
    assert "held by host:a (generation 1)" in held.stderr

    renewed = run(
        pg_dsn,
        schema,
        "renew",
        "run",
        "r1",
        "--owner",
        "host:a",
        "--token",
        token,
        "--ttl",
        "60",
        "--json",
    )
    assert renewed.returncode == 0, renewed.stderr
    assert json.loads(renewed.stdout)["revision"] == 2

    listed = run(pg_dsn, schema, "ls", "--json")
    [row] = json.loads(listed.stdout)
    assert (row["key"], row["holder"], row["generation"], row["revision"]) == ("r1", "host:a", 1, 2)
    table = run(pg_dsn, schema, "ls", "--type", "run").stdout
    assert "host:a" in table and "TIME LEFT" in table

    wrong_owner = run(pg_dsn, schema, "release", "run", "r1", "--owner", "host:b", "--token", token)
    assert wrong_owner.returncode == 4
    assert wrong_owner.stderr.count("\n") == 1 and "no longer current" in wrong_owner.stderr

    stale = run(
        pg_dsn,
        schema,
        "release",
        "run",
        "r1",
        "--owner",
        "host:a",
        "--token",
        token,
        "--expected-revision",
        "1",
    )
    assert stale.returncode == 4 and "expected 1" in stale.stderr

    released = run(pg_dsn, schema, "release", "run", "r1", "--owner", "host:a", "--token", token)
    assert released.returncode == 0, released.stderr
    again = run(pg_dsn, schema, "release", "run", "r1", "--owner", "host:a", "--token", token)
    assert again.returncode == 4

    events = run(pg_dsn, schema, "events", "run", "r1", "--json")
    types = [json.loads(line)["type"] for line in events.stdout.splitlines()]
    assert types == ["lease.claimed", "lease.renewed", "lease.released"]
    assert "lease.renewed" in run(pg_dsn, schema, "events", "run", "r1").stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["claim", "run", "r1", "--owner", "host:a", "--ttl", "0"], 2, "ttl must be"),
        (["claim", "run", "r1", "--owner", "host:a", "--ttl", "nan"], 2, "ttl must be finite"),
        (["claim", "Run", "r1", "--owner", "host:a", "--ttl", "5"], 2, "resource type"),
        (["claim", "run", "r1", "--owner", "nocolon", "--ttl", "5"], 2, "must be TYPE:ID"),
        (
            ["renew", "run", "r1", "--owner", "host:a", "--token", "bad", "--ttl", "5"],
            2,
            "token is malformed",
        ),
        (["bogus"], 2, "unknown command 'bogus'"),
        (["claim", "run"], 2, "required"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    pg_dsn: str, schema: str, args: list[str], code: int, message: str
) -> None:
    result = run(pg_dsn, schema, *args)
    assert result.returncode == code
    assert message in result.stderr
    assert result.stderr.startswith("pglease: error: ") and result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_unreachable_database_is_one_line_exit_1(schema: str) -> None:
    result = run("postgresql://nobody@127.0.0.1:1/none?connect_timeout=2", schema, "ls")
    assert result.returncode == 1
    assert result.stderr.startswith("pglease: error:")
    assert len(result.stderr.strip().splitlines()) == 1


def test_demo_runs_a_fleet_and_checks_invariants(pg_dsn: str, schema: str) -> None:
    result = run(
        pg_dsn,
        schema,
        "--json",
        "demo",
        "--hosts",
        "3",
        "--resources",
        "2",
        "--seconds",
        "5",
        "--ttl",
        "0.5",
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["violations"] == []
    assert report["killed_host"] is not None
    assert sum(r["claims"] for r in report["resources"]) > 2
    assert any(r["takeovers"] > 0 for r in report["resources"])
    for r in report["resources"]:
        assert r["final_generation"] == r["claims"] and r["violations"] == []
