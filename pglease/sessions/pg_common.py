"""What the PostgreSQL session stores share besides SQL: names, the type
aliases of rows and batches, error mapping, row decoding and argument checks."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

import psycopg

from ..errors import PgleaseError
from ..postgres import _core as store_core
from .branch_index import BranchQuery, Segment
from .errors import (
    DuplicateIdError,
    InvalidSessionWriteError,
    SessionCorruptError,
    SessionError,
    SessionExistsError,
    SessionVersionError,
)
from .ids import uuid7
from .model import Entry, Register, UsageRow
from .schema import ENTRY_TYPES, STORAGE_VERSION

#: Resource type of a session's writer lease.
RESOURCE_TYPE = "session"
#: Owner type of a session writer handle.
OWNER_TYPE = "session"
#: Rows of the first round trip when a branch scan pages through a segment
#: (pages then double, up to MAX_PAGE).
SCAN_PAGE = 256
MAX_PAGE = 8192

Item = TypeVar("Item")
Row: TypeAlias = tuple[Any, ...]
#: One statement and the parameter rows to run it with (executemany).
Batch: TypeAlias = tuple[bytes, list[Row]]


def new_owner_id() -> str:
    """A fresh writer-handle owner id: `<host>/<pid>/<uuid7>` (names the holder in errors)."""
    host = socket.gethostname()[:100] or "host"
    return f"{host}/{os.getpid()}/{uuid7()}"


class _Store(Protocol):
    """What the error mapping needs of either PostgreSQL store."""

    @property
    def limits(self) -> store_core.Limits: ...

    @property
    def dsn(self) -> str | None: ...


def pooler_limits(store: _Store) -> bytes | None:
    """Pooler mode: the store's limits as one `set_config(..., true)` statement for
    the start of a read's transaction (no session SET bounds a read there)."""
    return store_core.pooler_local_limits(store)


def driver_error(store: _Store, exc: psycopg.Error, broken: bool = False) -> PgleaseError:
    """A driver error of the session SQL as a PgleaseError, named as the store names
    its own: its time limits (StatementTimeoutError, LockTimeoutError), a lost
    connection (DatabaseUnavailableError; `broken`: nothing was committed), no
    password. Raise it `from cause_of(error, exc)`."""
    if broken:
        return store_core.lost(exc, store.dsn)
    return store_core.driver_error(exc, store.limits, store.dsn)


def cause_of(error: PgleaseError, exc: psycopg.Error) -> psycopg.Error | None:
    """The driver error to keep as `__cause__` (None for pglease's own refusals)."""
    return store_core.cause_of(error, exc)


def translate_unique(exc: psycopg.errors.UniqueViolation) -> SessionError:
    """A unique violation from a session write, as the session error it means."""
    constraint = exc.diag.constraint_name or ""
    if "sessions" in constraint and "pkey" in constraint:
        return SessionExistsError(str(exc.diag.message_detail or exc).strip())
    return DuplicateIdError(f"an id is already used: {exc.diag.message_detail or exc}")


# --- rows ----------------------------------------------------------------------------------


def entry_from_row(row: Sequence[Any]) -> Entry:
    """An `Entry` from `(id, parent_id, seq, type, custom_type, timestamp, payload)`."""
    entry_id, parent_id, seq, type_, custom_type, timestamp, payload = row
    if type_ not in ENTRY_TYPES:
        raise SessionCorruptError(f"entry {entry_id} has unknown type {type_!r}")
    return Entry(entry_id, parent_id, int(seq), type_, custom_type, int(timestamp), payload)


def register_from_row(row: Sequence[Any]) -> Register:
    return Register(row[0], row[1], int(row[2]), row[3])


def usage_from_row(row: Sequence[Any]) -> UsageRow:
    return UsageRow(row[0], int(row[1]), row[2], bool(row[3]), row[4], row[5])


def segment_from_row(row: Sequence[Any] | None) -> Segment | None:
    return None if row is None else Segment(row[0], row[1], int(row[2]), row[3], row[4])


def check_scan_args(
    after_seq: object, limit: object, types: Iterable[object] | None
) -> list[str] | None:
    """Check `scan_entries` arguments before they reach SQL; return the type list."""
    if isinstance(after_seq, bool) or not isinstance(after_seq, int):
        raise InvalidSessionWriteError(f"after_seq must be an int, got {after_seq!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidSessionWriteError(f"limit must be an int >= 0, got {limit!r}")
    if types is None:
        return None
    wanted = list(types)
    if not all(isinstance(t, str) for t in wanted):
        raise InvalidSessionWriteError(f"types must be strings, got {wanted!r}")
    return [str(t) for t in wanted]


def first_page_for(query: BranchQuery) -> int:
    """Rows to fetch first in a branch scan: without filters a valid limit bounds
    the rows needed (the +1 lets the scan see the page was not short)."""
    limit = query.limit
    bounded = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
    if bounded and limit is not None and query.types is None and query.custom_type is None:
        return min(limit + 1, SCAN_PAGE)
    return SCAN_PAGE


def check_version(session_id: str, version: int) -> None:
    if version > STORAGE_VERSION:
        raise SessionVersionError(
            f"session {session_id} has storage_version {version}, newer than {STORAGE_VERSION}"
        )
    if version < STORAGE_VERSION:
        raise SessionVersionError(
            f"session {session_id} has storage_version {version}, which requires migrations"
        )
