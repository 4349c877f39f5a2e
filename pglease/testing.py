"""Support for test suites: the schema's test clock.

pglease's SQL functions judge expiry by the database clock. A test that wants
to place calls at chosen instants passes ``now=`` to claim, renew, release,
mutate and get; the functions honour it only in a schema whose owner switched
the test clock on here. Nothing a client or reader role can do switches it on
(they have no write privilege on the settings table), and a schema that has
it off refuses ``now=`` with `ClockOverrideError` instead of ignoring it.
Never switch it on for a schema that real hosts use.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from .validation import check_schema_name


def set_test_clock(conn: psycopg.Connection[Any], schema: str, enabled: bool = True) -> None:
    """Switch the test clock of a migrated `schema` on (or off); run as its owner."""
    check_schema_name(schema)
    with conn.transaction():
        conn.execute(
            sql.SQL("UPDATE {}.settings SET test_clock = %s").format(sql.Identifier(schema)),
            [enabled],
        )


def is_test_clock_on(conn: psycopg.Connection[Any], schema: str) -> bool:
    """Whether `schema` honours caller-supplied times."""
    check_schema_name(schema)
    row = conn.execute(
        sql.SQL("SELECT test_clock FROM {}.settings").format(sql.Identifier(schema))
    ).fetchone()
    return bool(row and row[0])
