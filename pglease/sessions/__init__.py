"""Agent sessions in the per-session SQLite file format (storage version 1).

`SessionRepository` manages a directory of `<id>.sqlite` files and hands out
`SqliteSession` writer handles. The format rules that do not depend on SQLite
(fork planning, lane validation, the branch-index algorithm, usage summing)
live in `fork`, `branch_index` and `model` so other backends can share them.
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
    SessionNotFoundError,
    SessionVersionError,
    UnknownEntryError,
    WriterLeaseLostError,
)
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
from .repository import SessionListing, SessionProblem, SessionRepository, check_session_id
from .schema import SCHEMA_SQL, STORAGE_VERSION
from .sqlite_file import SqliteBranchIndex, SqliteSession

__all__ = [
    "SCHEMA_SQL",
    "STORAGE_VERSION",
    "AddUsage",
    "AppendEntry",
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
    "Register",
    "Segment",
    "SessionAlreadyClaimedError",
    "SessionBusyError",
    "SessionClosedError",
    "SessionCorruptError",
    "SessionError",
    "SessionExistsError",
    "SessionInfo",
    "SessionListing",
    "SessionNotFoundError",
    "SessionProblem",
    "SessionRepository",
    "SessionSnapshot",
    "SessionStats",
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
    "sum_usage",
    "uuid7",
    "validate_lanes",
]
