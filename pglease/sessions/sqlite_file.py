"""One session = one SQLite file: the names this module always offered.

The work is split by job: connections and errors (`_file_db`), rows, checks
and the branch index (`_file_rows`), streamed forks (`_file_stream`), a
handle's blocking work (`_file_ops`) and the handle itself, `SqliteSession`,
generated (`_handle.py`) from its asyncio source `_handle_async.py`.
"""

from __future__ import annotations

from ._file_db import (
    BUSY_TIMEOUT,
    NowMs,
    connect,
    mapped,
    session_file_error,
    transaction,
    wall_clock_ms,
)
from ._file_rows import (
    ENTRY_COLUMNS,
    SqliteBranchIndex,
    check_tables,
    claim_lease,
    entry_from_row,
    insert_entry,
    read_lease,
    read_lease_row,
    read_session_row,
    read_snapshot,
    release_lease,
)
from ._file_stream import STREAM_FETCH, FileForkSource, file_fork_source, write_stream_rows
from ._handle import SqliteSession

__all__ = [
    "BUSY_TIMEOUT",
    "ENTRY_COLUMNS",
    "STREAM_FETCH",
    "FileForkSource",
    "NowMs",
    "SqliteBranchIndex",
    "SqliteSession",
    "check_tables",
    "claim_lease",
    "connect",
    "entry_from_row",
    "file_fork_source",
    "insert_entry",
    "mapped",
    "read_lease",
    "read_lease_row",
    "read_session_row",
    "read_snapshot",
    "release_lease",
    "session_file_error",
    "transaction",
    "wall_clock_ms",
    "write_stream_rows",
]
