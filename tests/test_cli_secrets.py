"""No password ever reaches an error message: the CLI's, or the store's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pglease import PostgresStore
from pglease.dsn import redact_dsn, redact_text
from pglease.errors import InvalidDsnError

from .test_cli import ROOT

SECRET = "hunter2Secret"


def _pglease(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://u:secret@h/db", "postgresql://u:***@h/db"),
        ("postgres://u:secret@h:5433,h2/db", "postgres://u:***@h:5433,h2/db"),
        (
            "postgresql://h/db?password=secret&sslmode=require",
            "postgresql://h/db?password=***&sslmode=require",
        ),
        ("postgresql://u:p%40secret@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:pa/secret@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p?secret@h/db", "postgresql://u:***@h/db"),
        ("postgresql://h:5432/db?user=a@b", "postgresql://h:5432/db?user=a@b"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("postgresql://u:secret@[bad", "postgresql://u:***@[bad"),
        ("host=h port=5 password=secret user=u", "host=h port=5 password=*** user=u"),
        ("host=h password = 'sec ret' user=u", "host=h password = *** user=u"),
        ("host=h password='unterminated secret", "host=h password=***"),
        ("host=h password=sec ret", "host=h password=*** ..."),
        ("host=h sslpassword=secret", "host=h sslpassword=***"),
        ("garbage", "..."),
        ("", ""),
    ],
)
def test_redact_dsn(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown


def test_redact_text_masks_dsns_quoted_in_messages() -> None:
    dsn = f"postgresql://u:{SECRET}@[bad"
    message = f'end of string reached in URI: "{dsn}"'
    assert SECRET not in redact_text(message, dsn)
    assert "postgresql://u:***@[bad" in redact_text(message, dsn)
    # Without the DSN at hand: URI user info and password= pairs still go.
    free = f"x postgresql://u:{SECRET}@h/db y password={SECRET} z ?password={SECRET}&a=1"
    assert SECRET not in redact_text(free)


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://u:{SECRET}@[bad/db",
        f"postgresql://u:{SECRET}@h/db?nosuchoption=1",
        f"host=h password={SECRET[:4]} {SECRET[4:]}",
        f"host=h password='{SECRET}",
    ],
)
def test_malformed_dsn_exits_2_without_the_password(dsn: str) -> None:
    for result in (
        _pglease("--dsn", dsn, "ls"),
        _pglease("ls", env={"PGLEASE_DSN": dsn}),
    ):
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("pglease: error: invalid PostgreSQL DSN")
        assert len(result.stderr.splitlines()) == 1, result.stderr
        for piece in (SECRET, SECRET[:4], SECRET[4:]):
            assert piece not in result.stderr + result.stdout


def test_refused_connection_names_host_and_port_not_the_password() -> None:
    dsn = f"postgresql://u:{SECRET}@127.0.0.1:1/db?connect_timeout=5"
    result = _pglease("--dsn", dsn, "ls")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("pglease: error: cannot connect to PostgreSQL")
    assert '"127.0.0.1", port 1' in line
    assert SECRET not in result.stderr


def test_bad_port_is_named_with_host_and_port() -> None:
    result = _pglease("--dsn", f"postgresql://u:{SECRET}@localhost:bad/db", "ls")
    assert result.returncode == 2
    assert "postgresql://u:***@localhost:bad/db" in result.stderr
    assert "port 'bad' is not a number" in result.stderr
    assert SECRET not in result.stderr


def test_store_refuses_a_malformed_dsn_without_the_password() -> None:
    with pytest.raises(InvalidDsnError) as caught:
        PostgresStore(f"postgresql://u:{SECRET}@host:bad/db")
    assert SECRET not in str(caught.value)
    assert "host:bad" in str(caught.value)
    with pytest.raises(InvalidDsnError) as caught:
        PostgresStore(f"postgresql://u:{SECRET}@[bad")
    assert SECRET not in str(caught.value)
