-- A set-based batch, for bench/batch_cost.py --floor only (never migrated):
-- what claim_many and release_many of 10 leases could cost if each ran its
-- items as one statement (one UPDATE of the lease rows, one of the revisions,
-- one INSERT of the events) instead of one single-lease function per item.
-- Kept: the queue locks in resource-id order before the first write (so the
-- order guard could not fire and is left out), the grant and release
-- conditions of claim's and release's one statement, a revision and an event
-- per lease, the NOTIFY election. Left out: what the single functions' cold
-- ways do (an unrecorded expiry's `lease.expired`, the wording of a refused
-- item: such items are simply missing from the result), the input checks.
-- `@schema@` is the bench's schema.

CREATE OR REPLACE FUNCTION @schema@.claim_many_floor(
    p_resources text[], p_owner_type text, p_owner_id text, p_token_sha256s bytea[],
    p_ttl double precision, p_now timestamptz)
RETURNS TABLE (ord integer, claimed boolean, generation bigint, expires_at timestamptz,
               revision bigint, holder_type text, holder_id text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_order integer[] := @schema@._batch_order('claim_many', p_resources);
    i integer;
    v_now timestamptz;
    v_got integer[];
    c record;
BEGIN
    PERFORM @schema@._check_owner('owner', p_owner_type, p_owner_id);
    FOREACH i IN ARRAY v_order LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[i], hashtext('@schema@')));
    END LOOP;
    v_now := clock_timestamp();
    RETURN QUERY
    WITH g AS (
        UPDATE @schema@.leases x SET generation = x.generation + 1, owner_type = p_owner_type,
            owner_id = p_owner_id, token_sha256 = u.tok, acquired_at = v_now, heartbeat_at = v_now,
            expires_at = v_now + make_interval(secs => p_ttl)
          FROM unnest(p_resources, p_token_sha256s) WITH ORDINALITY u(rid, tok, o)
         WHERE x.resource_id = u.rid
           AND (x.owner_id IS NULL OR (x.expires_at <= v_now AND x.expired_generation IS NOT DISTINCT FROM x.generation))
           AND (x.revoked_until IS NULL OR x.revoked_until <= v_now)
        RETURNING u.o, x.resource_id, x.generation, x.expires_at),
    r AS (
        UPDATE @schema@.resources x SET revision = x.revision + 1, updated_at = v_now
          FROM g WHERE x.id = g.resource_id RETURNING x.id, x.revision),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT g.resource_id, r.revision, 'lease.claimed', p_owner_type, p_owner_id,
               g.generation, g.expires_at, v_now FROM g JOIN r ON r.id = g.resource_id)
    SELECT g.o::integer, true, g.generation, g.expires_at, r.revision, p_owner_type, p_owner_id
      FROM g JOIN r ON r.id = g.resource_id;
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@'))
       OR pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@')) THEN
        PERFORM pg_notify(left('pglease_@schema@', 63), '');
    END IF;
END $$;

CREATE OR REPLACE FUNCTION @schema@.release_many_floor(
    p_resources text[], p_owner_types text[], p_owner_ids text[], p_generations bigint[],
    p_token_sha256s bytea[], p_now timestamptz)
RETURNS TABLE (ord integer, revision bigint, error_code text, error_message text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_order integer[] := @schema@._batch_order('release_many', p_resources);
    i integer;
    v_now timestamptz;
BEGIN
    FOREACH i IN ARRAY v_order LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[i], hashtext('@schema@')));
    END LOOP;
    v_now := clock_timestamp();
    RETURN QUERY
    WITH g AS (
        UPDATE @schema@.leases x SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL,
            expires_at = NULL, heartbeat_at = v_now
          FROM unnest(p_resources, p_owner_types, p_owner_ids, p_generations, p_token_sha256s)
               WITH ORDINALITY u(rid, ot, oi, g, t, o)
         WHERE x.resource_id = u.rid AND x.owner_type = u.ot AND x.owner_id = u.oi
           AND x.generation = u.g AND x.token_sha256 = u.t
        RETURNING u.o, x.resource_id, u.ot, u.oi, u.g),
    r AS (
        UPDATE @schema@.resources x SET revision = x.revision + 1, updated_at = v_now
          FROM g WHERE x.id = g.resource_id RETURNING x.id, x.revision),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT g.resource_id, r.revision, 'lease.released', g.ot, g.oi, g.g, NULL, v_now
          FROM g JOIN r ON r.id = g.resource_id)
    SELECT g.o::integer, r.revision, NULL::text, NULL::text FROM g JOIN r ON r.id = g.resource_id;
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@'))
       OR pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@')) THEN
        PERFORM pg_notify(left('pglease_@schema@', 63), '');
    END IF;
END $$;
