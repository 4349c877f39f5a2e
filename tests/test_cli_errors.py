"""Every CLI error is one line naming the real problem; exit codes follow one table.

Each case runs the real `pglease` process against the test server.
"""

from __future__ import annotations

import json

import psycopg
import pytest

from .test_cli import migrate_schema, run


def one_line_error(result: object) -> str:
    """The single stderr line of a failed command, without the `pglease: error: ` prefix."""
    stderr: str = result.stderr  # type: ignore[attr-defined]
    assert stderr.startswith("pglease: error: ") and stderr.count("\n") == 1, stderr
    return stderr.removeprefix("pglease: error: ").rstrip("\n")


# --- usage errors: argparse --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["ls", "--ownr", "host:a"],
            "unrecognized arguments: --ownr host:a (did you mean --owner?)"
            " (try 'pglease ls --help')",
        ),
        (
            ["ls", "--ownr=host:a", "--tpe", "run"],
            "unrecognized arguments: --ownr=host:a --tpe run"
            " (did you mean --owner for --ownr, --type for --tpe?) (try 'pglease ls --help')",
        ),
        (["--jsn", "ls"], "unrecognized argument: --jsn (did you mean --json?)"),
        (["lss"], "unknown command 'lss' (did you mean 'ls'?) (try 'pglease --help')"),
        (["frobnicate"], "unknown command 'frobnicate' (try 'pglease --help')"),
        (
            ["session", "shw", "x"],
            "unknown command 'shw' (did you mean 'show'?) (try 'pglease session --help')",
        ),
        (["session", "show", "x", "--jsn"], "(did you mean --json?)"),
        (
            ["claim", "run", "a", "--owner", "host", "--ttl", "5"],
            "argument --owner: owner 'host' must be TYPE:ID (a type, a colon, an id),"
            " e.g. host:web-1 (try 'pglease claim --help')",
        ),
        (["claim", "run"], "the following arguments are required: key, --owner, --ttl"),
        (["completion", "fish"], "invalid choice: 'fish' (choose from 'bash', 'zsh')"),
    ],
)
def test_a_usage_error_is_one_line_with_the_close_match(
    pg_dsn: str, schema: str, args: list[str], expected: str
) -> None:
    result = run(pg_dsn, schema, *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert expected in one_line_error(result)


def test_help_is_unchanged(pg_dsn: str, schema: str) -> None:
    result = run(pg_dsn, schema, "claim", "--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: pglease claim")


# --- a typo in --schema ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["ls"], ["get", "run", "a"], ["events", "run", "a"], ["status"], ["session", "ls"]],
)
def test_a_schema_typo_on_a_read_is_one_short_line(
    pg_dsn: str, schema: str, args: list[str]
) -> None:
    typo = f"{schema}_typo"
    result = run(pg_dsn, typo, *args)
    assert result.returncode == 2
    message = one_line_error(result)
    assert message == (
        f"schema '{typo}' has no pglease tables: check the schema name (--schema,"
        f" PGLEASE_SCHEMA), or create them with `pglease --schema {typo} migrate`"
    )


def test_a_schema_behind_names_what_it_needs_in_one_line(pg_dsn: str, schema: str) -> None:
    assert run(pg_dsn, schema, "migrate").returncode == 0

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DELETE FROM "{schema}".schema_functions')
    result = run(pg_dsn, schema, "ls")
    assert result.returncode == 1
    message = one_line_error(result)
    assert message.startswith(f"schema '{schema}' needs functions@")
    assert message.endswith(f"; run `pglease --schema {schema} migrate` as the schema's owner")
    assert json.loads(run(pg_dsn, schema, "--json", "migrate").stdout)["applied"]


# --- one table of exit codes ---------------------------------------------------------------

FORGED_TOKEN = "A" * 43
#: A well-formed cursor no server of the test run has reached (transaction id 2**40).
AHEAD_CURSOR = f"{2**40}.1.aaaaaaaaaaaaaaaa"


@pytest.mark.parametrize(
    ("args", "code"),
    [
        # 2: usage or bad input, including naming something that does not exist
        (["get", "run", "nope"], 2),
        (["events", "run", "nope"], 2),
        (["revoke", "run", "nope"], 2),
        (["release", "run", "nope", "--owner", "host:a", "--token", FORGED_TOKEN], 2),
        (["session", "show", "nope"], 2),
        (["session", "export", "nope", "--to", "/nonexistent-pglease-dir"], 2),
        (["watch", "--after", "not-a-cursor", "--limit", "1"], 2),
        (["claim", "run", "held", "--owner", "host:b", "--ttl", "0"], 2),
        (["ls", "--ownr", "host:a"], 2),
        # 3: held by another owner
        (["claim", "run", "held", "--owner", "host:b", "--ttl", "30"], 3),
        # 4: lease not current, revision stale
        (["renew", "run", "held", "--owner", "host:a", "--token", FORGED_TOKEN, "--ttl", "5"], 4),
        (["release", "run", "held", "--owner", "host:b", "--token", FORGED_TOKEN], 4),
        # 5: a well-formed cursor this log cannot resume from (resync)
        (["watch", "--after", AHEAD_CURSOR, "--limit", "1"], 5),
        # 0
        (["get", "run", "held"], 0),
        (["session", "ls"], 0),
    ],
)
def test_exit_codes_follow_one_table(pg_dsn: str, schema: str, args: list[str], code: int) -> None:
    migrate_schema(pg_dsn, schema)
    claimed = run(pg_dsn, schema, "claim", "run", "held", "--owner", "host:a", "--ttl", "60")
    assert claimed.returncode == 0, claimed.stderr
    result = run(pg_dsn, schema, *args)
    assert result.returncode == code, result.stderr
    if code:  # one line on stderr (a held claim names the holder rather than an error)
        assert result.stderr.startswith("pglease: ") and result.stderr.count("\n") == 1


def test_a_held_claim_names_the_holder_and_a_zoned_expiry(pg_dsn: str, schema: str) -> None:
    migrate_schema(pg_dsn, schema)
    first = run(pg_dsn, schema, "--json", "claim", "run", "h", "--owner", "host:a", "--ttl", "60")
    expires_at = json.loads(first.stdout)["expires_at"]
    second = run(pg_dsn, schema, "claim", "run", "h", "--owner", "host:b", "--ttl", "60")
    assert second.returncode == 3
    assert second.stderr == (
        f"pglease: run/h is held by host:a (generation 1) until {expires_at}\n"
    )  # the ISO form every other output uses, with its zone
    assert expires_at.endswith("+00:00")


def test_a_schema_that_does_not_exist_is_exit_2_on_every_read(pg_dsn: str, schema: str) -> None:
    # A configuration problem (most often a typo'd --schema), the code a write to
    # such a schema gets too.
    for args in (["ls"], ["session", "show", "x"], ["watch", "--limit", "1"]):
        result = run(pg_dsn, f"{schema}_missing", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert "has no pglease tables" in one_line_error(result)
