-- One row per lease operation: the revision, its time and the order guard's
-- previous xid move into the lease row (issue 24).
--
-- Every claim, renew, release, mutation, revocation and reap that wrote an
-- event also updated `resources` (revision + 1, updated_at): a second heap
-- update and WAL record per operation. And the order guard looked up the
-- previous revision's event to compare xids. Now an operation writes one
-- lease row update and one event insert:
--  * leases.revision / leases.updated_at: the resource's revision and the
--    time of its latest change. `resources.revision` and
--    `resources.updated_at` stay, frozen at this migration: they are the
--    values of every lease row not written since (NULL here).
--  * leases.last_xid: the xid of the transaction that wrote the resource's
--    latest event, what the order guard compares with (NULL: not written
--    since this migration; the guard then looks the event up as before).
--
-- Upgrading in place. Nullable columns without a default are added without
-- rewriting the table (a catalog change: the ACCESS EXCLUSIVE lock is held
-- for an instant, not for a scan), so claims wait no longer than for any
-- other migration. NULL means "not moved yet": every writer bumps
-- coalesce(lease revision, resource revision) + 1, every reader reads the
-- same coalesce, so a lease row is right whether moved or not. Rows are then
-- moved in short chunks, each its own transaction, by move_revisions_chunk
-- (sql/functions/10_core.sql), which the migration runner calls after the
-- migrations until nothing is left; lease_row_moves keeps its position, so
-- an interrupted run goes on where it stopped. A fresh install creates every
-- lease row with revision 0 (ensure_resource) and has nothing to move.
ALTER TABLE @schema@.leases
    ADD COLUMN revision bigint,
    ADD COLUMN updated_at timestamptz,
    ADD COLUMN last_xid xid8;

CREATE TABLE @schema@.lease_row_moves (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    after_resource  text NOT NULL DEFAULT '',
    done            boolean NOT NULL DEFAULT false
);
INSERT INTO @schema@.lease_row_moves (done)
    SELECT NOT EXISTS (SELECT FROM @schema@.leases WHERE revision IS NULL);

COMMENT ON COLUMN @schema@.resources.revision IS
    'frozen at migration 0018: the revision is leases.revision (this value while that is NULL)';
COMMENT ON COLUMN @schema@.resources.updated_at IS
    'frozen at migration 0018: the time of the latest change is leases.updated_at (this value while that is NULL)';
