"""The stores the fleet runtime runs on, as fixtures: `store` (PostgreSQL and
SQLite, blocking) and `astore` (their asyncio twins). Import them into a test
module to run its runtime tests on every backend."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pglease import AsyncPostgresStore, AsyncSqliteStore, PostgresStore, SqliteStore

from .conftest import enable_test_clock

#: The runtime's backends; every test using `store` (or `astore`) runs on each.
RUNTIME_BACKENDS = ["postgres", "sqlite"]


@pytest.fixture(params=RUNTIME_BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "postgres":
        yield request.getfixturevalue("pg_store")  # with the test clock (`now=`) on
    else:
        with SqliteStore(tmp_path / "runtime.sqlite") as lite:
            yield lite


@pytest.fixture(params=RUNTIME_BACKENDS)
async def astore(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "postgres":
        # Not `apg_store`: an async fixture cannot be requested by name from one.
        dsn, schema = request.getfixturevalue("pg_dsn"), request.getfixturevalue("schema")
        async with AsyncPostgresStore(dsn, schema=schema, max_size=8) as pg:
            enable_test_clock(dsn, schema)
            yield pg
    else:
        async with AsyncSqliteStore(tmp_path / "runtime.sqlite") as lite:
            yield lite


def queued(store: Any, rid: str | None = None) -> int:
    """Fair-queue entries (of `rid`, or all), read straight from the database."""
    where, args = ("", []) if rid is None else (" WHERE resource_id = %s", [rid])
    if isinstance(store, PostgresStore | AsyncPostgresStore):
        with psycopg.connect(store.dsn) as conn:
            row = conn.execute(
                f'SELECT count(*) FROM "{store.schema}".lease_waiters{where}', args
            ).fetchone()
    else:
        with sqlite3.connect(store.path) as lite:
            row = lite.execute(
                "SELECT count(*) FROM lease_waiters" + where.replace("%s", "?"), args
            ).fetchone()
    assert row is not None
    return int(row[0])
