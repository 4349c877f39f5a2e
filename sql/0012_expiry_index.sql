-- An index of the leases still to reap: held, and whose expiry the reaper has
-- not recorded, by (expires_at, resource_id).
--
-- reap_next's candidate query had no index to use: every idle pass of the
-- reaper read the whole lease table (about 100 ms on 1,000,000 rows), and
-- every reaped lease another scan. With this index an idle pass reads one
-- index page, and the reaper walks candidates in expiry order (see
-- reap_next in sql/functions/20_watch.sql). Claims, renewals, heartbeats and
-- releases keep it current; released and reaped leases leave it (partial).
CREATE INDEX leases_to_reap ON @schema@.leases (expires_at, resource_id)
    WHERE owner_id IS NOT NULL AND expired_generation IS DISTINCT FROM generation;
