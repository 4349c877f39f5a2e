-- Watch support: the watcher read, the reaper's expiry events, retention.
-- Current definitions; see 10_core.sql for the conventions (pinned
-- search_path, qualified names, SECURITY DEFINER entry points, error codes).

-- One watcher read: first probe for skippers in flight (before the query's
-- snapshot is taken, so a skipper that finished before the probe is visible
-- to the query), then the events after (p_after) up to (p_upto), only below
-- the snapshot's xmin, with the snapshot bounds and the prune horizon. Always
-- returns at least one row (event columns NULL when there is no event).
--
-- Plan settings: the query depends on nothing its arguments could change (an
-- index range scan on events (xid, id)), so a generic plan is forced (custom
-- re-planning made a read cost several times a write); and it is never JIT
-- compiled: its generic plan is costed for millions of rows, and on a server
-- built with LLVM every read spent ~200 ms compiling a 2 ms query (measured
-- on PostgreSQL 15: one watcher halved the writers' throughput).
CREATE OR REPLACE FUNCTION @schema@.watch_read(
    p_after_xid xid8, p_after_id bigint, p_upto_xid xid8, p_upto_id bigint, p_limit integer)
RETURNS TABLE (snap_xmin xid8, snap_xmax xid8, skippers boolean, pruned_xid xid8,
               pruned_id bigint, id bigint, xid text, resource_id text, resource_type text,
               resource_key text, revision bigint, type text, actor_type text, actor_id text,
               lease_generation bigint, lease_expires_at timestamptz, payload text,
               payload_sha256 bytea, created_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET jit = off AS $$
DECLARE
    v_skippers boolean := true;
BEGIN
    IF p_after_xid IS NULL OR p_after_id IS NULL OR p_upto_xid IS NULL OR p_upto_id IS NULL THEN
        RAISE EXCEPTION 'watch_read needs both positions' USING ERRCODE = 'PGL20';
    END IF;
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'limit must be between 1 and 10000, got %', coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'PGL20';
    END IF;
    IF pg_try_advisory_lock(hashtext('pglease.skip'), hashtext('@schema@')) THEN
        PERFORM pg_advisory_unlock(hashtext('pglease.skip'), hashtext('@schema@'));
        v_skippers := false;
    END IF;
    -- A new statement, so a new snapshot, taken after the probe.
    RETURN QUERY
    WITH snap AS MATERIALIZED (SELECT pg_current_snapshot() AS s)
    SELECT pg_snapshot_xmin(snap.s), pg_snapshot_xmax(snap.s), v_skippers,
           h.pruned_xid, h.pruned_id, ev.*
      FROM snap CROSS JOIN @schema@.event_horizon h
      LEFT JOIN LATERAL (
        SELECT e.id, e.xid::text, e.resource_id, r.type, r.key, e.revision, e.type,
               e.actor_type, e.actor_id, e.lease_generation, e.lease_expires_at, p.body,
               e.payload_sha256, e.created_at
          FROM @schema@.events e
          JOIN @schema@.resources r ON r.id = e.resource_id
          LEFT JOIN @schema@.payloads p ON p.sha256 = e.payload_sha256
         WHERE (e.xid, e.id) > (p_after_xid, p_after_id)
           AND (e.xid, e.id) <= (p_upto_xid, p_upto_id)
           AND e.xid < pg_snapshot_xmin(snap.s)
         ORDER BY e.xid, e.id LIMIT p_limit) ev ON true;
END $$;

-- Write `lease.expired` for up to p_limit leases whose holder's TTL ran out
-- without a release, in one transaction. Kept for direct callers; the reaper
-- uses reap_next (one lease per transaction, so a write to a later lease of a
-- batch cannot fail the batch on the order guard).
CREATE OR REPLACE FUNCTION @schema@.reap_expired(p_limit integer)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_id text;
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
    v_count integer := 0;
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'limit must be between 1 and 10000, got %', coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'PGL20';
    END IF;
    FOR v_id IN
        SELECT resource_id FROM @schema@.leases
         WHERE owner_id IS NOT NULL AND expires_at <= clock_timestamp()
           AND expired_generation IS DISTINCT FROM generation
         ORDER BY resource_id LIMIT p_limit
    LOOP
        -- Re-check under the lock: the holder may have renewed or released,
        -- or someone may have taken over, since the scan.
        SELECT * INTO l FROM @schema@.leases WHERE resource_id = v_id FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        v_now := clock_timestamp();
        CONTINUE WHEN l.owner_id IS NULL OR l.expires_at > v_now
                   OR l.expired_generation IS NOT DISTINCT FROM l.generation;
        UPDATE @schema@.leases SET expired_generation = l.generation WHERE resource_id = v_id;
        PERFORM @schema@._bump(v_id, v_now, 'lease.expired', l.owner_type, l.owner_id,
                               l.generation, l.expires_at, NULL);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END $$;

-- The reaper's unit of work: one lease per transaction. Like every other
-- writer it takes the resource's queue lock before its first write (so before
-- it has an xid), but it never waits: a resource a writer is busy with is left
-- to the next pass, and that writer, if it takes over, records the expiry
-- itself (claim).
--
-- Candidates come from the partial index leases_to_reap (sql/0012) in
-- (expires_at, resource_id) order, after the position of p_after (the
-- resource the previous call returned; '' to start): an idle pass reads one
-- index page whatever the table's size, and a pass visits each candidate at
-- most once. (If p_after was taken over meanwhile its position moved on, and
-- candidates before the new one wait for the next pass.) Returns (NULL,
-- false) when there is no candidate left.
CREATE OR REPLACE FUNCTION @schema@.reap_next(
    p_after text, OUT lease_resource text, OUT reaped boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz := clock_timestamp();
    v_after_expires timestamptz := '-infinity';
BEGIN
    IF p_after IS NULL THEN
        RAISE EXCEPTION 'p_after must not be NULL (use an empty string to start)'
            USING ERRCODE = 'PGL20';
    END IF;
    reaped := false;
    IF p_after <> '' THEN
        SELECT coalesce(c.expires_at, '-infinity') INTO v_after_expires
          FROM @schema@.leases c WHERE c.resource_id = p_after;
    END IF;
    -- The predicate repeats the index's, so the planner can use it.
    SELECT c.resource_id INTO lease_resource FROM @schema@.leases c
     WHERE c.owner_id IS NOT NULL AND c.expired_generation IS DISTINCT FROM c.generation
       AND c.expires_at <= v_now
       AND (c.expires_at, c.resource_id) > (coalesce(v_after_expires, '-infinity'), p_after)
     ORDER BY c.expires_at, c.resource_id LIMIT 1;
    IF lease_resource IS NULL
       OR NOT pg_try_advisory_xact_lock(hashtextextended(lease_resource, hashtext('@schema@'))) THEN
        RETURN;
    END IF;
    SELECT * INTO l FROM @schema@.leases c
     WHERE c.resource_id = lease_resource FOR UPDATE SKIP LOCKED;
    v_now := clock_timestamp();
    -- Re-checked under the locks: renewed, released or taken over meanwhile?
    IF NOT FOUND OR l.owner_id IS NULL OR l.expires_at > v_now
       OR l.expired_generation IS NOT DISTINCT FROM l.generation THEN
        RETURN;
    END IF;
    UPDATE @schema@.leases c SET expired_generation = l.generation
     WHERE c.resource_id = lease_resource;
    PERFORM @schema@._bump(lease_resource, v_now, 'lease.expired', l.owner_type, l.owner_id,
                           l.generation, l.expires_at, NULL);
    reaped := true;
END $$;

-- Payload garbage collection: delete payloads no event references.
--
-- Two statements, because each takes its own snapshot (READ COMMITTED):
--  1. lock the payloads that look unreferenced, FOR UPDATE SKIP LOCKED. A row
--     a writer holds FOR KEY SHARE (see mutate_begin) is about to be referenced
--     and is skipped; once locked here, no writer can start referencing a row.
--  2. delete those still unreferenced, judged by a fresh snapshot: a writer
--     that locked, referenced and committed between statement 1's snapshot
--     and its lock is visible now, and its payload stays.
-- A skipped row whose writer rolled back is collected by the next prune.
CREATE OR REPLACE FUNCTION @schema@._gc_payloads()
RETURNS bigint LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_candidates bytea[];
    v_count bigint;
BEGIN
    SELECT array_agg(c.sha256) INTO v_candidates FROM (
        SELECT p.sha256 FROM @schema@.payloads p
         WHERE NOT EXISTS (SELECT 1 FROM @schema@.events e WHERE e.payload_sha256 = p.sha256)
           FOR UPDATE OF p SKIP LOCKED) c;
    IF v_candidates IS NULL THEN
        RETURN 0;
    END IF;
    WITH gone AS (
        DELETE FROM @schema@.payloads p
         WHERE p.sha256 = ANY (v_candidates)
           AND NOT EXISTS (SELECT 1 FROM @schema@.events e WHERE e.payload_sha256 = p.sha256)
        RETURNING 1)
    SELECT count(*) INTO v_count FROM gone;
    RETURN v_count;
END $$;

-- Delete events created before now - p_older_than, as a prefix of the read
-- order (xid, id) and only below the readable frontier, raise the horizon to
-- the last deleted position, then delete the payloads no event references.
-- The schema owner's job: no client or reader role is granted it.
CREATE OR REPLACE FUNCTION @schema@.prune_log(
    p_older_than interval, OUT events bigint, OUT payloads bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_cutoff timestamptz;
    v_xmin xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_keep_xid xid8;
    v_keep_id bigint;
    v_max_xid xid8;
    v_max_id bigint;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION 'older_than must be a non-negative interval, got %',
            coalesce(p_older_than::text, 'NULL') USING ERRCODE = 'PGL20';
    END IF;
    v_cutoff := clock_timestamp() - p_older_than;
    -- One pruner at a time; watchers are not blocked (they only read).
    PERFORM 1 FROM @schema@.event_horizon FOR UPDATE;
    SELECT e.xid, e.id INTO v_keep_xid, v_keep_id FROM @schema@.events e
     WHERE e.created_at >= v_cutoff OR e.xid >= v_xmin
     ORDER BY e.xid, e.id LIMIT 1;
    WITH gone AS (
        DELETE FROM @schema@.events e
         WHERE e.xid < v_xmin
           AND (v_keep_xid IS NULL OR (e.xid, e.id) < (v_keep_xid, v_keep_id))
        RETURNING e.xid, e.id)
    SELECT count(*), (array_agg(g.xid ORDER BY g.xid DESC, g.id DESC))[1],
           (array_agg(g.id ORDER BY g.xid DESC, g.id DESC))[1]
      INTO prune_log.events, v_max_xid, v_max_id FROM gone g;
    IF prune_log.events > 0 THEN
        UPDATE @schema@.event_horizon SET pruned_xid = v_max_xid, pruned_id = v_max_id,
            pruned_at = clock_timestamp()
         WHERE (pruned_xid, pruned_id) < (v_max_xid, v_max_id);
    END IF;
    prune_log.payloads := @schema@._gc_payloads();
END $$;

-- prune_log's first result alone, for callers of the older signature.
CREATE OR REPLACE FUNCTION @schema@.prune_events(p_older_than interval)
RETURNS bigint LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
    SELECT events FROM @schema@.prune_log(p_older_than);
$$;
