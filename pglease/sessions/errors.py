"""Errors raised by the per-session file layer.

Everything derives from `SessionError`, itself a `PgleaseError`. Bad arguments
additionally derive from `pglease.errors.ValidationError` (and so `ValueError`).
"""

from __future__ import annotations

from ..errors import (
    LeaseLostError,
    PgleaseError,
    SqliteCorruptError,
    SqliteFileError,
    StoreBusyError,
    ValidationError,
)


class SessionError(PgleaseError):
    """Root of every error the session layer raises deliberately."""


class InvalidSessionIdError(SessionError, ValidationError):
    """A session id is not a usable file name (empty, `.`/`..`, `/` or NUL, too long)."""


class InvalidSessionWriteError(SessionError, ValidationError):
    """A write operation or read argument is malformed; nothing was written."""


class SessionVersionError(SessionError):
    """The file's storage_version is not 1 (newer, or an older layout)."""


class SessionCorruptError(SessionError):
    """The file breaks an invariant of the format (row counts, entry rows, index)."""


class LaneValidationError(SessionError):
    """A lane lacks one of its registers (leaf, state, config) or points nowhere."""


class UnknownEntryError(SessionError, LookupError):
    """An entry id (fork point, parent, branch leaf) does not exist in the session."""


class DuplicateIdError(SessionError):
    """An entry or usage id is already used in the session."""


class WriterLeaseLostError(SessionError, LeaseLostError):
    """The writer lease was lost; the handle refuses all further work.

    Also a pglease `LeaseLostError` (so a `ConflictError`): one
    `except LeaseLostError` catches a lost session writer and a lost lease."""


class SessionAlreadyClaimedError(SessionError):
    """Another live writer holds the session's lease."""


class SessionNotFoundError(SessionError, LookupError):
    """No session file with that id exists."""


class SessionExistsError(SessionError):
    """A session file with that id already exists."""


class SessionClosedError(SessionError):
    """The session handle was closed."""


class SessionBusyError(SessionError):
    """The session is open in this repository (or leased) and cannot be deleted."""


class SessionTempFileError(SessionError):
    """A temp file left by a create or fork that crashed (reported by `list()`)."""


# --- session files: trouble with the file itself ---------------------------------------


class SessionFileError(SessionError, SqliteFileError):
    """A session file cannot be opened or used: an I/O error, a full disk, a
    read-only or vanished file. The sqlite3 error is `__cause__`; nothing of
    the failed call was written."""


class SessionFileBusyError(SessionFileError, StoreBusyError):
    """Another connection held the session file's lock past the busy timeout (5 s);
    nothing was written. Retry later; the writer lease is not affected."""


class SessionFileCorruptError(SessionCorruptError, SessionFileError, SqliteCorruptError):
    """The session file is not a SQLite database or SQLite found it damaged
    (SQLITE_NOTADB, SQLITE_CORRUPT)."""


__all__ = [
    "DuplicateIdError",
    "InvalidSessionIdError",
    "InvalidSessionWriteError",
    "LaneValidationError",
    "SessionAlreadyClaimedError",
    "SessionBusyError",
    "SessionClosedError",
    "SessionCorruptError",
    "SessionError",
    "SessionExistsError",
    "SessionFileBusyError",
    "SessionFileCorruptError",
    "SessionFileError",
    "SessionNotFoundError",
    "SessionTempFileError",
    "SessionVersionError",
    "UnknownEntryError",
    "WriterLeaseLostError",
]
