"""Helpers for tests that interleave real transactions on several connections."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def lock_waiters(dsn: str, needle: str) -> int:
    """Backends waiting for a lock whose query contains `needle`."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE %s",
            [f"%{needle}%"],
        ).fetchone()
    assert row is not None
    return int(row[0])
