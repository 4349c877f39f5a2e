-- Batches of lease operations: claim_many, renew_many, release_many.
-- Current definitions; see 10_core.sql for the conventions (pinned
-- search_path, qualified names, SECURITY DEFINER entry points, error codes).
-- Added here: PGL21 invalid batch (size, lengths, duplicates).
--
-- What a batch is: N single operations in one statement, so one round trip
-- and one commit, each lease with its own generation, its own revision and
-- its own event, exactly as N calls of claim / renew / release would leave
-- them. Results are per item, not all-or-nothing: an item that is held by
-- someone else (claim) or no longer current or expired (renew, release)
-- reports that and the others go on. What refuses the whole batch, before
-- it changes anything (the statement fails and rolls back): bad arguments
-- of any item, a duplicate resource, an empty or too large batch, an
-- unknown resource, and every error a single call would raise that is not
-- about the lease's currency (time limits, a lost connection, ...).
--
-- Built on the single-lease entry points: each item is one call of
-- @schema@.claim / renew / release, so whatever layout those functions keep
-- their rows in, a batch writes the same rows and events (nothing here
-- writes a table itself).
--
-- Lock order and the order guard. Each resource's writers queue on its
-- advisory queue lock (see _lock_lease in 10_core.sql) before they write, so
-- that a resource's events are in (xid, id) order = revision order. A batch
-- first takes the queue lock of every item, in resource-id order (bytewise,
-- COLLATE "C"), and only then does the items, in the same order:
--  * no deadlock between batches: every batch (and the heartbeat, which
--    never waits: SKIP LOCKED) takes its locks in that one order, and a
--    single call holds one resource's locks only;
--  * an advisory lock assigns no transaction id, so the transaction gets its
--    id at its first write, after it holds every queue lock it will need.
--    Every earlier writer of those resources took the queue lock too and
--    had finished (committed or rolled back) before this transaction got it,
--    so its xid is smaller than the one this transaction gets afterwards: the
--    order guard in the per-item functions (`v_prev > pg_current_xact_id()`)
--    cannot fire. It stays in place and is still checked: the items after
--    the first run the single functions' cold ways (the transaction has an id
--    by then), which check it as before. (The legacy reap_expired, kept for
--    direct callers, writes without the queue lock; against it the guard
--    still refuses with 40001, as it would a single call.)
--
-- Per-item errors. A PL/pgSQL EXCEPTION block is a subtransaction, and a
-- subtransaction that writes holds a subxid until the top transaction ends;
-- more than 64 of them overflow the backend's subxid cache, and every
-- snapshot in the cluster then looks them up in pg_subtrans while the batch
-- runs. So no item runs in a block when it will succeed: with the queue
-- locks held, whether an item's lease is current (owner, generation, token)
-- cannot change (only writers that queue change those columns; the
-- heartbeat only extends an unexpired lease), so a read of the lease row
-- decides it. Only items that will fail (or a renew whose lease runs out
-- within a second of the read, which might fail) run in a block, which then
-- rolls back having written nothing. Claims never run in a block: a claim of
-- a held lease is a result, not an error.
--
-- Cost (bench/batch_cost.py, PG 18, 2 shared cores, 2026-12-06): server CPU
-- per lease (claim + release, 10 per batch, one backend) 225-245 us against
-- raw's single cycle 160-200 us and a single claim+release 420-460 us; leases
-- per second 1.6-2.9x raw's single cycle at 1 client, 0.97-1.16x at 8 (CPU-bound;
-- medians of runs at load 2.5-5, one outlier 1.80). Every
-- item after the first runs the single functions' cold way (the transaction
-- has an id by then), about 100 us for a claim and 75 us for a release
-- (profiled): their argument regexes, the refusal pre-check, five statements.
-- Running every release of a batch in an EXCEPTION block cost no measurable
-- extra at 10 items (275 us per lease both ways, +-10%); the subxid cache, not
-- the time, is why successes run outside one. The items as one set-based
-- statement (bench/batch_floor.sql, not a full implementation) measured
-- 115 us per lease and 2.0-2.5x raw at 8 clients: the way to issue 24's 1.5x
-- once the lease row layout settles.
--
-- The largest batch is 1000 items (MAX_BATCH in pglease/batches.py): the
-- batch holds all its locks until it commits, and the client's deadline
-- bounds it like any single call.

-- The items' positions in resource-id order: at most 1000 items, none named
-- twice. The ids themselves (and the owners, below) are checked by the
-- per-item functions, which raise PGL12 (PGL13) for a malformed one, and that
-- error fails the whole statement, so the batch is refused whole all the same.
-- They are not matched against their patterns here too: with its bounded
-- repetition ({0,62}) one such regex match costs about 9 us per id, a third of
-- what a batch item costs besides its own function (measured, PG 18).
CREATE OR REPLACE FUNCTION @schema@._batch_order(p_what text, p_resources text[])
RETURNS integer[] LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_order integer[];
    k integer;
BEGIN
    IF p_resources IS NULL OR cardinality(p_resources) NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION '% takes 1 to 1000 leases, got %', p_what,
            coalesce(cardinality(p_resources)::text, 'NULL') USING ERRCODE = 'PGL21';
    END IF;
    v_order := ARRAY(SELECT u.o::integer FROM unnest(p_resources) WITH ORDINALITY u(r, o)
                      ORDER BY u.r COLLATE "C");
    -- Sorted, a duplicate is next to its twin.
    FOR k IN 2..cardinality(v_order) LOOP
        IF p_resources[v_order[k]] = p_resources[v_order[k - 1]] THEN
            RAISE EXCEPTION '% names resource % more than once', p_what, p_resources[v_order[k]]
                USING ERRCODE = 'PGL21';
        END IF;
    END LOOP;
    RETURN v_order;
END $$;

-- The lease arguments of renew_many and release_many, per item: arrays of
-- one length, each item's owner id, generation and token hash as renew
-- checks them (the owner type's pattern by the per-item function, see
-- _batch_order). One statement when all are valid.
CREATE OR REPLACE FUNCTION @schema@._check_batch_leases(
    p_what text, p_resources text[], p_owner_types text[], p_owner_ids text[],
    p_generations bigint[], p_token_sha256s bytea[])
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_n integer := cardinality(p_resources);
    r record;
BEGIN
    IF cardinality(p_owner_types) IS DISTINCT FROM v_n
       OR cardinality(p_owner_ids) IS DISTINCT FROM v_n
       OR cardinality(p_generations) IS DISTINCT FROM v_n
       OR cardinality(p_token_sha256s) IS DISTINCT FROM v_n THEN
        RAISE EXCEPTION '% needs its five arrays of one length', p_what USING ERRCODE = 'PGL21';
    END IF;
    FOR r IN
        SELECT * FROM unnest(p_resources, p_owner_types, p_owner_ids, p_generations,
                             p_token_sha256s) u(rid, ot, oi, g, t)
         WHERE u.ot IS NULL OR u.oi IS NULL OR u.oi = '' OR octet_length(u.oi) > 256
            OR u.g IS NULL OR u.g < 0 OR u.t IS NULL OR octet_length(u.t) <> 32
         LIMIT 1
    LOOP
        PERFORM @schema@._check_lease_args(r.rid, r.ot, r.oi, r.g, r.t, NULL);
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION @schema@.claim_many(
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
    c record;
BEGIN
    IF cardinality(p_token_sha256s) IS DISTINCT FROM cardinality(p_resources) THEN
        RAISE EXCEPTION 'claim_many needs one token hash per resource' USING ERRCODE = 'PGL21';
    END IF;
    IF EXISTS (SELECT FROM unnest(p_token_sha256s) t WHERE t IS NULL OR octet_length(t) <> 32) THEN
        RAISE EXCEPTION 'lease token hash must be the 32-byte sha256 of the token'
            USING ERRCODE = 'PGL14';
    END IF;
    PERFORM @schema@._check_owner('owner', p_owner_type, p_owner_id);
    PERFORM @schema@._check_ttl('ttl', p_ttl);
    -- Every queue lock first, in id order, before anything is written (see the top).
    FOREACH i IN ARRAY v_order LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[i], hashtext('@schema@')));
    END LOOP;
    FOREACH i IN ARRAY v_order LOOP
        -- Once the transaction has an id, the entry point would only find
        -- that out and go the cold way itself: go there directly (one entry
        -- with SECURITY DEFINER and SET the less per item). Assignments, not
        -- SELECTs: a call in an assignment skips the executor start.
        IF pg_current_xact_id_if_assigned() IS NULL THEN
            c := @schema@.claim(p_resources[i], p_owner_type, p_owner_id, p_token_sha256s[i],
                                p_ttl, NULL, p_now);
        ELSE
            c := @schema@._claim_cold(p_resources[i], p_owner_type, p_owner_id,
                                      p_token_sha256s[i], p_ttl, NULL, p_now);
        END IF;
        ord := i;
        claimed := c.claimed;
        generation := c.generation;
        expires_at := c.expires_at;
        revision := c.revision;
        holder_type := c.holder_type;
        holder_id := c.holder_id;
        RETURN NEXT;
    END LOOP;
END $$;

-- renew_many and release_many: one row per item; error_code is NULL on
-- success, else the SQLSTATE a single call raised (PGL03 not current, PGL04
-- expired) with its message.
CREATE OR REPLACE FUNCTION @schema@.renew_many(
    p_resources text[], p_owner_types text[], p_owner_ids text[], p_generations bigint[],
    p_token_sha256s bytea[], p_ttl double precision, p_now timestamptz)
RETURNS TABLE (ord integer, expires_at timestamptz, revision bigint, error_code text,
               error_message text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_order integer[] := @schema@._batch_order('renew_many', p_resources);
    v_sure boolean[];
    i integer;
    c record;
BEGIN
    PERFORM @schema@._check_batch_leases('renew_many', p_resources, p_owner_types, p_owner_ids,
                                         p_generations, p_token_sha256s);
    PERFORM @schema@._check_ttl('ttl', p_ttl);
    FOREACH i IN ARRAY v_order LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[i], hashtext('@schema@')));
    END LOOP;
    -- Which items will succeed (see the top): current, and not running out
    -- within a second. A scalar subquery per item: one primary-key probe
    -- each, whatever the table's size or statistics.
    v_sure := ARRAY(
        SELECT coalesce((SELECT l.owner_type = u.ot AND l.owner_id = u.oi AND l.generation = u.g
                                AND l.token_sha256 = u.t
                                AND l.expires_at > CASE WHEN p_now IS NULL THEN clock_timestamp()
                                                        ELSE @schema@._clock_now(p_now) END
                                                   + interval '1 second'
                           FROM @schema@.leases l WHERE l.resource_id = u.rid), false)
          FROM unnest(p_resources, p_owner_types, p_owner_ids, p_generations, p_token_sha256s)
               WITH ORDINALITY u(rid, ot, oi, g, t, o)
         ORDER BY u.o);
    FOREACH i IN ARRAY v_order LOOP
        ord := i;
        error_code := NULL;
        error_message := NULL;
        IF v_sure[i] AND pg_current_xact_id_if_assigned() IS NOT NULL THEN
            -- The cold way directly, as in claim_many.
            c := @schema@._renew_cold(p_resources[i], p_owner_types[i], p_owner_ids[i],
                                      p_generations[i], p_token_sha256s[i], p_ttl, NULL, p_now);
            expires_at := c.expires_at;
            revision := c.revision;
        ELSIF v_sure[i] THEN
            c := @schema@.renew(p_resources[i], p_owner_types[i], p_owner_ids[i],
                                p_generations[i], p_token_sha256s[i], p_ttl, NULL, p_now);
            expires_at := c.expires_at;
            revision := c.revision;
        ELSE
            BEGIN
                c := @schema@.renew(p_resources[i], p_owner_types[i], p_owner_ids[i],
                                    p_generations[i], p_token_sha256s[i], p_ttl, NULL, p_now);
                expires_at := c.expires_at;
                revision := c.revision;
            EXCEPTION WHEN SQLSTATE 'PGL03' OR SQLSTATE 'PGL04' THEN
                expires_at := NULL;
                revision := NULL;
                error_code := SQLSTATE;
                error_message := SQLERRM;
            END;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION @schema@.release_many(
    p_resources text[], p_owner_types text[], p_owner_ids text[], p_generations bigint[],
    p_token_sha256s bytea[], p_now timestamptz)
RETURNS TABLE (ord integer, revision bigint, error_code text, error_message text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_order integer[] := @schema@._batch_order('release_many', p_resources);
    v_sure boolean[];
    i integer;
BEGIN
    PERFORM @schema@._check_batch_leases('release_many', p_resources, p_owner_types,
                                         p_owner_ids, p_generations, p_token_sha256s);
    FOREACH i IN ARRAY v_order LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[i], hashtext('@schema@')));
    END LOOP;
    -- Which items will succeed: current (a release needs no unexpired lease).
    v_sure := ARRAY(
        SELECT coalesce((SELECT l.owner_type = u.ot AND l.owner_id = u.oi AND l.generation = u.g
                                AND l.token_sha256 = u.t
                           FROM @schema@.leases l WHERE l.resource_id = u.rid), false)
          FROM unnest(p_resources, p_owner_types, p_owner_ids, p_generations, p_token_sha256s)
               WITH ORDINALITY u(rid, ot, oi, g, t, o)
         ORDER BY u.o);
    FOREACH i IN ARRAY v_order LOOP
        ord := i;
        error_code := NULL;
        error_message := NULL;
        IF v_sure[i] AND pg_current_xact_id_if_assigned() IS NOT NULL THEN
            -- The cold way directly, as in claim_many.
            revision := @schema@._release_cold(p_resources[i], p_owner_types[i],
                                               p_owner_ids[i], p_generations[i],
                                               p_token_sha256s[i], NULL, p_now);
        ELSIF v_sure[i] THEN
            revision := @schema@.release(p_resources[i], p_owner_types[i], p_owner_ids[i],
                                         p_generations[i], p_token_sha256s[i], NULL, p_now);
        ELSE
            BEGIN
                revision := @schema@.release(p_resources[i], p_owner_types[i], p_owner_ids[i],
                                             p_generations[i], p_token_sha256s[i], NULL, p_now);
            EXCEPTION WHEN SQLSTATE 'PGL03' OR SQLSTATE 'PGL04' THEN
                revision := NULL;
                error_code := SQLSTATE;
                error_message := SQLERRM;
            END;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;
