"""The storage-version-1 schema, verbatim from FORMAT.md (beside this module).

Applied with one `executescript`; every statement is IF NOT EXISTS. No foreign
keys and no `user_version`.
"""

from __future__ import annotations

STORAGE_VERSION = 1

SCHEMA_SQL = """\
CREATE TABLE IF NOT EXISTS entries (
  id TEXT PRIMARY KEY, parent_id TEXT, seq INTEGER NOT NULL, type TEXT NOT NULL,
  custom_type TEXT, timestamp INTEGER NOT NULL, payload TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ix_entry_parent ON entries(parent_id);
CREATE INDEX IF NOT EXISTS ix_entry_seq ON entries(seq, type);

CREATE TABLE IF NOT EXISTS registers (
  namespace TEXT, key TEXT, seq INTEGER NOT NULL, value TEXT NOT NULL,
  PRIMARY KEY (namespace, key)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS usage_ledger (
  id TEXT PRIMARY KEY, seq INTEGER NOT NULL, entry_id TEXT,
  adjustment INTEGER NOT NULL, usage TEXT NOT NULL, details TEXT
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ix_usage_seq ON usage_ledger(seq);

CREATE TABLE IF NOT EXISTS branch_entries (
  branch_id TEXT, entry_id TEXT, entry_seq INTEGER NOT NULL, entry_type TEXT NOT NULL,
  PRIMARY KEY (branch_id, entry_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS ix_be_seq ON branch_entries(branch_id, entry_seq, entry_id, entry_type);
CREATE INDEX IF NOT EXISTS ix_be_type ON branch_entries(branch_id, entry_type, entry_seq, entry_id);
CREATE INDEX IF NOT EXISTS ix_be_entry ON branch_entries(entry_id);

CREATE TABLE IF NOT EXISTS branch_meta (
  branch_id TEXT PRIMARY KEY, tip_entry_id TEXT NOT NULL, tip_seq INTEGER NOT NULL,
  base_branch_id TEXT, base_seq INTEGER
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS ix_bm_tip ON branch_meta(tip_entry_id);

CREATE TABLE IF NOT EXISTS session (
  created_at INTEGER NOT NULL, parent_session_id TEXT, storage_version INTEGER NOT NULL,
  metadata TEXT, message_count INTEGER NOT NULL, usage_payload TEXT NOT NULL,
  next_seq INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS writer_lease (
  owner_id TEXT NOT NULL, fence INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL
);
"""

#: The tables a version-1 file must contain.
TABLES = (
    "entries",
    "registers",
    "usage_ledger",
    "branch_entries",
    "branch_meta",
    "session",
    "writer_lease",
)

ENTRY_TYPES = ("message", "compaction", "branch_summary", "custom")

#: Initial value of `session.usage_payload`.
EMPTY_USAGE_JSON = (
    '{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"totalTokens":0,'
    '"cost":{"input":0,"output":0,"cacheRead":0,"cacheWrite":0,"total":0}}'
)

#: Value of a lane's `lane.state` register when the lane is idle.
IDLE_LANE_STATE_JSON = '{"currentOperationId":null,"pendingNextRun":[]}'

MAIN_LANE = "main"
