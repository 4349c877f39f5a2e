-- Fleet runtime: batch heartbeat and fair (arrival-ordered) waiting.
-- Current definitions; see 10_core.sql for the conventions (pinned
-- search_path, qualified names, SECURITY DEFINER entry points, error codes)
-- and sql/0005_fleet.sql for the lease_waiters table.

-- Batch heartbeat.
--
-- What a heartbeat changes: only `expires_at` and `heartbeat_at` of leases
-- that are still current (same owner, generation and token hash) and not yet
-- expired by the database clock. It bumps no revision and writes no event:
-- keeping a lease alive is not a change of the resource, so a holder's cached
-- revision stays valid for its own `expected_revision` writes. The explicit
-- `renew()` keeps its revision bump and `lease.renewed` event.
--
-- Locking: rows are locked in resource-id order with SKIP LOCKED: a row
-- locked by someone else is reported 'busy' and the keeper retries it
-- shortly, so a beat never waits behind user SQL. The resource's queue lock
-- is not taken: a heartbeat writes no event, so its xid is in no reader's
-- order, and as it never waits for a row lock it cannot reorder the writers
-- queued behind it.
--
-- Returns one row per requested lease: 'renewed' (with the new expires_at),
-- 'lost' (released, taken over, other token or owner), 'expired' (recorded
-- but its TTL ran out), 'busy' (row locked right now) or 'unknown'.
--
-- Plans that cannot degrade. A beat of N leases on a table of M rows must
-- cost O(N log M) whatever the statistics say. The earlier single statement,
-- which joined the request to CTEs, was estimated at one row (selectivities
-- multiplied) and ran as nested loops with join filters: N^2 comparisons,
-- 13 s for 10,000 leases on 1,000,000 rows (PostgreSQL 18, fresh
-- statistics). Here `leases` is only ever reached by its primary key, and
-- the planner settings below leave no other plan: the request (an unnest)
-- drives a nested loop of index probes, with no hash or merge join to pick
-- by a wrong estimate.
--  1. lock and judge: the request joined to its rows, in id order, FOR UPDATE
--     SKIP LOCKED; each locked row is judged on its values as locked, and the
--     current, unexpired ones are extended in the same statement;
--  2. only when some requested lease was not locked (someone else holds its
--     row, or it does not exist): judge those on their committed values.
CREATE OR REPLACE FUNCTION @schema@.heartbeat(
    p_resources text[], p_generations bigint[], p_token_sha256s bytea[],
    p_owner_types text[], p_owner_ids text[], p_ttls double precision[])
RETURNS TABLE (resource_id text, status text, expires_at timestamptz,
               current_generation bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_rid text[];
    v_status text[];
    v_expires timestamptz[];
    v_generation bigint[];
BEGIN
    IF p_resources IS NULL OR cardinality(p_resources) > 100000
       OR cardinality(p_generations) IS DISTINCT FROM cardinality(p_resources)
       OR cardinality(p_token_sha256s) IS DISTINCT FROM cardinality(p_resources)
       OR cardinality(p_owner_types) IS DISTINCT FROM cardinality(p_resources)
       OR cardinality(p_owner_ids) IS DISTINCT FROM cardinality(p_resources)
       OR cardinality(p_ttls) IS DISTINCT FROM cardinality(p_resources) THEN
        RAISE EXCEPTION 'heartbeat needs six arrays of one length (at most 100000)'
            USING ERRCODE = 'PGL20';
    END IF;
    -- NaN sorts above every number, so NOT BETWEEN refuses it too.
    IF EXISTS (SELECT 1 FROM unnest(p_ttls) t WHERE t IS NULL OR NOT (t BETWEEN 0.001 AND 604800)) THEN
        RAISE EXCEPTION 'every ttl must be between 0.001 and 604800 seconds' USING ERRCODE = 'PGL11';
    END IF;
    -- Locks are never waited for (SKIP LOCKED), so this is also the time
    -- expiry is judged at.
    v_now := clock_timestamp();

    -- 1. One order for every caller (resource id), so two beats never deadlock.
    WITH k AS MATERIALIZED (
        SELECT r.rid, l.generation,
               CASE WHEN l.owner_id IS NULL OR l.owner_type <> r.owner_type
                         OR l.owner_id <> r.owner_id OR l.generation <> r.generation
                         OR l.token_sha256 <> r.token_sha256 THEN 'lost'
                    WHEN l.expires_at <= v_now THEN 'expired'
                    ELSE 'renewed' END AS status,
               v_now + make_interval(secs => r.ttl) AS new_expires_at
          FROM unnest(p_resources, p_generations, p_token_sha256s, p_owner_types,
                      p_owner_ids, p_ttls)
               AS r(rid, generation, token_sha256, owner_type, owner_id, ttl)
          JOIN @schema@.leases l ON l.resource_id = r.rid
         ORDER BY l.resource_id
           FOR UPDATE OF l SKIP LOCKED
    ), extended AS (
        UPDATE @schema@.leases l
           SET heartbeat_at = v_now, expires_at = k.new_expires_at
          FROM k
         WHERE k.status = 'renewed' AND l.resource_id = k.rid
    )
    SELECT array_agg(k.rid), array_agg(k.status),
           array_agg(CASE WHEN k.status = 'renewed' THEN k.new_expires_at END),
           array_agg(k.generation)
      INTO v_rid, v_status, v_expires, v_generation
      FROM k;
    RETURN QUERY SELECT * FROM unnest(v_rid, v_status, v_expires, v_generation);

    -- 2. The rest, rarely any: busy (locked by someone else right now; the
    --    keeper retries it shortly), lost, expired or unknown, judged on the
    --    committed row without waiting for its lock.
    IF coalesce(cardinality(v_rid), 0) < cardinality(p_resources) THEN
        RETURN QUERY
        SELECT r.rid,
               CASE WHEN l.resource_id IS NULL THEN 'unknown'
                    WHEN l.owner_id IS NULL OR l.owner_type <> r.owner_type
                         OR l.owner_id <> r.owner_id OR l.generation <> r.generation
                         OR l.token_sha256 <> r.token_sha256 THEN 'lost'
                    WHEN l.expires_at <= v_now THEN 'expired'
                    ELSE 'busy' END,
               NULL::timestamptz, l.generation
          FROM unnest(p_resources, p_generations, p_token_sha256s, p_owner_types,
                      p_owner_ids)
               AS r(rid, generation, token_sha256, owner_type, owner_id)
          LEFT JOIN @schema@.leases l ON l.resource_id = r.rid
         -- NOT IN over a subquery runs as one hashed lookup, not a scan per row.
         WHERE r.rid NOT IN (SELECT x FROM unnest(coalesce(v_rid, '{}')) x);
    END IF;
END $$;

-- One attempt of fair waiter p_waiter: refresh (or create) its queue entry,
-- drop dead entries, and claim if it is the head. `claimed` as in `claim`;
-- `position` is the number of live waiters ahead (0 = head); head_expires_at
-- is when the head's entry runs out if it stops refreshing. Enqueueing and
-- claiming both happen under the resource's queue lock, so arrival numbers
-- are handed out in the order the waiters reached the database.
CREATE OR REPLACE FUNCTION @schema@.claim_fair(
    p_resource text, p_owner_type text, p_owner_id text, p_token_sha256 bytea,
    p_ttl double precision, p_waiter text, p_waiter_ttl double precision,
    OUT claimed boolean, OUT generation bigint, OUT expires_at timestamptz,
    OUT revision bigint, OUT holder_type text, OUT holder_id text,
    OUT "position" integer, OUT head_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
    v_seq bigint;
    c record;
BEGIN
    PERFORM @schema@._check_resource_id(p_resource);
    PERFORM @schema@._check_owner('owner', p_owner_type, p_owner_id);
    PERFORM @schema@._check_ttl('ttl', p_ttl);
    PERFORM @schema@._check_ttl('waiter ttl', p_waiter_ttl);
    IF p_waiter IS NULL OR p_waiter = '' OR octet_length(p_waiter) > 256 THEN
        RAISE EXCEPTION 'waiter id must be 1 to 256 bytes' USING ERRCODE = 'PGL20';
    END IF;
    l := @schema@._lock_lease(p_resource);
    v_now := clock_timestamp();
    DELETE FROM @schema@.lease_waiters w
     WHERE w.resource_id = p_resource AND w.expires_at <= v_now AND w.waiter_id <> p_waiter;
    UPDATE @schema@.lease_waiters w SET expires_at = v_now + make_interval(secs => p_waiter_ttl)
     WHERE w.waiter_id = p_waiter AND w.resource_id = p_resource
    RETURNING w.seq INTO v_seq;
    IF NOT FOUND THEN
        INSERT INTO @schema@.lease_waiters (waiter_id, resource_id, owner_type, owner_id,
                                            expires_at)
        VALUES (p_waiter, p_resource, p_owner_type, p_owner_id,
                v_now + make_interval(secs => p_waiter_ttl))
        RETURNING seq INTO v_seq;
    END IF;
    SELECT count(*)::integer INTO "position" FROM @schema@.lease_waiters w
     WHERE w.resource_id = p_resource AND w.seq < v_seq;
    SELECT w.expires_at INTO head_expires_at FROM @schema@.lease_waiters w
     WHERE w.resource_id = p_resource ORDER BY w.seq LIMIT 1;
    IF "position" > 0 THEN
        claimed := false;
        generation := l.generation;
        holder_type := l.owner_type;
        holder_id := l.owner_id;
        -- Nobody holds it: NULL, or, while a revoked holder's expiry is
        -- waited for (see revoke_lease), the time it frees.
        expires_at := CASE WHEN l.owner_id IS NOT NULL THEN l.expires_at
                           WHEN l.revoked_until > v_now THEN l.revoked_until END;
        SELECT r.revision INTO revision FROM @schema@.resources r WHERE r.id = p_resource;
        RETURN;
    END IF;
    -- `claim` locks the same lease row again (re-entrant in one transaction).
    SELECT * INTO c FROM @schema@.claim(p_resource, p_owner_type, p_owner_id, p_token_sha256,
                                        p_ttl, NULL, NULL);
    claimed := c.claimed;
    generation := c.generation;
    expires_at := c.expires_at;
    revision := c.revision;
    holder_type := c.holder_type;
    holder_id := c.holder_id;
    IF claimed THEN
        DELETE FROM @schema@.lease_waiters w WHERE w.waiter_id = p_waiter;
        head_expires_at := NULL;
    END IF;
END $$;

-- A fair waiter gives up (timeout, cancellation): its entry goes at once.
CREATE OR REPLACE FUNCTION @schema@.leave_queue(p_waiter text)
RETURNS boolean LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
    WITH gone AS (DELETE FROM @schema@.lease_waiters WHERE waiter_id = p_waiter RETURNING 1)
    SELECT count(*) > 0 FROM gone;
$$;
