-- Agent sessions in PostgreSQL: the storage-version-1 session model of
-- SESSION_FORMAT.md, one set of tables for every session, keyed by session_id.
--
-- Tables are prefixed `session_` because they share the schema with the lease
-- store (which already has `events`). JSON columns are text, not jsonb: a
-- session forked to a file must carry the payload bytes unchanged, and jsonb
-- would reorder keys and rewrite numbers. Times are Unix milliseconds. Ids,
-- namespaces and keys use the "C" collation so that ordering (register prefix
-- listings, tie-breaks) is byte order, exactly as in SQLite.
--
-- There is no writer_lease table: the writer lease is the pglease lease on the
-- resource ('session', id) stored in `resource_id`, and every commit is a
-- pglease mutation on that resource (fence check, revision bump and event in
-- the same transaction as the session rows).

CREATE TABLE @schema@.sessions (
    id                 text COLLATE "C" PRIMARY KEY,
    resource_id        text NOT NULL UNIQUE REFERENCES @schema@.resources (id),
    created_at         bigint NOT NULL,
    parent_session_id  text COLLATE "C",
    storage_version    integer NOT NULL DEFAULT 1,
    metadata           text,
    message_count      bigint NOT NULL DEFAULT 0 CHECK (message_count >= 0),
    usage_payload      text NOT NULL,
    next_seq           bigint NOT NULL CHECK (next_seq >= 1)
);
CREATE INDEX sessions_created ON @schema@.sessions (created_at DESC, id);

CREATE TABLE @schema@.session_entries (
    session_id   text COLLATE "C" NOT NULL REFERENCES @schema@.sessions (id) ON DELETE CASCADE,
    id           text COLLATE "C" NOT NULL,
    parent_id    text COLLATE "C",
    seq          bigint NOT NULL,
    type         text NOT NULL
                 CHECK (type IN ('message', 'compaction', 'branch_summary', 'custom')),
    custom_type  text COLLATE "C",
    timestamp    bigint NOT NULL,
    payload      text NOT NULL,
    PRIMARY KEY (session_id, id),
    CHECK ((type = 'custom') = (custom_type IS NOT NULL))
);
-- One seq counter per session: no two entries share a seq; also serves
-- scan_entries (seq order) and the type filter.
CREATE UNIQUE INDEX session_entries_seq ON @schema@.session_entries (session_id, seq);
CREATE INDEX session_entries_parent ON @schema@.session_entries (session_id, parent_id);

CREATE TABLE @schema@.session_registers (
    session_id  text COLLATE "C" NOT NULL REFERENCES @schema@.sessions (id) ON DELETE CASCADE,
    namespace   text COLLATE "C" NOT NULL,
    key         text COLLATE "C" NOT NULL,
    seq         bigint NOT NULL,
    value       text NOT NULL,
    PRIMARY KEY (session_id, namespace, key)
);

CREATE TABLE @schema@.session_usage_ledger (
    session_id  text COLLATE "C" NOT NULL REFERENCES @schema@.sessions (id) ON DELETE CASCADE,
    id          text COLLATE "C" NOT NULL,
    seq         bigint NOT NULL,
    entry_id    text COLLATE "C",
    adjustment  smallint NOT NULL CHECK (adjustment IN (0, 1)),
    usage       text NOT NULL,
    details     text,
    PRIMARY KEY (session_id, id)
);
CREATE INDEX session_usage_seq ON @schema@.session_usage_ledger (session_id, seq);

-- The branch index (see pglease/sessions/branch_index.py). Branch scans are
-- index range scans on (session_id, branch_id, entry_seq); the INCLUDE columns
-- make them index-only.
CREATE TABLE @schema@.session_branch_entries (
    session_id  text COLLATE "C" NOT NULL REFERENCES @schema@.sessions (id) ON DELETE CASCADE,
    branch_id   text COLLATE "C" NOT NULL,
    entry_id    text COLLATE "C" NOT NULL,
    entry_seq   bigint NOT NULL,
    entry_type  text NOT NULL,
    PRIMARY KEY (session_id, branch_id, entry_id)
);
CREATE UNIQUE INDEX session_be_seq
    ON @schema@.session_branch_entries (session_id, branch_id, entry_seq) INCLUDE (entry_id, entry_type);
CREATE INDEX session_be_type
    ON @schema@.session_branch_entries (session_id, branch_id, entry_type, entry_seq) INCLUDE (entry_id);
CREATE INDEX session_be_entry ON @schema@.session_branch_entries (session_id, entry_id);

CREATE TABLE @schema@.session_branch_meta (
    session_id      text COLLATE "C" NOT NULL REFERENCES @schema@.sessions (id) ON DELETE CASCADE,
    branch_id       text COLLATE "C" NOT NULL,
    tip_entry_id    text COLLATE "C" NOT NULL,
    tip_seq         bigint NOT NULL,
    base_branch_id  text COLLATE "C",
    base_seq        bigint,
    PRIMARY KEY (session_id, branch_id),
    UNIQUE (session_id, tip_entry_id)
);
