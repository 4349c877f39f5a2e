"""Agent sessions in the per-session SQLite file format (storage version 1).

`SessionRepository` manages a directory of `<id>.sqlite` files and hands out
`SqliteSession` writer handles. The format rules that do not depend on SQLite
(fork planning, lane validation, the branch-index algorithm, usage summing)
live in `fork`, `branch_index` and `model` so other backends can share them.

`PostgresSessionRepository` keeps the same model in PostgreSQL tables
(`sql/0004_sessions.sql`) for fleets, with `PostgresSession` handles fenced by
a pglease lease; it also forks sessions into files and imports files back.
Both handle types satisfy the `SessionHandle` protocol.
`AsyncPostgresSessionRepository` is its asyncio twin; `AsyncSessionRepository`
serves files to asyncio code. `Session` / `AsyncSession` are the layer a
harness uses over any of them: lanes, appends that move the lane's leaf,
forks, labels, usage. See README.md here.
"""

from __future__ import annotations

from .branch_index import BranchIndexStore, BranchQuery, BranchRow, MemoryBranchIndex, Segment
from .errors import (
    DuplicateIdError,
    InvalidSessionIdError,
    InvalidSessionWriteError,
    LaneValidationError,
    SessionAlreadyClaimedError,
    SessionBusyError,
    SessionClosedError,
    SessionCorruptError,
    SessionError,
    SessionExistsError,
    SessionFileBusyError,
    SessionFileCorruptError,
    SessionFileError,
    SessionNotFoundError,
    SessionTempFileError,
    SessionVersionError,
    UnknownEntryError,
    WriterLeaseLostError,
)
from .files_async import AsyncSessionRepository, AsyncSqliteSession
from .fork import ForkPlan, ForkPosition, ForkScope, plan_fork, validate_lanes
from .ids import uuid7
from .model import (
    AddUsage,
    AppendEntry,
    CommitResult,
    DeleteRegister,
    Entry,
    LeaseInfo,
    Register,
    SessionInfo,
    SessionSnapshot,
    SessionStats,
    SetRegister,
    UsageRow,
    Write,
    sum_usage,
)
from .postgres import PgBranchIndex, PostgresSession, PostgresSessionRepository
from .postgres_async import AsyncPostgresSession, AsyncPostgresSessionRepository
from .protocol import AsyncSessionBackend, AsyncSessionHandle, SessionBackend, SessionHandle
from .repository import (
    SessionListing,
    SessionProblem,
    SessionRepository,
    check_session_id,
    read_session_file,
)
from .schema import SCHEMA_SQL, STORAGE_VERSION
from .session import Session
from .session_async import AsyncSession
from .sqlite_file import SqliteBranchIndex, SqliteSession

__all__ = [
    "SCHEMA_SQL",
    "STORAGE_VERSION",
    "AddUsage",
    "AppendEntry",
    "AsyncPostgresSession",
    "AsyncPostgresSessionRepository",
    "AsyncSession",
    "AsyncSessionBackend",
    "AsyncSessionHandle",
    "AsyncSessionRepository",
    "AsyncSqliteSession",
    "BranchIndexStore",
    "BranchQuery",
    "BranchRow",
    "CommitResult",
    "DeleteRegister",
    "DuplicateIdError",
    "Entry",
    "ForkPlan",
    "ForkPosition",
    "ForkScope",
    "InvalidSessionIdError",
    "InvalidSessionWriteError",
    "LaneValidationError",
    "LeaseInfo",
    "MemoryBranchIndex",
    "PgBranchIndex",
    "PostgresSession",
    "PostgresSessionRepository",
    "Register",
    "Segment",
    "Session",
    "SessionAlreadyClaimedError",
    "SessionBackend",
    "SessionBusyError",
    "SessionClosedError",
    "SessionCorruptError",
    "SessionError",
    "SessionExistsError",
    "SessionFileBusyError",
    "SessionFileCorruptError",
    "SessionFileError",
    "SessionHandle",
    "SessionInfo",
    "SessionListing",
    "SessionNotFoundError",
    "SessionProblem",
    "SessionRepository",
    "SessionSnapshot",
    "SessionStats",
    "SessionTempFileError",
    "SessionVersionError",
    "SetRegister",
    "SqliteBranchIndex",
    "SqliteSession",
    "UnknownEntryError",
    "UsageRow",
    "Write",
    "WriterLeaseLostError",
    "check_session_id",
    "plan_fork",
    "read_session_file",
    "sum_usage",
    "uuid7",
    "validate_lanes",
]
