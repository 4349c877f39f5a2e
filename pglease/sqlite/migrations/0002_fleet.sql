-- Fleet runtime on SQLite (pglease/sqlite/runtime.py): the fair waiting
-- queue, as lease_waiters in sql/0005_fleet.sql. A fair waiter refreshes its
-- entry on every attempt; an entry not refreshed by its expires_at is dead
-- and dropped by the next attempt on the resource. AUTOINCREMENT: seq is
-- handed out inside the write transaction (one writer at a time), so it is
-- the order in which waiters reached the file, and never reused.
--
-- Heartbeats need no table of their own: a beat extends leases.expires_at
-- and heartbeat_at of current leases (found by the primary key) and, as on
-- PostgreSQL, bumps no revision and writes no event.

CREATE TABLE lease_waiters (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    waiter_id    TEXT NOT NULL UNIQUE,
    resource_id  TEXT NOT NULL REFERENCES resources (id),
    owner_type   TEXT NOT NULL,
    owner_id     TEXT NOT NULL,
    enqueued_at  INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL
) STRICT;
CREATE INDEX lease_waiters_queue ON lease_waiters (resource_id, seq);
