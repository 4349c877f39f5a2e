"""What the sync and asyncio PostgreSQL session stores share: SQL, the buffered
branch index, and the commit / plan builders.

Neither store's semantics can drift from the other's: both move the same
statements over a connection. The branch-index algorithm (`index_entry`,
`scan_branch`) is synchronous; the asyncio store runs it against a
`ReplayIndex`, which answers reads from what was fetched so far and raises
`Miss` for anything else. The driver fetches that and runs the step again.
That is safe because every step of the algorithm reads everything it needs
before its first write (all writes are buffered here anyway).

This module names it all; the parts live in modules of one job each:
`pg_common` (names, row types, error mapping, row decoding, checks), `pg_sql`
(the statements), `pg_index` (the buffered branch index), `pg_commit` (commit
and plan builders), `pg_chunks` (chunked imports and purges).
"""

from __future__ import annotations

from .pg_chunks import (
    CHUNK_FLOOR,
    CHUNK_TARGET,
    IMPORT_CHUNK,
    IMPORT_CLAIM_WAIT,
    IMPORT_GONE_STATE,
    IMPORT_STALE_AFTER,
    INVALID_CHUNK_STATE,
    PURGE_CHUNK,
    ChunkBuilder,
    ChunkIndex,
    ChunkSizer,
    check_chunk_size,
    check_stale_after,
    chunks,
    delete_interrupted,
    import_gone,
    import_refusal,
    registers_call,
    sized_chunks,
    stale_import_problem,
)
from .pg_commit import (
    CommitBuilder,
    PlanBuilder,
    SeqMoved,
    entry_params,
    new_session_plan,
)
from .pg_common import (
    MAX_PAGE,
    OWNER_TYPE,
    RESOURCE_TYPE,
    SCAN_PAGE,
    Batch,
    Item,
    Row,
    cause_of,
    check_scan_args,
    check_version,
    driver_error,
    entry_from_row,
    first_page_for,
    new_owner_id,
    pooler_limits,
    register_from_row,
    segment_from_row,
    translate_unique,
    usage_from_row,
)
from .pg_index import (
    IndexCore,
    Miss,
    PgBranchIndex,
    ReplayIndex,
    send,
)
from .pg_sql import Sql

__all__ = [
    "CHUNK_FLOOR",
    "CHUNK_TARGET",
    "IMPORT_CHUNK",
    "IMPORT_CLAIM_WAIT",
    "IMPORT_GONE_STATE",
    "IMPORT_STALE_AFTER",
    "INVALID_CHUNK_STATE",
    "MAX_PAGE",
    "OWNER_TYPE",
    "PURGE_CHUNK",
    "RESOURCE_TYPE",
    "SCAN_PAGE",
    "Batch",
    "ChunkBuilder",
    "ChunkIndex",
    "ChunkSizer",
    "CommitBuilder",
    "IndexCore",
    "Item",
    "Miss",
    "PgBranchIndex",
    "PlanBuilder",
    "ReplayIndex",
    "Row",
    "SeqMoved",
    "Sql",
    "cause_of",
    "check_chunk_size",
    "check_scan_args",
    "check_stale_after",
    "check_version",
    "chunks",
    "delete_interrupted",
    "driver_error",
    "entry_from_row",
    "entry_params",
    "first_page_for",
    "import_gone",
    "import_refusal",
    "new_owner_id",
    "new_session_plan",
    "pooler_limits",
    "register_from_row",
    "registers_call",
    "segment_from_row",
    "send",
    "sized_chunks",
    "stale_import_problem",
    "translate_unique",
    "usage_from_row",
]
