"""Chaos test: real host processes, SIGKILL, SIGSTOP past the TTL, a PostgreSQL
restart; the checker must find no violation (small settings; bench/chaos.py
runs it longer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._chaos import run_chaos

from ._watch_helpers import restart_server, restart_unavailable_reason, wait_for_server


def test_chaos(pg_dsn: str, schema: str, tmp_path: Path) -> None:
    reason = restart_unavailable_reason(pg_dsn)

    def restart() -> None:
        restart_server(pg_dsn)
        wait_for_server(pg_dsn)

    report = run_chaos(
        pg_dsn, schema, tmp_path, hosts=3, workers=2, keys=3, ttl=1.0, seconds=12.0,
        kills=2, restart=None if reason else restart,
    )  # fmt: skip
    print(report)
    assert report.violations == [], report.violations[:20]
    assert report.claims > 10
    assert report.writes > 10 and report.acked > 0
    if reason:
        pytest.skip(f"chaos ran without the PostgreSQL restart: {reason}")
    assert report.restarted
