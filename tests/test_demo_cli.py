"""`pglease demo` as a real process: usage errors, legend, progress and closing hints."""

from __future__ import annotations

import pytest

from .test_cli import run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hosts", "0"], "--hosts must be between 1"),
        (["--resources", "0"], "--resources must be between 1"),
        (["--seconds", "-3"], "must be zero or more"),
        (["--seconds", "0.5"], "--seconds must be at least"),
        (["--ttl", "0"], "ttl must be"),
    ],
)
def test_demo_argument_errors_exit_2(
    pg_dsn: str, schema: str, args: list[str], message: str
) -> None:
    result = run(pg_dsn, schema, "demo", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "invariants" not in result.stdout + result.stderr  # never judged as a violation


def test_demo_output_explains_itself(pg_dsn: str, schema: str) -> None:
    result = run(
        pg_dsn, schema, "demo", "--hosts", "3", "--resources", "2", "--seconds", "4",
        "--ttl", "0.5", timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"schema {schema}_demo" in out
    assert "progress:" in out and "s left" in out
    assert out.count("progress:") <= 4 + 60 + 2  # at most one a second (and the hosts' slack)
    assert "legend: claims = " in out
    assert "invariants: OK" in out
    assert f"pglease --schema {schema}_demo ls" in out
    # Only migrate creates a schema: the hint to lead an election says so first.
    assert out.index(f"pglease --schema {schema} migrate") < out.index(
        f"pglease --schema {schema} elect scheduler"
    )
    # An explicit --dsn is not the embedded server: no hint to stop it.
    assert "pglease embedded stop" not in out
