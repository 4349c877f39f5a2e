"""renew/release take the token from --token, --token-file (or stdin), or $PGLEASE_TOKEN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pglease.cli import main
from pglease.ids import new_token

from .test_cli import ROOT, migrate_schema


def _lease(pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], key: str = "r1") -> str:
    migrate_schema(pg_dsn, schema)
    code = main(["--dsn", pg_dsn, "--schema", schema, "--json", "claim", "run", key,
                 "--owner", "host:a", "--ttl", "30"])  # fmt: skip
    assert code == 0
    token: str = json.loads(capsys.readouterr().out)["token"]
    return token


def _renew(pg_dsn: str, schema: str, *token_args: str) -> int:
    return main(["--dsn", pg_dsn, "--schema", schema, "--json", "renew", "run", "r1",
                 "--owner", "host:a", "--ttl", "30", *token_args])  # fmt: skip


def test_token_file_with_trailing_newline(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token = _lease(pg_dsn, schema, capsys)
    path = tmp_path / "token"
    path.write_text(token + "\n")
    assert _renew(pg_dsn, schema, "--token-file", str(path)) == 0
    assert json.loads(capsys.readouterr().out)["revision"] == 2


def test_token_from_stdin_for_release(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    token = _lease(pg_dsn, schema, capsys)
    result = subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, "--json",
         "release", "run", "r1", "--owner", "host:a", "--token-file", "-"],
        cwd=ROOT, input=token + "\n", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["released"] is True


def test_token_from_environment(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    token = _lease(pg_dsn, schema, capsys)
    monkeypatch.setenv("PGLEASE_TOKEN", token)
    assert _renew(pg_dsn, schema) == 0
    assert json.loads(capsys.readouterr().out)["revision"] == 2


def test_flags_take_precedence_over_the_environment(
    pg_dsn: str,
    schema: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    token = _lease(pg_dsn, schema, capsys)
    # A well-formed but wrong token in the environment: using it would exit 4.
    monkeypatch.setenv("PGLEASE_TOKEN", new_token())
    assert _renew(pg_dsn, schema, "--token", token) == 0
    path = tmp_path / "token"
    path.write_text(token)
    assert _renew(pg_dsn, schema, "--token-file", str(path)) == 0
    assert _renew(pg_dsn, schema) == 4
    assert "no longer current" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("token_args", "message"),
    [
        ([], "a lease token is required: --token TOK, --token-file FILE"),
        (["--token-file", "/nonexistent/token"], "cannot read the token from /nonexistent/token"),
        (["--token-file", "EMPTY"], "is empty"),
    ],
)
def test_missing_or_unreadable_token_is_a_usage_error(
    pg_dsn: str,
    schema: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    token_args: list[str],
    message: str,
) -> None:
    monkeypatch.delenv("PGLEASE_TOKEN", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    args = [str(empty) if a == "EMPTY" else a for a in token_args]
    assert _renew(pg_dsn, schema, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pglease: error:") and message in err
    assert len(err.splitlines()) == 1


def test_token_and_token_file_together_is_a_usage_error(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    path = tmp_path / "token"
    path.write_text(new_token())
    result = subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, "release", "run",
         "r1", "--owner", "host:a", "--token", new_token(), "--token-file", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=os.environ.copy(),
    )  # fmt: skip
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr


def test_new_tokens_never_start_with_a_dash() -> None:
    # One token_urlsafe in 64 starts with '-', which `--token VALUE` reads as a
    # flag: with the old generator, 2,000 tokens all clear of it has p ~ 2e-14.
    tokens = [new_token() for _ in range(2000)]
    assert not any(t.startswith("-") for t in tokens)
    assert all(len(t) == 43 for t in tokens)


def test_a_dash_token_passes_with_the_equals_form(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A well-formed token that begins with '-' (as older releases could print):
    # `--token=VALUE` hands it over; a wrong one is refused as a token mismatch.
    token = _lease(pg_dsn, schema, capsys)
    assert _renew(pg_dsn, schema, f"--token={token}") == 0
    capsys.readouterr()
    assert _renew(pg_dsn, schema, "--token=-" + "A" * 42) == 4
