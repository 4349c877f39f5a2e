"""A directory of session files, `<directory>/<session_id>.sqlite`: the names
this module always offered.

`SessionRepository` is generated (`_repo.py`) from its asyncio source
`_repo_async.py`; names, temp files and publishing are in `_dir`, the file
work the repository does in `_file_build`.
"""

from __future__ import annotations

from ._dir import (
    MAX_NAME_BYTES,
    MAX_SESSION_ID_BYTES,
    SIDE_FILES,
    STALE_TEMP_MS,
    SUFFIX,
    TEMP_SUFFIX,
    SessionListing,
    SessionProblem,
    check_session_id,
    read_session_file,
    temp_name,
)
from ._repo import SessionRepository

__all__ = [
    "MAX_NAME_BYTES",
    "MAX_SESSION_ID_BYTES",
    "SIDE_FILES",
    "STALE_TEMP_MS",
    "SUFFIX",
    "TEMP_SUFFIX",
    "SessionListing",
    "SessionProblem",
    "SessionRepository",
    "check_session_id",
    "read_session_file",
    "temp_name",
]
