"""A keeper's view of a PostgreSQL schema without a store: a DSN (through a
proxy, or a dead address) and a schema, with the runtime driver a store would
give it."""

from __future__ import annotations

from typing import Any

from pglease.postgres.runtime import AsyncPgRuntime, PgRuntime


class PgWhere:
    """Where a keeper beats: `dsn` and `schema`; `is_async` picks the driver twin."""

    def __init__(self, dsn: str, schema: str, *, is_async: bool = False) -> None:
        self.dsn = dsn
        self.schema = schema
        self._is_async = is_async

    def runtime_driver(self) -> Any:
        return AsyncPgRuntime(self) if self._is_async else PgRuntime(self)
