-- pglease core schema on SQLite: the same logical tables as the PostgreSQL
-- schema (sql/0001_core.sql). The lease functions live in Python
-- (pglease/sqlite/store.py) and run inside one BEGIN IMMEDIATE transaction.
--
-- Timestamps are integer microseconds since the Unix epoch, UTC: exact, so a
-- value read back equals the datetime written.

CREATE TABLE resources (
    id          TEXT PRIMARY KEY,
    type        TEXT NOT NULL,
    key         TEXT NOT NULL,
    revision    INTEGER NOT NULL DEFAULT 0 CHECK (revision >= 0),
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    UNIQUE (type, key)
) STRICT;

-- One row per resource, created with it and never deleted, so the generation
-- survives releases and can only rise.
CREATE TABLE leases (
    resource_id   TEXT PRIMARY KEY REFERENCES resources (id),
    generation    INTEGER NOT NULL DEFAULT 0 CHECK (generation >= 0),
    owner_type    TEXT,
    owner_id      TEXT,
    token_sha256  BLOB,
    acquired_at   INTEGER,
    heartbeat_at  INTEGER,
    expires_at    INTEGER,
    CHECK ((owner_id IS NULL) = (token_sha256 IS NULL)),
    CHECK ((owner_id IS NULL) = (expires_at IS NULL))
) STRICT;

CREATE TABLE payloads (
    sha256      BLOB PRIMARY KEY,
    body        TEXT NOT NULL,
    created_at  INTEGER NOT NULL
) STRICT;

-- AUTOINCREMENT: ids are never reused. SQLite admits one writer at a time and
-- the id is taken inside the write transaction, so ids are also commit-ordered:
-- a reader can never see id N+1 while id N is still to come.
CREATE TABLE events (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    resource_id       TEXT NOT NULL REFERENCES resources (id),
    revision          INTEGER NOT NULL,
    type              TEXT NOT NULL,
    actor_type        TEXT,
    actor_id          TEXT,
    lease_generation  INTEGER,
    lease_expires_at  INTEGER,
    payload_sha256    BLOB REFERENCES payloads (sha256),
    created_at        INTEGER NOT NULL,
    UNIQUE (resource_id, revision)
) STRICT;
CREATE INDEX events_payload ON events (payload_sha256) WHERE payload_sha256 IS NOT NULL;
