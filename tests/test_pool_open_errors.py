"""A pool that cannot fill names the server's reason, not only its own timeout."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import conninfo

from pglease import AsyncPostgresStore, DatabaseUnavailableError, PostgresStore
from pglease.migrations import grant


@pytest.fixture
def one_connection_dsn(pg_dsn: str, schema: str) -> Iterator[str]:
    """A client role allowed one connection at a time (CONNECTION LIMIT 1): the
    store's first direct connection succeeds, its pool of two cannot fill."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT rolsuper OR rolcreaterole FROM pg_roles"
                           " WHERE rolname = current_user").fetchone()  # fmt: skip
        if not (row and row[0]):
            pytest.skip("the test server's user cannot create roles")
    PostgresStore(pg_dsn, schema=schema, min_size=1, max_size=1).close()
    role = f"pgl_limit_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1")
        grant(conn, schema, role, "client")
    try:
        yield conninfo.make_conninfo(pg_dsn, user=role)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                         " WHERE usename = %s", [role])  # fmt: skip
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_sync_pool_error_names_the_connection_limit(one_connection_dsn: str, schema: str) -> None:
    with pytest.raises(DatabaseUnavailableError) as caught:
        PostgresStore(one_connection_dsn, schema=schema, min_size=2, max_size=2,
                      connect_timeout=2)  # fmt: skip
    message = str(caught.value)
    assert message.startswith("cannot open the connection pool")
    assert "too many connections for role" in message, message
    assert "pool initialization incomplete" in message
    # One connection at a time still works: nothing was left open by the failure.
    with PostgresStore(one_connection_dsn, schema=schema, min_size=1, max_size=1) as store:
        assert store.ensure_resource("job", "after").startswith("job-")


async def test_async_pool_error_names_the_connection_limit(
    one_connection_dsn: str, schema: str
) -> None:
    with pytest.raises(DatabaseUnavailableError) as caught:
        await AsyncPostgresStore.open(one_connection_dsn, schema=schema, min_size=2,
                                      max_size=2, connect_timeout=2)  # fmt: skip
    assert "too many connections" in str(caught.value), str(caught.value)
