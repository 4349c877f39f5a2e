"""Statement text for one schema: the one place that binds ``{s}`` to a schema.

Every named query of the PostgreSQL driver is written with ``{s}`` where the
schema goes; `for_schema` returns the function that turns such a text into
the bytes psycopg sends (the schema quoted as an identifier, so a schema name
can never be read as SQL)."""

from __future__ import annotations

from collections.abc import Callable

from psycopg import sql


def for_schema(schema: str) -> Callable[[str], bytes]:
    """A function rendering statement text with ``{s}`` bound to `schema`."""
    s = sql.Identifier(schema)

    def render(text: str) -> bytes:
        return sql.SQL(text).format(s=s).as_string(None).encode()

    return render
