-- Expiry events on takeover, payload garbage collection in prune, and a
-- payload write that a concurrent prune cannot pull out from under a writer.

-- ---------------------------------------------------------------------------
-- claim: same signature and result as 0001. New: taking over a holder whose
-- TTL ran out and whose expiry the reaper has not recorded yet first writes
-- that generation's `lease.expired` (exactly what reap_expired would have
-- written, with the same marker), then the claim's `lease.claimed`. Without
-- it, a takeover that beats the reaper left that generation with no expiry
-- event at all, and watchers never learnt it ran out without a release.
--
-- Both events are written under the lease row lock in one transaction, so the
-- expiry takes revision n+1 and the claim n+2; the claim returns n+2, the
-- revision of its own event, as before. The extra work only happens on that
-- takeover branch: a claim of a free or released lease runs as in 0001 plus
-- one comparison, and a refused claim is unchanged. `claim_fair` (0005)
-- calls this function, so fair waiters get the same behaviour.
CREATE OR REPLACE FUNCTION @schema@.claim(
    p_resource text, p_owner_type text, p_owner_id text, p_token_sha256 bytea,
    p_ttl double precision, p_expected_revision bigint, p_now timestamptz,
    OUT claimed boolean, OUT generation bigint, OUT expires_at timestamptz,
    OUT revision bigint, OUT holder_type text, OUT holder_id text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
BEGIN
    l := @schema@._lock_lease(p_resource);
    PERFORM @schema@._check_revision(p_resource, p_expected_revision);
    -- Judge expiry after the lock wait, by the database clock.
    v_now := coalesce(p_now, clock_timestamp());
    IF l.owner_id IS NOT NULL AND l.expires_at > v_now THEN
        SELECT false, l.generation, l.expires_at, r.revision, l.owner_type, l.owner_id
          INTO claimed, generation, expires_at, revision, holder_type, holder_id
          FROM @schema@.resources r WHERE r.id = p_resource;
        RETURN;
    END IF;
    -- A holder still recorded here has expired (not released). Record its
    -- expiry unless the reaper already did (then the marker equals its generation).
    IF l.owner_id IS NOT NULL AND l.expired_generation IS DISTINCT FROM l.generation THEN
        l.expired_generation := l.generation;
        PERFORM @schema@._bump(p_resource, v_now, 'lease.expired', l.owner_type, l.owner_id,
                               l.generation, l.expires_at, NULL);
    END IF;
    claimed := true;
    generation := l.generation + 1;
    expires_at := v_now + make_interval(secs => p_ttl);
    holder_type := p_owner_type;
    holder_id := p_owner_id;
    UPDATE @schema@.leases SET generation = claim.generation, owner_type = p_owner_type,
        owner_id = p_owner_id, token_sha256 = p_token_sha256, acquired_at = v_now,
        heartbeat_at = v_now, expires_at = claim.expires_at,
        expired_generation = l.expired_generation
        WHERE resource_id = p_resource;
    SELECT b.revision INTO revision FROM @schema@._bump(p_resource, v_now, 'lease.claimed',
        p_owner_type, p_owner_id, claim.generation, claim.expires_at, NULL) b;
END $$;

-- ---------------------------------------------------------------------------
-- mutate_begin: same signature and result as 0001. New: a payload that is
-- already stored is locked FOR KEY SHARE before the event that references it
-- is inserted, and stored again if a concurrent prune deleted it meanwhile.
--
-- Why: `INSERT ... ON CONFLICT DO NOTHING` takes no lock on the row it
-- conflicts with. Now that prune deletes unreferenced payloads (below), a
-- prune committing between that insert and the event insert would make the
-- event's foreign-key check fail: a raw error, and the write lost. The lock
-- closes the window:
--  * a writer that holds the key-share lock blocks prune's FOR UPDATE, and
--    prune skips such rows (SKIP LOCKED), so the payload stays;
--  * a writer that comes second waits for prune's lock; if prune deleted the
--    row, the locking read finds nothing and the loop inserts it again (the
--    insert itself waits for an in-progress delete, then succeeds).
-- KEY SHARE is the lock the foreign-key check takes anyway, so writers sharing
-- a payload still do not block each other. The loop ends: each turn either
-- inserts the row (ours until commit, invisible to prune), or locks it, or
-- saw it deleted by a prune that has committed.
CREATE OR REPLACE FUNCTION @schema@.mutate_begin(
    p_resource text, p_expected_revision bigint, p_event_type text,
    p_owner_type text, p_owner_id text, p_generation bigint, p_token_sha256 bytea,
    p_actor_type text, p_actor_id text, p_payload text, p_now timestamptz,
    OUT revision bigint, OUT event_id bigint, OUT payload_sha256 bytea)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
    v_body text;
BEGIN
    l := @schema@._lock_lease(p_resource);
    v_now := coalesce(p_now, clock_timestamp());
    IF p_token_sha256 IS NOT NULL THEN
        PERFORM @schema@._check_current(l, p_owner_type, p_owner_id, p_generation,
                                        p_token_sha256);
        PERFORM @schema@._check_revision(p_resource, p_expected_revision);
        IF l.expires_at <= v_now THEN
            RAISE EXCEPTION 'lease generation % on % expired at %', l.generation, p_resource,
                l.expires_at USING ERRCODE = 'PGL04';
        END IF;
        p_actor_type := p_owner_type;
        p_actor_id := p_owner_id;
    ELSE
        PERFORM @schema@._check_revision(p_resource, p_expected_revision);
    END IF;
    IF p_token_sha256 IS NULL AND l.owner_id IS NOT NULL AND l.expires_at > v_now THEN
        RAISE EXCEPTION 'resource % is leased by %:% (generation %) until %; unleased writes are refused',
            p_resource, l.owner_type, l.owner_id, l.generation, l.expires_at
            USING ERRCODE = 'PGL05';
    END IF;
    IF p_payload IS NOT NULL THEN
        payload_sha256 := sha256(convert_to(p_payload, 'UTF8'));
        LOOP
            INSERT INTO @schema@.payloads (sha256, body)
                VALUES (mutate_begin.payload_sha256, p_payload)
                ON CONFLICT DO NOTHING;
            EXIT WHEN FOUND;
            SELECT body INTO v_body FROM @schema@.payloads
             WHERE sha256 = mutate_begin.payload_sha256 FOR KEY SHARE;
            IF FOUND THEN
                IF v_body IS DISTINCT FROM p_payload THEN
                    RAISE EXCEPTION 'payload % is stored with different bytes',
                        encode(mutate_begin.payload_sha256, 'hex') USING ERRCODE = 'PGL06';
                END IF;
                EXIT;
            END IF;
            -- Deleted by a prune that committed after our insert found it: again.
        END LOOP;
    END IF;
    SELECT b.revision, b.event_id INTO revision, event_id
      FROM @schema@._bump(p_resource, v_now, p_event_type, p_actor_type, p_actor_id,
                          CASE WHEN p_token_sha256 IS NULL THEN NULL ELSE p_generation END,
                          NULL, mutate_begin.payload_sha256) b;
END $$;

-- ---------------------------------------------------------------------------
-- Payload garbage collection: delete payloads no event references.
--
-- Two statements, because each takes its own snapshot (READ COMMITTED):
--  1. lock the payloads that look unreferenced, FOR UPDATE SKIP LOCKED. A row
--     a writer holds FOR KEY SHARE (see mutate_begin) is about to be referenced
--     and is skipped; once locked here, no writer can start referencing a row
--     (its key-share lock and its foreign-key check wait for this transaction).
--  2. delete those still unreferenced, judged by a fresh snapshot: a writer
--     that locked, referenced and committed between statement 1's snapshot
--     and its lock is visible now, and its payload stays (deleting it would
--     fail the foreign key).
-- A skipped row whose writer rolled back is collected by the next prune: this
-- scans all payloads, not only those of the events just deleted, which also
-- collects payloads left behind by prunes before this migration. Never waits
-- for a writer.
CREATE FUNCTION @schema@._gc_payloads()
RETURNS bigint LANGUAGE plpgsql AS $$
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

-- Delete events created before now - p_older_than (as prune_events in 0002:
-- a prefix of the read order, only below the readable frontier, raising the
-- horizon), then the payloads no event references any more. Returns both counts.
CREATE FUNCTION @schema@.prune_log(
    p_older_than interval, OUT events bigint, OUT payloads bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_xmin xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_keep_xid xid8;
    v_keep_id bigint;
    v_max_xid xid8;
    v_max_id bigint;
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
      INTO prune_log.events, v_max_xid, v_max_id FROM gone g;
    IF prune_log.events > 0 THEN
        UPDATE @schema@.event_horizon SET pruned_xid = v_max_xid, pruned_id = v_max_id,
            pruned_at = clock_timestamp()
         WHERE (pruned_xid, pruned_id) < (v_max_xid, v_max_id);
    END IF;
    prune_log.payloads := @schema@._gc_payloads();
END $$;

-- Same signature and result as 0002 (the number of events deleted), for
-- existing callers; it now collects unreferenced payloads too.
CREATE OR REPLACE FUNCTION @schema@.prune_events(p_older_than interval)
RETURNS bigint LANGUAGE sql AS $$
    SELECT events FROM @schema@.prune_log(p_older_than);
$$;
