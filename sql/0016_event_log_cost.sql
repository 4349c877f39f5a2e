-- Leaner event log: one index and one foreign-key check fewer per event.
--
-- Every event paid for three B-tree inserts (the identity key, (resource_id,
-- revision) and (xid, id)) and a foreign-key check that locks the resource
-- row FOR KEY SHARE (a WAL record of its own). Measured with
-- bench/server_cost.py (bench/RESULTS.md, server cost), they were a large
-- part of a claim+release cycle's server time and WAL.
--
--  * The primary key on `id` serves no query: readers walk (xid, id), a
--    resource's history is (resource_id, revision), prune deletes by (xid,
--    id). `id` stays an identity column, so it stays unique and NOT NULL; the
--    watch cursor and every event reference keep it. (resource_id, revision)
--    is unique and NOT NULL, so it becomes the replica identity: a logical
--    replica of the schema can still apply prune's deletes.
--  * Events are only ever written by pglease's own functions, each after it
--    found the resource's lease row (which references the resource), and
--    resources are never deleted, so the foreign key from events to
--    resources could never fail. Leases, sessions and waiters keep theirs.
ALTER TABLE @schema@.events REPLICA IDENTITY USING INDEX events_resource_id_revision_key;
ALTER TABLE @schema@.events DROP CONSTRAINT events_pkey;
ALTER TABLE @schema@.events DROP CONSTRAINT events_resource_id_fkey;
