-- Log maintenance on SQLite (pglease/sqlite/maintenance.py): the reaper's
-- expiry marker and the prune horizon, as on PostgreSQL.
--
-- expired_generation: the generation whose `lease.expired` event is written
-- (by the reaper, or by the claim that took the lease over), so no generation
-- ever gets two; NULL while none is. Leases of files made before this
-- migration had no reaper, so no generation of theirs is marked.
ALTER TABLE leases ADD COLUMN expired_generation INTEGER;

-- The leases still to reap, as leases_to_reap on PostgreSQL (sql/0012): held,
-- expiry not recorded, by (expires_at, resource_id), so an idle reaper pass
-- reads one index page instead of the whole lease table.
CREATE INDEX leases_to_reap ON leases (expires_at, resource_id)
    WHERE owner_id IS NOT NULL AND expired_generation IS NOT generation;

-- One row: every event with an id at or below pruned_id is deleted (a prefix
-- of the log; ids are commit-ordered). A cursor below it is expired.
CREATE TABLE event_horizon (
    singleton  INTEGER PRIMARY KEY CHECK (singleton = 1),
    pruned_id  INTEGER NOT NULL DEFAULT 0 CHECK (pruned_id >= 0),
    pruned_at  INTEGER
) STRICT;
INSERT INTO event_horizon (singleton) VALUES (1);
