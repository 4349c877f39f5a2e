-- pglease fleet runtime: batch heartbeat for a host's leases, and a fair
-- (arrival-ordered) waiting queue per resource.

-- ---------------------------------------------------------------------------
-- Batch heartbeat.
--
-- What a heartbeat changes: only `expires_at` and `heartbeat_at` of leases
-- that are still current (same owner, generation and token hash) and not yet
-- expired by the database clock. It does NOT bump the resource revision and
-- writes NO event: keeping a lease alive is not a change of the resource, so a
-- holder's cached revision stays valid for its own `expected_revision` writes
-- (a heartbeat that bumped revisions would make every holder's mutations stale,
-- the pi-workflows trap). The explicit `renew()` keeps its semantics (revision
-- bump + `lease.renewed` event) for callers who want the extension on record.
-- Watchers therefore see no heartbeat traffic; `expires_at` in `get()` is the
-- truth for the current expiry.
--
-- Locking: rows are locked in resource-id order (one order for every caller, so
-- two heartbeats never deadlock) with SKIP LOCKED: a row locked by someone else
-- (typically the holder's own in-flight mutation, or a claim attempt being
-- refused) is reported as 'busy' and the keeper retries it shortly. So a beat is
-- one bounded statement that never waits behind user SQL.
--
-- The per-resource advisory queue of `_lock_lease` is deliberately not taken:
-- it exists so that event-writing transactions of a resource obtain their xids
-- in revision order. A heartbeat writes no event, so its xid is in no reader's
-- order; and as it never waits for a row lock it cannot reorder the writers
-- queued behind the advisory lock (the one writer past it still takes its xid
-- before any later writer). Taking the advisory lock would instead make a beat
-- wait behind every queued writer.
--
-- Returns one row per requested lease: status 'renewed' (with the new
-- expires_at), 'lost' (released, taken over, other token or owner: never
-- current again), 'expired' (still recorded but its TTL ran out), 'busy' (row
-- locked right now; try again) or 'unknown' (no such resource).
CREATE FUNCTION @schema@.heartbeat(
    p_resources text[], p_generations bigint[], p_token_sha256s bytea[],
    p_owner_types text[], p_owner_ids text[], p_ttls double precision[])
RETURNS TABLE (resource_id text, status text, expires_at timestamptz,
               current_generation bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
BEGIN
    -- Locks are never waited for (SKIP LOCKED), so this is also the time
    -- expiry is judged at.
    v_now := clock_timestamp();
    RETURN QUERY
    WITH req AS (
        SELECT r.* FROM unnest(p_resources, p_generations, p_token_sha256s, p_owner_types,
                               p_owner_ids, p_ttls)
            AS r(rid, generation, token_sha256, owner_type, owner_id, ttl)
    ), locked AS MATERIALIZED (
        SELECT l.resource_id FROM @schema@.leases l
         WHERE l.resource_id = ANY (p_resources)
         ORDER BY l.resource_id
           FOR UPDATE SKIP LOCKED
    ), upd AS (
        UPDATE @schema@.leases l
           SET heartbeat_at = v_now, expires_at = v_now + make_interval(secs => req.ttl)
          FROM req
         WHERE l.resource_id = req.rid
           AND l.resource_id IN (SELECT k.resource_id FROM locked k)
           AND l.owner_id IS NOT NULL
           AND l.owner_type = req.owner_type AND l.owner_id = req.owner_id
           AND l.generation = req.generation AND l.token_sha256 = req.token_sha256
           AND l.expires_at > v_now
        RETURNING l.resource_id, l.expires_at
    )
    -- The outer query sees the rows as before the UPDATE: that is what the
    -- status of a refused lease is judged on.
    SELECT req.rid,
           CASE WHEN u.resource_id IS NOT NULL THEN 'renewed'
                WHEN l.resource_id IS NULL THEN 'unknown'
                WHEN l.owner_id IS NULL OR l.owner_type <> req.owner_type
                     OR l.owner_id <> req.owner_id OR l.generation <> req.generation
                     OR l.token_sha256 <> req.token_sha256 THEN 'lost'
                WHEN l.expires_at <= v_now THEN 'expired'
                ELSE 'busy' END,
           u.expires_at,
           l.generation
      FROM req
      LEFT JOIN upd u ON u.resource_id = req.rid
      LEFT JOIN @schema@.leases l ON l.resource_id = req.rid;
END $$;

-- ---------------------------------------------------------------------------
-- Fair waiting.
--
-- A fair waiter enqueues once (getting an arrival number) and claims only when
-- it is the head of the resource's queue of live waiters. Enqueueing and
-- claiming both happen under `_lock_lease`, so arrival numbers of one resource
-- are handed out in the order the waiters reached the database, across hosts.
-- A waiter row carries its own expiry, refreshed by every attempt of the waiter
-- (it re-attempts at least every third of it): a waiter that died stops
-- blocking the queue when its row expires. A waiter that gives up deletes its
-- row. Plain `claim` does not look at the queue: fairness holds among fair
-- waiters, and a non-fair claimer may still barge in.
CREATE TABLE @schema@.lease_waiters (
    waiter_id    text PRIMARY KEY,
    resource_id  text NOT NULL REFERENCES @schema@.resources (id),
    seq          bigint GENERATED ALWAYS AS IDENTITY,
    owner_type   text NOT NULL,
    owner_id     text NOT NULL,
    enqueued_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX lease_waiters_queue ON @schema@.lease_waiters (resource_id, seq);

-- One attempt of fair waiter p_waiter: refresh (or create) its queue entry,
-- drop dead entries, and claim if it is the head. `claimed` as in `claim`;
-- `position` is the number of live waiters ahead (0 = head); head_expires_at
-- is when the head's entry runs out if it stops refreshing (a wake-up time for
-- the others).
CREATE FUNCTION @schema@.claim_fair(
    p_resource text, p_owner_type text, p_owner_id text, p_token_sha256 bytea,
    p_ttl double precision, p_waiter text, p_waiter_ttl double precision,
    OUT claimed boolean, OUT generation bigint, OUT expires_at timestamptz,
    OUT revision bigint, OUT holder_type text, OUT holder_id text,
    OUT "position" integer, OUT head_expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
    v_seq bigint;
    c record;
BEGIN
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
        expires_at := CASE WHEN l.owner_id IS NULL THEN NULL ELSE l.expires_at END;
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
CREATE FUNCTION @schema@.leave_queue(p_waiter text)
RETURNS boolean LANGUAGE sql AS $$
    WITH gone AS (DELETE FROM @schema@.lease_waiters WHERE waiter_id = p_waiter RETURNING 1)
    SELECT count(*) > 0 FROM gone;
$$;
