"""`pglease embedded status|stop` on a private data directory (never the test server)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from .test_cli_elect import pglease_run


@pytest.fixture
def private_env() -> Iterator[dict[str, str]]:
    """An environment whose embedded default is a fresh data dir, with no other DSN."""
    base = Path(tempfile.mkdtemp(prefix="pglease-embcli-"))
    os.chmod(base, 0o755)  # as root the server runs as embedded_postgres and must get in
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGLEASE_"))}
    env["PGLEASE_EMBEDDED_DIR"] = str(base / "data")
    # Unset, platformdirs warns (RuntimeDirWarning) where embedded_postgres asks
    # it for a runtime directory: no command may show that.
    env.pop("XDG_RUNTIME_DIR", None)
    try:
        yield env
    finally:
        pglease_run("embedded", "stop", env=env)  # whatever the test left running
        shutil.rmtree(base, ignore_errors=True)


def test_status_and_stop_of_a_private_server(private_env: dict[str, str]) -> None:
    data_dir = private_env["PGLEASE_EMBEDDED_DIR"]
    before = pglease_run("embedded", "status", env=private_env)
    assert before.returncode == 3 and "not running" in before.stdout
    assert not Path(data_dir, "PG_VERSION").exists()  # status never starts it

    migrated = pglease_run("--json", "migrate", env=private_env, timeout=120)
    assert migrated.returncode == 0, migrated.stderr
    assert json.loads(migrated.stdout)["dsn_source"] == "embedded"
    claimed = pglease_run(
        "--json", "claim", "run", "r1", "--owner", "host:a", "--ttl", "30", env=private_env
    )
    assert claimed.returncode == 0, claimed.stderr
    assert json.loads(claimed.stdout)["dsn_source"] == "embedded"

    status = pglease_run("--json", "embedded", "status", env=private_env)
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["running"] and view["data_dir"] == str(Path(data_dir).resolve())
    assert view["pid"] > 0 and view["version"] and view["size_bytes"] > 0
    text = pglease_run("embedded", "status", env=private_env).stdout
    assert "running" in text and "pglease embedded stop" in text

    stopped = pglease_run("embedded", "stop", env=private_env)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped" in stopped.stdout
    assert stopped.stderr == ""  # no RuntimeDirWarning from platformdirs
    again = pglease_run("embedded", "stop", env=private_env)
    assert again.returncode == 0 and "not running" in again.stdout
    after = pglease_run("--json", "embedded", "status", env=private_env)
    assert after.returncode == 3 and json.loads(after.stdout)["running"] is False


def test_doctor_passes_on_the_embedded_server_pglease_starts(
    private_env: dict[str, str],
) -> None:
    migrated = pglease_run("migrate", env=private_env, timeout=120)
    assert migrated.returncode == 0, migrated.stderr
    result = pglease_run("--json", "doctor", env=private_env)
    report = json.loads(result.stdout)
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert result.returncode == report["exit_code"] == 0, verdicts
    # Configured the way doctor recommends...
    assert verdicts["idle_in_transaction_session_timeout"] == "ok"
    # ...and what is only advice on a private single server does not fail it.
    assert verdicts["superuser"] == "advice" and verdicts["synchronous_standby"] == "advice"
    text = pglease_run("doctor", env=private_env)
    assert text.returncode == 0, text.stdout
    assert "advice   superuser:" in text.stdout


def test_a_misspelt_dsn_variable_starts_no_embedded_server(
    private_env: dict[str, str],
) -> None:
    env = {**private_env, "PGLEASE_DNS": "postgresql://nobody@db.invalid/leases"}
    for args in (["claim", "run", "r1", "--owner", "host:a", "--ttl", "30"], ["ls"]):
        result = pglease_run(*args, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (
            "pglease: error: unknown environment variable PGLEASE_DNS (did you mean PGLEASE_DSN?)\n"
        )
    assert not Path(private_env["PGLEASE_EMBEDDED_DIR"]).exists()  # nothing started


def test_a_write_to_the_embedded_server_needs_a_migrated_schema_too(
    private_env: dict[str, str],
) -> None:
    # A host that lost its PGLEASE_DSN: the embedded server starts, but the
    # claim is refused, and the error says which server it looked at.
    result = pglease_run(
        "claim", "run", "r1", "--owner", "host:a", "--ttl", "30", env=private_env, timeout=120
    )
    assert result.returncode == 2, result.stderr
    notice, error = result.stderr.splitlines()
    assert notice.startswith("pglease: no --dsn, PGLEASE_DSN or PGHOST/PGSERVICE set: using")
    assert error == (
        "pglease: error: schema 'pglease' does not exist on the embedded PostgreSQL (set"
        " PGLEASE_DSN for your server); run `pglease --schema pglease migrate` to set it up"
        " (only migrate creates a schema)"
    )
    status = json.loads(pglease_run("--json", "embedded", "status", env=private_env).stdout)
    with psycopg.connect(status["dsn"]) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'pglease'")
        assert row.fetchone() == (0,)
