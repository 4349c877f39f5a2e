"""Operator commands through the real CLI: get, status, revoke, --version."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import psycopg
import pytest

import pglease
from pglease import Owner, Permit, PostgresStore
from pglease.cli import main
from pglease.roles import grant

from .test_cli import ROOT, migrate_schema, run
from .test_trust import Roles

A = Owner("host", "a")


def cli(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """One in-process run of `pglease`: (exit code, stdout, stderr)."""
    code = main(["--dsn", pg_dsn, "--schema", schema, *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> None:
    assert err.startswith("pglease: error:"), err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def resources(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".resources').fetchone()
    assert row is not None
    return int(row[0])


def _claim(pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], key: str) -> str:
    migrate_schema(pg_dsn, schema)
    code, out, err = cli(pg_dsn, schema, capsys, "--json", "claim", "run", key,
                         "--owner", "host:a", "--ttl", "30s")  # fmt: skip
    assert code == 0, err
    token: str = json.loads(out)["token"]
    return token


# --- get ---------------------------------------------------------------------------


def test_get_shows_the_lease_time_left_and_the_last_event_as_json(
    pg_store: PostgresStore, pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rid = pg_store.ensure_resource("run", "r1")
    claim = pg_store.claim(rid, A, 30)
    assert claim is not None
    payload = {"b": 1, "a": [1, "é"]}
    pg_store.mutate(Permit(rid, claim.revision, claim), "job.step", payload=payload)

    code, out, err = cli(pg_dsn, schema, capsys, "get", "run", "r1", "--json")
    assert code == 0, err
    view = json.loads(out)
    assert (view["id"], view["type"], view["key"], view["revision"]) == (rid, "run", "r1", 2)
    lease = view["lease"]
    assert (lease["held"], lease["holder"], lease["generation"]) == (True, "host:a", 1)
    assert 0 < lease["seconds_left"] <= 30
    assert datetime.fromisoformat(lease["expires_at"]) == claim.expires_at
    last = view["last_event"]
    assert (last["type"], last["revision"], last["payload"]) == ("job.step", 2, payload)
    datetime.fromisoformat(last["created_at"])

    code, out, err = cli(pg_dsn, schema, capsys, "get", "run", "r1")
    assert code == 0, err
    assert "held by host:a, generation 1" in out and "left by the database clock" in out
    # The payload is JSON text (canonical: sorted keys, no spaces), not a Python repr.
    assert 'payload {"a":[1,"é"],"b":1}' in out

    code, out, _ = cli(pg_dsn, schema, capsys, "events", "run", "r1")
    assert code == 0
    assert '{"a":[1,"é"],"b":1}' in out and "'a'" not in out


def test_get_of_a_free_resource(
    pg_store: PostgresStore, pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rid = pg_store.ensure_resource("run", "r1")
    claim = pg_store.claim(rid, A, 30)
    assert claim is not None
    pg_store.release(claim)
    code, out, err = cli(pg_dsn, schema, capsys, "--json", "get", "run", "r1")
    assert code == 0, err
    view = json.loads(out)
    assert view["lease"]["held"] is False and view["lease"]["holder"] is None
    assert view["lease"]["seconds_left"] is None
    assert view["last_event"]["type"] == "lease.released"
    code, out, _ = cli(pg_dsn, schema, capsys, "get", "run", "r1")
    assert "lease:      free, generation 1" in out


def test_get_of_an_unknown_resource_exits_2_and_creates_nothing(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    pg_store.ensure_resource("run", "other")
    result = run(pg_dsn, schema, "get", "run", "nosuch", "--json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "pglease: error: unknown resource run/nosuch (nothing was ever claimed there)\n"
    )
    assert resources(pg_dsn, schema) == 1


def test_get_on_a_typod_schema_creates_no_schema(pg_dsn: str, schema: str) -> None:
    result = run(pg_dsn, schema, "get", "run", "r1")
    assert result.returncode == 2
    one_error_line(result.stderr)
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", [schema])
        assert row.fetchone() == (0,)


# --- status ------------------------------------------------------------------------


def test_status_counts_and_warns_about_the_test_clock(
    pg_store: PostgresStore, pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # pg_store switched the test clock on: status must say so loudly.
    for key, ttl in (("soon", 5.0), ("later", 600.0)):
        assert pg_store.claim(pg_store.ensure_resource("run", key), A, ttl) is not None
    pg_store.ensure_resource("run", "free")

    code, out, err = cli(pg_dsn, schema, capsys, "--json", "status", "--within", "1m")
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == schema
    assert report["migrations"] == {"up_to_date": True, "pending": []}
    assert (report["resources"], report["held"]) == (3, 2)
    assert report["expiring"] == {"within_seconds": 60.0, "count": 1}
    assert report["events"]["count"] == 2
    datetime.fromisoformat(report["events"]["oldest_at"])
    assert report["test_clock"] is True
    assert "WARNING: the test clock is ON" in err
    assert report["server_version"]
    assert report["dsn_source"] == "argument"
    assert set(report["watcher_hubs"]) == {"count", "hidden_sessions", "complete"}

    code, out, err = cli(pg_dsn, schema, capsys, "status")
    assert code == 0
    assert "up to date" in out and "ON (tests only!)" in out and "held:         2" in out
    assert "WARNING" in err


def test_status_of_a_deployed_schema_has_no_warning_and_reports_pending_work(
    pg_dsn: str, schema: str
) -> None:
    assert run(pg_dsn, schema, "migrate").returncode == 0
    result = run(pg_dsn, schema, "--json", "status")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert report["test_clock"] is False
    assert (report["resources"], report["held"], report["events"]["count"]) == (0, 0, 0)
    assert report["events"]["oldest_at"] is None

    # As after a pglease upgrade: the function set is behind. A store would
    # refuse to open; status reports it and still counts.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DELETE FROM "{schema}".schema_functions')
    result = run(pg_dsn, schema, "--json", "status")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["migrations"]["up_to_date"] is False
    assert [p.split("@")[0] for p in report["migrations"]["pending"]] == ["functions"]
    assert report["resources"] == 0
    assert "pending: functions@" in run(pg_dsn, schema, "status").stdout


def test_status_of_a_missing_schema_is_one_error_line_and_creates_nothing(
    pg_dsn: str, schema: str
) -> None:
    result = run(pg_dsn, schema, "status")
    assert result.returncode == 2
    one_error_line(result.stderr)
    assert f"schema '{schema}' has no pglease tables" in result.stderr


def test_status_sees_a_watchers_hub_connection(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    def hubs() -> int:
        result = run(pg_dsn, schema, "--json", "status")
        assert result.returncode == 0, result.stderr
        count: int = json.loads(result.stdout)["watcher_hubs"]["count"]
        return count

    assert hubs() == 0
    watcher = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, "watch"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while (seen := hubs()) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert seen >= 1
    finally:
        watcher.terminate()
        watcher.wait(timeout=30)


# --- revoke ------------------------------------------------------------------------


def test_revoke_fences_the_holder_whose_renew_then_exits_4(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(_claim(pg_dsn, schema, capsys, "r1") + "\n")

    code, out, err = cli(pg_dsn, schema, capsys, "--json", "revoke", "run", "r1")
    assert code == 0, err
    done = json.loads(out)
    assert (done["revoked"], done["fenced"], done["generation"]) == (True, "host:a", 2)
    assert done["type"] == "run" and done["key"] == "r1"

    renew = run(pg_dsn, schema, "renew", "run", "r1", "--owner", "host:a",
                "--token-file", str(token_file), "--ttl", "30")  # fmt: skip
    assert renew.returncode == 4, renew.stderr
    one_error_line(renew.stderr)

    # Nothing left to revoke: exit 0, nothing changes.
    code, out, _ = cli(pg_dsn, schema, capsys, "revoke", "run", "r1")
    assert code == 0
    assert "is not held: nothing revoked (generation 2" in out
    code, out, _ = cli(pg_dsn, schema, capsys, "--json", "events", "run", "r1")
    types = [json.loads(line)["type"] for line in out.splitlines()]
    assert types == ["lease.claimed", "lease.revoked"]


def test_revoke_prints_who_was_fenced(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _claim(pg_dsn, schema, capsys, "r1")
    code, out, err = cli(pg_dsn, schema, capsys, "revoke", "run", "r1")
    assert code == 0, err
    assert out.startswith("revoked run/r1: host:a is fenced (generation 1 ended);")
    assert "generation now 2" in out
    # Nobody can claim before the revoked holder's last expiry, and it says when.
    assert "; claimable again at " in out and out.count("\n") == 1
    code, _, err = cli(pg_dsn, schema, capsys, "claim", "run", "r1", "--owner", "host:b",
                       "--ttl", "30")  # fmt: skip
    assert code == 3, err
    assert "was revoked (generation 2); it cannot be claimed before" in err


def test_revoke_of_an_unknown_resource_exits_2_and_creates_nothing(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    result = run(pg_dsn, schema, "revoke", "run", "nosuch")
    assert result.returncode == 2
    assert result.stderr == (
        "pglease: error: unknown resource run/nosuch (nothing was ever claimed there)\n"
    )
    assert resources(pg_dsn, schema) == 0


@pytest.fixture
def client_dsn(pg_dsn: str, schema: str, pg_store: PostgresStore) -> Iterator[str]:
    """The DSN of a login role granted the client kind on the test's schema."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
        if not (row and row[0]):
            pytest.skip("the test server's user cannot create roles")
    roles = Roles(pg_dsn)
    try:
        name, dsn = roles.make("client")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            grant(conn, schema, name, "client")
        yield dsn
    finally:
        roles.drop()


def test_a_client_role_cannot_revoke(
    pg_store: PostgresStore, client_dsn: str, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("run", "r1")
    claim = pg_store.claim(rid, A, 600)
    assert claim is not None
    result = run(client_dsn, schema, "revoke", "run", "r1")
    assert result.returncode == 1
    one_error_line(result.stderr)
    assert "permission denied" in result.stderr and "role model" in result.stderr
    assert pg_store.get(rid).lease.generation == 1  # still held, not fenced
    assert pg_store.renew(claim, 30).generation == 1


# --- version -----------------------------------------------------------------------


def test_version(pg_dsn: str, schema: str) -> None:
    result = run(pg_dsn, schema, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"pglease {pglease.__version__}"
    assert pglease.__version__.count(".") >= 1
