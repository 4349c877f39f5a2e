-- pglease watch support: coalesced wake-up hints, per-resource order guard,
-- expiry events written by a reaper, and event retention with a prune horizon.

-- The generation whose expiry already produced a `lease.expired` event, so the
-- reaper writes at most one per generation.
ALTER TABLE @schema@.leases ADD COLUMN expired_generation bigint;

-- The highest event position ever deleted by `prune_events`. A watcher whose
-- cursor is below it missed deleted events and must get CursorExpiredError.
CREATE TABLE @schema@.event_horizon (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    pruned_xid  xid8 NOT NULL DEFAULT '0',
    pruned_id   bigint NOT NULL DEFAULT 0,
    pruned_at   timestamptz
);
INSERT INTO @schema@.event_horizon DEFAULT VALUES;

-- Same signature as 0001; adds two things after the event insert:
--  * order guard: readers deliver events in (xid, id) order, so a resource's
--    revision n+1 must not carry a smaller xid than revision n. That can only
--    happen to a transaction that took its xid before waiting for the lease row
--    lock (several writes in one transaction); it is refused as a serialization
--    failure, which clients retry. pglease's own functions lock the lease row
--    first, so they never trip it.
--  * coalesced wake-up: NOTIFY takes a cluster-wide lock at commit, so only the
--    one transaction that holds an advisory xact lock notifies; the others
--    skip it. Watchers re-poll while their read was held back by in-flight
--    transactions or skippers (see the proof in pglease/watch/__init__.py).
CREATE OR REPLACE FUNCTION @schema@._bump(
    p_resource text, p_now timestamptz, p_type text, p_actor_type text, p_actor_id text,
    p_generation bigint, p_expires_at timestamptz, p_payload_sha256 bytea,
    OUT revision bigint, OUT event_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_prev xid8;
BEGIN
    UPDATE @schema@.resources SET revision = revision + 1, updated_at = p_now
        WHERE id = p_resource RETURNING resources.revision INTO _bump.revision;
    INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                 lease_generation, lease_expires_at, payload_sha256, created_at)
        VALUES (p_resource, _bump.revision, p_type, p_actor_type, p_actor_id,
                p_generation, p_expires_at, p_payload_sha256, p_now)
        RETURNING events.id INTO _bump.event_id;
    IF _bump.revision > 1 THEN
        SELECT e.xid INTO v_prev FROM @schema@.events e
            WHERE e.resource_id = p_resource AND e.revision = _bump.revision - 1;
        IF v_prev > pg_current_xact_id() THEN
            RAISE EXCEPTION 'event order: revision % of % would be ordered before revision %',
                _bump.revision, p_resource, _bump.revision - 1
                USING ERRCODE = '40001',
                      HINT = 'lock the lease row before the transaction writes anything else';
        END IF;
    END IF;
    -- Key 1 elects the notifier; key 2 (shared) marks skippers in flight so a
    -- watcher's probe (watch_read) sees them even when their xid is above its
    -- snapshot's xmax. A skipper that cannot get key 2 (a probe holds it for
    -- an instant) notifies itself.
    IF pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@'))
       OR NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@')) THEN
        PERFORM pg_notify(left('pglease_@schema@', 63), '');
    END IF;
END $$;

-- Write `lease.expired` for up to p_limit leases whose holder's TTL ran out
-- without a release. Lock order as everywhere: lease row first, then _bump.
-- The holder stays recorded (claim judges expiry by the clock, not by this
-- event); only the revision moves, and the marker makes it once per generation.
CREATE FUNCTION @schema@.reap_expired(p_limit integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_id text;
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
    v_count integer := 0;
BEGIN
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

-- Delete events created before now - p_older_than, as a prefix of the read
-- order (xid, id) and only below the readable frontier, and raise the horizon
-- to the last deleted position. Returns the number of events deleted.
CREATE FUNCTION @schema@.prune_events(p_older_than interval)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_xmin xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_keep_xid xid8;
    v_keep_id bigint;
    v_max_xid xid8;
    v_max_id bigint;
    v_count bigint;
BEGIN
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
      INTO v_count, v_max_xid, v_max_id FROM gone g;
    IF v_count > 0 THEN
        UPDATE @schema@.event_horizon SET pruned_xid = v_max_xid, pruned_id = v_max_id,
            pruned_at = clock_timestamp()
         WHERE (pruned_xid, pruned_id) < (v_max_xid, v_max_id);
    END IF;
    RETURN v_count;
END $$;

-- One watcher read: first probe for skippers in flight (before the query's
-- snapshot is taken, so a skipper that finished before the probe is visible
-- to the query), then the events after (p_after) up to (p_upto), only below
-- the snapshot's xmin, with the snapshot bounds and the prune horizon. Always
-- returns at least one row (event columns NULL when there is no event).
CREATE FUNCTION @schema@.watch_read(
    p_after_xid xid8, p_after_id bigint, p_upto_xid xid8, p_upto_id bigint, p_limit integer)
RETURNS TABLE (snap_xmin xid8, snap_xmax xid8, skippers boolean, pruned_xid xid8,
               pruned_id bigint, id bigint, xid text, resource_id text, resource_type text,
               resource_key text, revision bigint, type text, actor_type text, actor_id text,
               lease_generation bigint, lease_expires_at timestamptz, payload text,
               payload_sha256 bytea, created_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_skippers boolean := true;
BEGIN
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
