-- Prune in bounded chunks, and payload collection that only looks at the
-- payloads of the events it deleted.
--
-- Watchers read below pg_snapshot_xmin, which is cluster-wide: while one
-- transaction holds an xid, no watcher delivers anything committed after it
-- began. prune_log deleted the whole prefix of the log in one transaction
-- (2 s for 199k events: every watcher's lag reached 2 s) and then anti-joined
-- every payload against the events (0.36 s of a 0.38 s prune that deleted
-- 1,000 events). pglease.watch.prune now calls prune_chunk and
-- gc_payloads_chunk (sql/functions/20_watch.sql), each its own short
-- transaction.
--
-- The queue of payloads that may have lost their last reference: prune_chunk
-- adds the payloads of the events it deletes, gc_payloads_chunk deletes those
-- that are still unreferenced and takes them off the queue. A payload a writer
-- holds at that moment (mutate_begin's FOR KEY SHARE) stays queued, so it is
-- judged again by the next prune, as the full scan used to do. The owner's
-- alone: no pglease role is granted it.
CREATE TABLE @schema@.payload_gc_queue (
    sha256  bytea PRIMARY KEY
);

-- Payloads already unreferenced now (left by prunes before 0007, or skipped
-- because a writer held them and then rolled back) are queued once here, the
-- last time the whole payload table is anti-joined.
INSERT INTO @schema@.payload_gc_queue (sha256)
SELECT p.sha256 FROM @schema@.payloads p
 WHERE NOT EXISTS (SELECT 1 FROM @schema@.events e WHERE e.payload_sha256 = p.sha256);
