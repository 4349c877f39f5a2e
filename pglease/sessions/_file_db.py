"""Connections to one session file: opening it, transactions, its errors as session errors."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

from ..sqlite._db import error_kind
from .errors import (
    SessionCorruptError,
    SessionError,
    SessionFileBusyError,
    SessionFileCorruptError,
    SessionFileError,
)

NowMs = Callable[[], int]


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


# --- connections and transactions ------------------------------------------------------


#: How long a statement waits for another connection's lock on the file (seconds).
BUSY_TIMEOUT = 5.0


def session_file_error(
    exc: sqlite3.Error, path: Path, busy_timeout: float = BUSY_TIMEOUT
) -> SessionError:
    """A sqlite3 error on a session file as the session error it means."""
    name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
    detail = f"{exc} ({name})"
    kind = error_kind(exc)
    if kind == "busy":
        return SessionFileBusyError(
            f"session file {path} is busy: another connection held its lock past the busy"
            f" timeout ({busy_timeout:g} s); nothing was written ({detail})"
        )
    if kind == "corrupt":
        return SessionFileCorruptError(f"session file {path} is not a usable database: {detail}")
    if kind == "file":
        return SessionFileError(f"cannot use session file {path}: {detail}")
    # A statement of the format failed on this file (a missing column, a
    # constraint the writes were checked against): it does not follow the format.
    return SessionCorruptError(f"session file {path} does not follow the format: {detail}")


@contextlib.contextmanager
def mapped(path: Path, busy_timeout: float = BUSY_TIMEOUT) -> Iterator[None]:
    """Raise sqlite3 errors of the block as session errors (cause kept)."""
    try:
        yield
    except sqlite3.Error as exc:
        raise session_file_error(exc, path, busy_timeout) from exc


def connect(
    path: Path, *, create: bool = False, busy_timeout: float = BUSY_TIMEOUT
) -> sqlite3.Connection:
    """Open a connection (WAL, busy_timeout 5 s). Without `create` the file must exist."""
    uri = "file:" + urllib.parse.quote(os.fsencode(path)) + ("?mode=rwc" if create else "?mode=rw")
    with mapped(path, busy_timeout):
        conn = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=busy_timeout
        )
    try:
        with mapped(path, busy_timeout):
            conn.execute(f"PRAGMA busy_timeout = {round(busy_timeout * 1000)}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            raise SessionCorruptError(f"session file {path} cannot use WAL mode (got {mode!r})")
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection, *, immediate: bool = True) -> Iterator[None]:
    """`BEGIN IMMEDIATE ... COMMIT`, ROLLBACK on any error (deferred for reads).

    A COMMIT that fails is rolled back as well: a failed commit leaves nothing,
    and the connection is not left inside a transaction."""
    conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            # A failing ROLLBACK must not hide why we roll back.
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
