"""Durations wherever the CLI takes a time; prune --dry-run / --force; reap --json."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import psycopg
import pytest

from pglease import Owner, PostgresStore
from pglease.cli import main
from pglease.durations import DurationError, parse_duration

from .test_cli import migrate_schema, run

A = Owner("host", "a")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30.0),
        ("30s", 30.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        ("1h30m", 5400.0),
        ("1m30s", 90.0),
        ("2w", 1209600.0),  # prune --older-than always took weeks
        (" 15M ", 900.0),
        ("0", 0.0),
        ("1e3", 1000.0),
        (".5s", 0.5),
    ],
)
def test_accepted(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is not a duration"),
        ("soon", "is not a duration"),
        ("5x", "is not a duration"),
        ("1h30", "is not a duration"),
        ("s", "is not a duration"),
        ("1 h", "is not a duration"),
        ("-5s", "must be zero or more"),
        ("-1", "must be zero or more"),
        ("nan", "must be finite"),
        ("inf", "must be finite"),
        ("1e400", "too large"),
        ("99999999999", "too large"),
        ("200000w", "too large"),
    ],
)
def test_refused(text: str, message: str) -> None:
    with pytest.raises(DurationError, match=message):
        parse_duration(text)


def _code(pg_dsn: str, schema: str, *args: str) -> int:
    try:
        return main(["--dsn", pg_dsn, "--schema", schema, *args])
    except SystemExit as exc:  # argparse usage errors
        return int(exc.code or 0)


def test_claim_and_renew_take_durations(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate_schema(pg_dsn, schema)
    claim_args = ["--json", "claim", "run", "r1", "--owner", "host:a", "--ttl", "2m"]
    assert _code(pg_dsn, schema, *claim_args) == 0
    claim = json.loads(capsys.readouterr().out)
    assert _code(pg_dsn, schema, "--json", "get", "run", "r1") == 0
    view = json.loads(capsys.readouterr().out)
    left = datetime.fromisoformat(claim["expires_at"]) - datetime.fromisoformat(view["db_now"])
    assert timedelta(seconds=60) < left <= timedelta(minutes=2)
    renew = ["--json", "renew", "run", "r1", "--owner", "host:a", "--token", claim["token"]]
    assert _code(pg_dsn, schema, *renew, "--ttl", "1500ms") == 0
    assert json.loads(capsys.readouterr().out)["revision"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["claim", "run", "r1", "--owner", "host:a", "--ttl", "5x"], "ttl '5x' is not a duration"),
        (["claim", "run", "r1", "--owner", "host:a", "--ttl", "8d"], "ttl must be at most"),
        (["claim", "run", "r1", "--owner", "host:a", "--ttl", "0s"], "ttl must be at least"),
        (["status", "--within", "later"], "--within 'later' is not a duration"),
        (["status", "--within=inf"], "--within must be finite"),
        (["prune", "--older-than", "1d2"], "--older-than '1d2' is not a duration"),
        (["prune", "--older-than=-1d"], "--older-than must be zero or more"),
        (["reap", "--once", "--interval", "0"], "--interval must be"),
    ],
)
def test_bad_durations_are_usage_errors(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert _code(pg_dsn, schema, *args) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert "Traceback" not in captured.err


# --- prune ---------------------------------------------------------------------------


def _events(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".events').fetchone()
    assert row is not None
    return int(row[0])


def test_prune_dry_run_counts_and_deletes_nothing(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    for key in ("a", "b", "c"):
        claim = pg_store.claim(pg_store.ensure_resource("run", key), A, 30)
        assert claim is not None
        pg_store.release(claim)
    assert _events(pg_dsn, schema) == 6

    result = run(pg_dsn, schema, "--json", "prune", "--older-than", "0", "--dry-run")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["dry_run"], report["would_delete"]) == (True, 6)
    assert datetime.fromisoformat(report["oldest"]) <= datetime.fromisoformat(report["newest"])
    assert report["longest_ttl_seconds"] is None and report["floor_seconds"] == 86400
    assert report["needs_force"] is True  # 0 is below the one-day floor
    assert _events(pg_dsn, schema) == 6

    nothing = run(pg_dsn, schema, "--json", "prune", "--older-than", "1h", "--dry-run")
    assert json.loads(nothing.stdout)["would_delete"] == 0
    assert json.loads(nothing.stdout)["oldest"] is None
    text = run(pg_dsn, schema, "prune", "--older-than", "0", "--dry-run")
    assert "would delete 6 events (created " in text.stdout and "nothing deleted" in text.stdout

    # The real prune deletes what the dry run counted.
    pruned = run(pg_dsn, schema, "--json", "prune", "--older-than", "0", "--force")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["deleted"] == 6
    assert _events(pg_dsn, schema) == 0


def test_prune_below_the_one_day_floor_needs_force_even_with_no_lease_held(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    for key in ("a", "b"):
        claim = pg_store.claim(pg_store.ensure_resource("run", key), A, 30)
        assert claim is not None
        pg_store.release(claim)
    assert _events(pg_dsn, schema) == 4  # and no lease is held now

    for age in ("0s", "23h"):
        refused = run(pg_dsn, schema, "prune", "--older-than", age)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr == (
            f"pglease: error: --older-than {age} is below the floor of 1d (the minimum"
            " retention); pass --force to prune anyway\n"
        )
        assert _events(pg_dsn, schema) == 4  # nothing deleted
    assert run(pg_dsn, schema, "prune", "--older-than", "1d").returncode == 0
    forced = run(pg_dsn, schema, "--json", "prune", "--older-than", "0s", "--force")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["deleted"] == 4


def test_prune_refuses_an_age_below_the_longest_ttl_unless_forced(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    # A lease longer than the one-day floor raises the floor to its TTL.
    assert pg_store.claim(pg_store.ensure_resource("run", "long"), A, 2 * 86400) is not None
    assert pg_store.claim(pg_store.ensure_resource("run", "short"), A, 5) is not None

    refused = run(pg_dsn, schema, "prune", "--older-than", "1d")
    assert refused.returncode == 2
    assert refused.stderr.startswith("pglease: error:") and len(refused.stderr.splitlines()) == 1
    assert "--older-than 1d is below the floor of 2d" in refused.stderr
    assert "(the longest TTL in use, 172800s, a held lease)" in refused.stderr
    assert "--force" in refused.stderr
    assert _events(pg_dsn, schema) == 2

    dry = run(pg_dsn, schema, "--json", "prune", "--older-than", "1d", "--dry-run")
    assert dry.returncode == 0
    report = json.loads(dry.stdout)
    assert report["needs_force"] is True
    assert report["longest_ttl_seconds"] == report["floor_seconds"] == pytest.approx(172800)
    assert "would refuse" in dry.stderr

    assert run(pg_dsn, schema, "prune", "--older-than", "3d").returncode == 0
    forced = run(pg_dsn, schema, "--json", "prune", "--older-than", "0", "--force")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["deleted"] == 2


def test_reap_once_json(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    rid = pg_store.ensure_resource("run", "gone")
    past = pg_store.get(rid).updated_at - timedelta(hours=1)
    assert pg_store.claim(rid, A, 1, now=past) is not None  # expired an hour ago
    result = run(pg_dsn, schema, "--json", "reap", "--once")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"reaped": 1}
    again = run(pg_dsn, schema, "reap", "--once", "--json")
    assert json.loads(again.stdout) == {"reaped": 0}
    assert run(pg_dsn, schema, "reap", "--once").stdout == "reaped 0 leases\n"
