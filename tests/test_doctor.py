"""`pglease doctor`: every check against a real server (the test server, and a
PostgreSQL 15 primary/standby pair for the replication checks)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pglease import PostgresStore
from pglease.cli.doctor import main_args
from pglease.doctor import Report, doctor, parse_sync_names
from pglease.migrations import grant
from pglease.testing import set_test_clock

from . import _pgcluster
from ._pgcluster import wait_for


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        yield c


@pytest.fixture
def migrated(pg_dsn: str, schema: str) -> str:
    with PostgresStore(pg_dsn, schema=schema, max_size=1):
        pass
    return schema


def verdicts(report: Report) -> dict[str, str]:
    return {c.name: c.verdict for c in report.checks}


def test_a_schema_never_migrated_is_an_error(conn: psycopg.Connection[Any], schema: str) -> None:
    report = doctor(conn, schema)
    check = report.by_name("migrations")
    assert check.verdict == "error"
    assert "does not exist" in check.detail and "migrate" in check.advice
    assert report.exit_code == 2


def test_a_migrated_schema_on_the_test_server(conn: psycopg.Connection[Any], migrated: str) -> None:
    conn.execute("SET idle_in_transaction_session_timeout = '60s'")
    report = doctor(conn, migrated)
    got = verdicts(report)
    assert got["server_version"] == "ok"
    assert got["server_role"] == "ok"
    assert got["pooler"] == "ok"
    assert got["migrations"] == "ok"
    assert got["role"] == "ok" and "(owner)" in report.by_name("role").detail
    assert got["superuser"] == "advice"  # the test server's role is a superuser
    assert got["clock_offset"] == "ok" and "ms" in report.by_name("clock_offset").detail
    assert got["idle_in_transaction_session_timeout"] == "ok"
    assert got["test_clock"] == "ok"
    # A single server: nothing to fail over to, so only advice.
    assert got["synchronous_standby"] == "advice"
    # Advice never fails the exit status.
    assert report.worst == "ok" and report.exit_code == 0


def test_a_store_is_accepted_and_its_schema_used(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema, max_size=1) as store:
        report = doctor(store)
    assert report.schema == schema
    assert report.by_name("migrations").verdict == "ok"


def test_idle_in_transaction_timeout_zero_warns(
    conn: psycopg.Connection[Any], migrated: str
) -> None:
    conn.execute("SET idle_in_transaction_session_timeout = 0")
    check = doctor(conn, migrated).by_name("idle_in_transaction_session_timeout")
    assert check.verdict == "warn" and "60s" in check.advice


def test_the_test_clock_is_an_error(conn: psycopg.Connection[Any], migrated: str) -> None:
    set_test_clock(conn, migrated)
    report = doctor(conn, migrated)
    assert report.by_name("test_clock").verdict == "error"
    assert report.exit_code == 2


def test_a_transaction_holding_watchers_back_is_named(
    pg_dsn: str, conn: psycopg.Connection[Any], migrated: str
) -> None:
    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SELECT pg_current_xact_id()")  # takes an xid, left open
        pid = holder.info.backend_pid
        time.sleep(0.2)
        checks = [c for c in doctor(conn, migrated).checks if c.name == "watch_holdback"]
        holder.rollback()
    assert any(c.verdict == "warn" and f"pid {pid} " in c.detail for c in checks), checks


def test_the_holdback_names_the_oldest_xid_not_the_oldest_transaction(
    pg_dsn: str, conn: psycopg.Connection[Any], migrated: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # `early` begins first but only reads; `writer` takes an xid; then `early`
    # writes too. The frontier is `writer`'s xid, so `writer` is the one named.
    with (
        psycopg.connect(pg_dsn, application_name="doctor-early") as early,
        psycopg.connect(pg_dsn, application_name="doctor-writer") as writer,
    ):
        pid = writer.info.backend_pid
        early.execute("SELECT 1")  # transaction open, no xid yet
        time.sleep(0.05)
        [(writer_xid,)] = writer.execute("SELECT pg_current_xact_id()::text").fetchall()
        early.execute("SELECT pg_current_xact_id()")
        time.sleep(0.2)  # past the 100 ms threshold, by the server's clock
        report = doctor(conn, migrated)
        code = main_args(["--dsn", pg_dsn, "--schema", migrated, "doctor", "--json"])
        early.rollback()
        writer.rollback()
    [check] = [c for c in report.checks if c.name == "watch_holdback"]
    assert check.verdict == "warn"
    assert f"pid {pid} (doctor-writer," in check.detail
    assert f"transaction id {writer_xid} " in check.detail and "query started" in check.detail
    facts = check.facts
    assert facts["pid"] == pid
    assert facts["application_name"] == "doctor-writer"
    assert facts["state"] == "idle in transaction"
    assert facts["xid"] == writer_xid and facts["age_seconds"] >= 0.2
    assert facts["query_start"] is not None and facts["xact_start"] <= facts["query_start"]
    # --json carries the same particulars.
    out = json.loads(capsys.readouterr().out)
    assert code == out["exit_code"] >= 1
    [held] = [c for c in out["checks"] if c["name"] == "watch_holdback"]
    assert held["verdict"] == "warn"
    assert held["facts"]["pid"] == pid
    assert held["facts"]["application_name"] == "doctor-writer"
    # Once it ends, nothing holds watchers back.
    assert doctor(conn, migrated).by_name("watch_holdback").verdict == "ok"


def test_a_reading_transaction_does_not_hold_watchers_back(
    pg_dsn: str, conn: psycopg.Connection[Any], migrated: str
) -> None:
    with psycopg.connect(pg_dsn) as reader:
        reader.execute("SELECT count(*) FROM pg_catalog.pg_class")  # no xid
        time.sleep(0.2)
        check = doctor(conn, migrated).by_name("watch_holdback")
        reader.rollback()
    assert check.verdict == "ok" and check.facts == {}


@pytest.fixture
def role(conn: psycopg.Connection[Any]) -> Iterator[str]:
    name = f"doc_{uuid.uuid4().hex[:10]}"
    conn.execute(f'CREATE ROLE "{name}"')
    yield name
    conn.execute("RESET ROLE")
    conn.execute(f'DROP OWNED BY "{name}"')
    conn.execute(f'DROP ROLE "{name}"')


@pytest.mark.parametrize("kind", ["client", "reader", None])
def test_the_role_model(
    conn: psycopg.Connection[Any], migrated: str, role: str, kind: str | None
) -> None:
    if kind is not None:
        grant(conn, migrated, role, kind)  # type: ignore[arg-type]
    conn.execute(f'SET ROLE "{role}"')
    report = doctor(conn, migrated)
    check = report.by_name("role")
    if kind is None:
        assert check.verdict == "error"
        assert "--grant-client" in check.advice
    else:
        assert check.verdict == "ok"
        assert f"is a {kind} of" in check.detail
    assert "superuser" not in verdicts(report)
    assert "role_secrets" not in verdicts(report)


def test_a_role_that_can_read_token_hashes_is_an_error(
    conn: psycopg.Connection[Any], migrated: str, role: str
) -> None:
    grant(conn, migrated, role, "client")
    conn.execute(f'GRANT SELECT ON "{migrated}".leases TO "{role}"')
    conn.execute(f'SET ROLE "{role}"')
    assert doctor(conn, migrated).by_name("role_secrets").verdict == "error"


def test_cli_json_and_exit_codes(
    pg_dsn: str, migrated: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main_args(["--dsn", pg_dsn, "--schema", migrated, "doctor", "--json"])
    out = json.loads(capsys.readouterr().out)
    # The test server's idle_in_transaction_session_timeout is 0: a warning.
    assert code == out["exit_code"] == 1
    names = {c["name"] for c in out["checks"]}
    assert {"server_version", "migrations", "role", "pooler", "watch_holdback"} <= names
    # `facts` appears only where a check has particulars (a holdback, say).
    assert all(set(c) - {"facts"} == {"name", "verdict", "detail", "advice"} for c in out["checks"])

    code = main_args(["--dsn", pg_dsn, "--schema", "t_never_made", "doctor"])
    text = capsys.readouterr().out
    assert code == 2
    assert "error    migrations: schema 't_never_made' does not exist" in text


def test_cli_unreachable_server_exits_2(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code = main_args(["--dsn", f"host={tmp_path} port=1 user=x dbname=x", "doctor"])
    assert code == 2
    assert "pglease: error: doctor:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("", ("", 0, [])),
        ("standby1", ("FIRST", 1, ["standby1"])),
        ("a, b", ("FIRST", 1, ["a", "b"])),
        ("FIRST 1 (standby1)", ("FIRST", 1, ["standby1"])),
        ("ANY 2 (s1, s2, s3)", ("ANY", 2, ["s1", "s2", "s3"])),
        ("2 (a, b)", ("FIRST", 2, ["a", "b"])),
        ("*", ("FIRST", 1, ["*"])),
        ('FIRST 1 ("Standby A")', ("FIRST", 1, ["Standby A"])),
    ],
)
def test_parse_sync_names(value: str, parsed: tuple[str, int, list[str]]) -> None:
    assert parse_sync_names(value) == parsed


# --------------------------------------------------------------- replication (PG15)


@pytest.fixture
def pg15() -> None:
    if (reason := _pgcluster.skip_reason()) is not None:
        pytest.skip(reason)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("pg15")
def test_synchronous_standby_and_the_promotion_trap() -> None:
    with _pgcluster.cluster(synchronous=True) as cl:
        with cl.primary.connect() as c:
            report = doctor(c, "pglease")
        assert report.by_name("synchronous_standby").verdict == "ok"
        assert "standby1 (sync)" in report.by_name("synchronous_standby").detail
        assert report.by_name("synchronous_commit").verdict == "ok"
        with cl.standby.connect() as c:
            assert doctor(c, "pglease").by_name("server_role").verdict == "error"

        cl.primary.crash()
        cl.standby.promote()
        # A write on the promoted standby waits for a standby that is not there...
        done = threading.Event()

        def write() -> None:
            cl.standby.query("CREATE TABLE hung ()")
            done.set()

        threading.Thread(target=write, daemon=True).start()
        wait_for(
            "the write to wait for SyncRep",
            lambda: cl.standby.query("SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep'"),
        )
        with cl.standby.connect() as c:
            check = doctor(c, "pglease").by_name("synchronous_standby")
        assert check.verdict == "error"
        assert "1 backend(s) are waiting" in check.detail
        assert "synchronous_standby_names = ''" in check.advice
        assert not done.is_set()
        # ...until the runbook clears the inherited names (RESET would not).
        cl.standby.query("ALTER SYSTEM SET synchronous_standby_names = ''")
        cl.standby.query("SELECT pg_reload_conf()")
        wait_for("the hung write to commit", lambda: done.is_set(), 10)
        with cl.standby.connect() as c:
            after = doctor(c, "pglease").by_name("synchronous_standby")
        assert after.verdict == "advice" and "no standby" in after.detail


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("pg15")
def test_asynchronous_standby_warns() -> None:
    with _pgcluster.cluster(synchronous=False) as cl, cl.primary.connect() as c:
        check = doctor(c, "pglease").by_name("synchronous_standby")
    assert check.verdict == "warn"
    assert "1 asynchronous standby(s) attached" in check.detail
