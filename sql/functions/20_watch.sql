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
        l.expired_generation := l.generation;
        PERFORM @schema@._bump_lease(l, v_now, 'lease.expired', l.owner_type, l.owner_id,
                                     l.generation, l.expires_at);
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
    -- One update of the lease row: the recorded expiry with the bump.
    l.expired_generation := l.generation;
    PERFORM @schema@._bump_lease(l, v_now, 'lease.expired', l.owner_type, l.owner_id,
                                 l.generation, l.expires_at);
    reaped := true;
END $$;

-- One chunk of a prune, in its own transaction (pglease.watch.prune drives
-- them): delete up to p_limit events from the start of the log in read order
-- (xid, id), as long as each was created before p_cutoff and lies below the
-- readable frontier (pg_snapshot_xmin); stop at the first that is not. Raise
-- the horizon to the last deleted position in the same transaction, so a
-- watcher sees either the events or the raised horizon, never neither: a
-- cursor below the horizon gets CursorExpiredError, a cursor at or above it
-- has lost nothing. The deleted events' payloads are queued for
-- gc_payloads_chunk. `done` is true when the prefix ends within this chunk.
--
-- Bounded: it reads at most p_limit index entries after the horizon (every
-- event below the horizon is gone: it was below the frontier, so no event can
-- arrive there later), whatever the log's size. Several chunks give the
-- result one big delete would (a chunk's frontier is never older than the
-- previous one's). The schema owner's job: no client or reader role is
-- granted it.
CREATE OR REPLACE FUNCTION @schema@.prune_chunk(
    p_cutoff timestamptz, p_limit integer, OUT events bigint, OUT done boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    h @schema@.event_horizon%ROWTYPE;
    v_xmin xid8;
    v_run bigint;
    v_last_xid xid8;
    v_last_id bigint;
BEGIN
    IF p_cutoff IS NULL OR p_cutoff > clock_timestamp() THEN
        RAISE EXCEPTION 'cutoff must be an instant not in the future, got %',
            coalesce(p_cutoff::text, 'NULL') USING ERRCODE = 'PGL20';
    END IF;
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'chunk must be between 1 and 100000, got %', coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'PGL20';
    END IF;
    -- One pruner at a time; watchers are not blocked (they only read).
    SELECT * INTO h FROM @schema@.event_horizon FOR UPDATE;
    v_xmin := pg_snapshot_xmin(pg_current_snapshot());
    -- The run of deletable events at the head of what is left: a running AND
    -- in read order, true up to the first keeper.
    SELECT count(*) FILTER (WHERE w.run),
           (array_agg(w.xid ORDER BY w.xid DESC, w.id DESC) FILTER (WHERE w.run))[1],
           (array_agg(w.id ORDER BY w.xid DESC, w.id DESC) FILTER (WHERE w.run))[1]
      INTO v_run, v_last_xid, v_last_id
      FROM (SELECT hd.xid, hd.id,
                   bool_and(hd.old) OVER (ORDER BY hd.xid, hd.id) AS run
              FROM (SELECT e.xid, e.id, (e.created_at < p_cutoff AND e.xid < v_xmin) AS old
                      FROM @schema@.events e
                     WHERE (e.xid, e.id) > (h.pruned_xid, h.pruned_id)
                     ORDER BY e.xid, e.id LIMIT p_limit) hd) w;
    events := 0;
    IF v_run > 0 THEN
        -- Every event in this range was in the run: it is below the frontier,
        -- so nothing committed since the run was read can fall inside it.
        WITH gone AS (
            DELETE FROM @schema@.events e
             WHERE (e.xid, e.id) > (h.pruned_xid, h.pruned_id)
               AND (e.xid, e.id) <= (v_last_xid, v_last_id)
               AND e.xid < v_xmin
            RETURNING e.payload_sha256),
        queued AS (
            INSERT INTO @schema@.payload_gc_queue (sha256)
            SELECT DISTINCT g.payload_sha256 FROM gone g WHERE g.payload_sha256 IS NOT NULL
            ON CONFLICT DO NOTHING)
        SELECT count(*) INTO prune_chunk.events FROM gone;
        UPDATE @schema@.event_horizon SET pruned_xid = v_last_xid, pruned_id = v_last_id,
            pruned_at = clock_timestamp()
         WHERE (pruned_xid, pruned_id) < (v_last_xid, v_last_id);
    END IF;
    -- A full run may be followed by more; anything shorter met a keeper or the end.
    done := v_run < p_limit;
END $$;

-- Payload garbage collection, one chunk: up to p_limit queued payloads after
-- p_after (in sha256 order; an empty bytea to start), each deleted if no event
-- references it. Only payloads whose events prune deleted are ever queued, so
-- this never scans the payload table.
--
-- Two statements, because each takes its own snapshot (READ COMMITTED):
--  1. lock the candidates that look unreferenced, FOR UPDATE SKIP LOCKED. A row
--     a writer holds FOR KEY SHARE (see mutate_begin) is about to be referenced
--     and is skipped; once locked here, no writer can start referencing a row
--     (its key-share lock and its foreign-key check wait for this transaction).
--  2. delete those still unreferenced, judged by a fresh snapshot: a writer
--     that locked, referenced and committed between statement 1's snapshot
--     and its lock is visible now, and its payload stays.
-- Then the batch leaves the queue, except the rows skipped in 1 that are still
-- stored and unreferenced: their writer may roll back, and the next prune
-- judges them again. A referenced payload leaves the queue: the prune that
-- deletes its referencing event queues it again. `last_sha256` is where the
-- next chunk starts (p_after, so a skipped row is not read twice in one run);
-- `done` is true when the queue after p_after is exhausted. Never waits for a
-- writer.
CREATE OR REPLACE FUNCTION @schema@.gc_payloads_chunk(
    p_after bytea, p_limit integer,
    OUT payloads bigint, OUT last_sha256 bytea, OUT done boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_batch bytea[];
    v_locked bytea[];
BEGIN
    IF p_after IS NULL THEN
        RAISE EXCEPTION 'p_after must not be NULL (use an empty bytea to start)'
            USING ERRCODE = 'PGL20';
    END IF;
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'chunk must be between 1 and 100000, got %', coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'PGL20';
    END IF;
    -- Serialised with prune_chunk: no event is deleted between the statements.
    PERFORM 1 FROM @schema@.event_horizon FOR UPDATE;
    SELECT array_agg(q.sha256 ORDER BY q.sha256) INTO v_batch FROM (
        SELECT g.sha256 FROM @schema@.payload_gc_queue g WHERE g.sha256 > p_after
         ORDER BY g.sha256 LIMIT p_limit) q;
    payloads := 0;
    done := coalesce(cardinality(v_batch), 0) < p_limit;
    last_sha256 := coalesce(v_batch[cardinality(v_batch)], p_after);
    IF v_batch IS NULL THEN
        RETURN;
    END IF;
    SELECT coalesce(array_agg(c.sha256), '{}') INTO v_locked FROM (
        SELECT p.sha256 FROM @schema@.payloads p
         WHERE p.sha256 = ANY (v_batch)
           AND NOT EXISTS (SELECT 1 FROM @schema@.events e WHERE e.payload_sha256 = p.sha256)
           FOR UPDATE OF p SKIP LOCKED) c;
    WITH gone AS (
        DELETE FROM @schema@.payloads p
         WHERE p.sha256 = ANY (v_locked)
           AND NOT EXISTS (SELECT 1 FROM @schema@.events e WHERE e.payload_sha256 = p.sha256)
        RETURNING 1)
    SELECT count(*) INTO gc_payloads_chunk.payloads FROM gone;
    DELETE FROM @schema@.payload_gc_queue g
     WHERE g.sha256 = ANY (v_batch)
       AND (g.sha256 = ANY (v_locked)
            OR NOT EXISTS (SELECT 1 FROM @schema@.payloads p WHERE p.sha256 = g.sha256)
            OR EXISTS (SELECT 1 FROM @schema@.events e WHERE e.payload_sha256 = g.sha256));
END $$;

-- Every queued payload no event references, in one transaction (prune_log's
-- second step). Kept for prune_log's callers; pglease.watch.prune uses
-- gc_payloads_chunk.
CREATE OR REPLACE FUNCTION @schema@._gc_payloads()
RETURNS bigint LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r record;
    v_after bytea := '\x';
    v_count bigint := 0;
BEGIN
    LOOP
        SELECT * INTO r FROM @schema@.gc_payloads_chunk(v_after, 10000);
        v_count := v_count + r.payloads;
        v_after := r.last_sha256;
        EXIT WHEN r.done;
    END LOOP;
    RETURN v_count;
END $$;

-- Delete events created before now - p_older_than, as a prefix of the read
-- order (xid, id) and only below the readable frontier, raise the horizon to
-- the last deleted position, then delete the payloads of the deleted events
-- that no event references any more, all in ONE transaction: it holds back
-- every watcher of the cluster for its duration. Kept for direct SQL callers;
-- pglease.watch.prune runs the same work as short chunks.
-- The schema owner's job: no client or reader role is granted it.
CREATE OR REPLACE FUNCTION @schema@.prune_log(
    p_older_than interval, OUT events bigint, OUT payloads bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_cutoff timestamptz;
    r record;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION 'older_than must be a non-negative interval, got %',
            coalesce(p_older_than::text, 'NULL') USING ERRCODE = 'PGL20';
    END IF;
    v_cutoff := clock_timestamp() - p_older_than;
    prune_log.events := 0;
    LOOP
        SELECT * INTO r FROM @schema@.prune_chunk(v_cutoff, 100000);
        prune_log.events := prune_log.events + r.events;
        EXIT WHEN r.done;
    END LOOP;
    prune_log.payloads := @schema@._gc_payloads();
END $$;

-- prune_log's first result alone, for callers of the older signature.
CREATE OR REPLACE FUNCTION @schema@.prune_events(p_older_than interval)
RETURNS bigint LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
    SELECT events FROM @schema@.prune_log(p_older_than);
$$;
