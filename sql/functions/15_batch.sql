-- Batches of lease operations: claim_many, renew_many, release_many.
-- Current definitions; see 10_core.sql for the conventions (pinned
-- search_path, qualified names, SECURITY DEFINER entry points, error codes).
-- Added here: PGL21 invalid batch (size, lengths, duplicates).
--
-- What a batch is: N single operations in one statement, so one round trip
-- and one commit, each lease with its own generation, its own revision and
-- its own event, exactly as N calls of claim / renew / release in
-- resource-id order would leave them. Results are per item, in input order,
-- not all-or-nothing: an item that is held by someone else (claim) or no
-- longer current or expired (renew, release) reports that and the others go
-- on. What refuses the whole batch, before it changes anything (the
-- statement fails and rolls back): bad arguments of any item, a duplicate
-- resource, an empty or too large batch, an unknown resource, and every
-- error a single call would raise that is not about the lease's currency
-- (time limits, a lost connection, ...).
--
-- Set-based (issue 24): after the queue locks, ONE statement does every item
-- that takes the common way, a grant of a free lease or of one whose expiry
-- is recorded (claim), an extension of a current, unexpired lease (renew),
-- the end of a current lease (release): one UPDATE of those lease rows
-- joined on the primary key to the items, bumping each row's revision
-- (coalesce(lease row's, the resource's frozen one) + 1, sql/0018), its
-- updated_at and last_xid, one INSERT of all their events, and the NOTIFY
-- election once; claim's refusals of live leases are read in the same
-- statement. The conditions are those of the single entry points' one
-- statements (10_core.sql), judged at one instant read after the last queue
-- lock. Every other item goes to the single functions' cold ways, one by
-- one, in id order, AFTER the statement, which judge it from the start and
-- word its refusal or error as a single call does: a claim of an expired
-- lease whose expiry is not recorded yet (the takeover writes
-- `lease.expired` first), an unknown or malformed resource (raises, so the
-- whole batch is refused), a renew or release of a lease that is not
-- current or (renew) expired. An item is done by the statement or by its
-- cold function, never both, and each resource is named once, so the
-- transaction writes no row twice and each resource's events are in
-- revision order (a takeover's two events come from one cold call).
--
-- Lock order and the order guard. Each resource's writers queue on its
-- advisory queue lock (see _lock_lease in 10_core.sql) before they write, so
-- that a resource's events are in (xid, id) order = revision order. A batch
-- first takes the queue lock of every item, in resource-id order (bytewise,
-- COLLATE "C"), in one statement that writes nothing, and only then writes:
--  * no deadlock between batches: every batch (and the heartbeat, which
--    never waits: SKIP LOCKED) takes its locks in that one order, and a
--    single call holds one resource's locks only;
--  * an advisory lock assigns no transaction id, so the transaction gets its
--    id in the set statement (its first write), after it holds every queue
--    lock it will need. Every earlier writer of those resources took the
--    queue lock too and had finished (committed or rolled back) before this
--    transaction got it, so its xid is smaller than the one this transaction
--    gets afterwards: the order guard (`previous xid > pg_current_xact_id()`)
--    cannot fire, and the statement does not read it, as claim's one
--    statement does not. The cold items after it check it as before. A
--    transaction that had an id before the batch (it wrote earlier) may have
--    taken it before an earlier writer's: for it the statement reads each
--    row's previous xid (last_xid, or the previous revision's event on a row
--    not moved yet) and refuses with 40001 as _bump does. (The legacy
--    reap_expired, kept for direct callers, writes without the queue lock;
--    against it the guard refuses in its own transaction, as against a
--    single call.)
--  * row locks: the statement's UPDATE takes the row locks of the items it
--    changes, in id order as it happens (the items drive a nested loop of
--    primary-key probes in the order of v_order), but it could take them in
--    any order without a deadlock: every writer that WAITS for a lease row's
--    lock (claim, renew, release, mutate_begin, revoke_lease, claim_fair,
--    other batches) holds that resource's queue lock first, and this batch
--    holds the queue locks of all its rows, so none of them holds one of its
--    rows. The others never wait (heartbeat, reap_next, reap_expired and
--    move_revisions_chunk lock with SKIP LOCKED); a heartbeat holding a row
--    for an instant is waited for, and READ COMMITTED judges that row again
--    as the heartbeat left it. (A heartbeat called inside a transaction that
--    then waits for one of this batch's queue locks would close a cycle;
--    PostgreSQL's deadlock detector ends one of the two, as for single
--    calls.)
--
-- Per-item errors without subtransactions on the way that succeeds. A
-- PL/pgSQL EXCEPTION block is a subtransaction, and a subtransaction that
-- writes holds a subxid until the top transaction ends; more than 64 of them
-- overflow the backend's subxid cache, and every snapshot in the cluster
-- then looks them up in pg_subtrans while the batch runs. Every item that
-- succeeds is done by the set statement, outside any block. A renew or
-- release item the statement left was not current, or (renew) had expired,
-- at the statement's instant; under the queue locks neither can change
-- (only writers that queue change the owner, generation and token; the
-- heartbeat only extends an unexpired lease; time only runs on), so its cold
-- function fails in its block, having written nothing, and the block rolls
-- back: an aborted subtransaction leaves no subxid behind (its id, if the
-- cold renew's row lock took one, leaves the cache at the rollback). Claims
-- never run in a block: a claim of a held lease is a result, not an error.
--
-- Plans that cannot degrade (as heartbeat in 30_fleet.sql): the statements
-- reach `leases` (and `resources`, for a row not moved yet) only by primary
-- key, driven by the items; the function's SET clauses leave the planner no
-- hash or merge join and no sequential scan to pick by a wrong estimate, so a
-- batch of 1000 costs 1000 index probes whatever the table's size or
-- statistics.
--
-- Inputs. The shape (size, lengths, duplicates), the owner (claim), the TTL
-- and token hashes are checked up front as before. Resource ids and (renew,
-- release) owners are not matched against their patterns on the way that
-- succeeds (one such regex costs about 9 us per id, PG 18): an item the set
-- statement matched names a lease row and owner that a checked claim wrote.
-- An item it did not match goes to its cold function, which checks every
-- argument and raises PGL12 / PGL13 / PGL01 as before, which refuses the
-- whole batch (the statement's writes roll back with it). The first such
-- item in id order raises, as when each item ran its single call in id
-- order.
--
-- Cost: see bench/RESULTS.md (batch_cost.py; set-based batches, 2026-12-06).
--
-- The largest batch is 1000 items (MAX_BATCH in pglease/batches.py): the
-- batch holds all its locks until it commits, and the client's deadline
-- bounds it like any single call.

-- The items' positions in resource-id order: at most 1000 items, none named
-- twice. The ids themselves (and the owners, below) are vouched for by the
-- lease rows the set statement matches, or checked by the cold function of
-- an item it did not match, which raises PGL12 (PGL13) for a malformed one
-- and fails the whole statement (see Inputs at the top). They are not matched
-- against their patterns here: with its bounded repetition ({0,62}) one such
-- regex match costs about 9 us per id (measured, PG 18), near a tenth of what
-- a set-based item costs.
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
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_order integer[] := @schema@._batch_order('claim_many', p_resources);
    v_had_xid boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
    v_now timestamptz;
    v_k integer[];
    v_claimed boolean[];
    v_gen bigint[];
    v_exp timestamptz[];
    v_rev bigint[];
    v_ht text[];
    v_hi text[];
    v_rest integer[];
    v_late text;
    v_woke boolean;
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
    -- Every queue lock first, in id order, in one statement that writes
    -- nothing (see the top).
    PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[q.k], hashtext('@schema@')))
       FROM unnest(v_order) q(k);
    -- The instant every item is judged at (after the last queue wait). A
    -- malformed first id is refused before a refused caller's time, as the
    -- first single call would.
    IF p_now IS NOT NULL THEN
        PERFORM @schema@._check_resource_id(p_resources[v_order[1]]);
    END IF;
    v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE @schema@._clock_now(p_now) END;
    -- The grants of claim's one statement, set-based; the refusals of live
    -- (or revoked) leases from the same snapshot, without a lock; the items
    -- left over (`v_rest`, in id order) go the cold way below.
    WITH g AS (
        UPDATE @schema@.leases x
           SET generation = x.generation + 1, owner_type = p_owner_type,
               owner_id = p_owner_id, token_sha256 = u.t, acquired_at = v_now,
               heartbeat_at = v_now, expires_at = v_now + make_interval(secs => p_ttl),
               revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                 WHERE r.id = x.resource_id)) + 1,
               updated_at = v_now, last_xid = pg_current_xact_id()
          FROM (SELECT q.k, q.n, p_resources[q.k] AS rid, p_token_sha256s[q.k] AS t
                  FROM unnest(v_order) WITH ORDINALITY q(k, n)) u
         WHERE x.resource_id = u.rid
           AND (x.owner_id IS NULL
                OR (x.expires_at <= v_now AND x.expired_generation IS NOT DISTINCT FROM x.generation))
           AND (x.revoked_until IS NULL OR x.revoked_until <= v_now)
        RETURNING u.k, u.n, x.resource_id, x.generation, x.expires_at, x.revision,
                  -- The order guard, only for a transaction that had an id
                  -- before the batch (see the top); the subqueries read the
                  -- row as it was before this statement.
                  CASE WHEN v_had_xid THEN
                      coalesce((SELECT o.last_xid FROM @schema@.leases o
                                 WHERE o.resource_id = x.resource_id),
                               (SELECT ev.xid FROM @schema@.events ev
                                 WHERE ev.resource_id = x.resource_id
                                   AND ev.revision = x.revision - 1)) END AS prev_xid),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT g.resource_id, g.revision, 'lease.claimed', p_owner_type, p_owner_id,
               g.generation, g.expires_at, v_now FROM g ORDER BY g.n
        RETURNING events.id),
    res AS (
        SELECT g.k, true AS granted, g.generation, g.expires_at, g.revision,
               p_owner_type AS ht, p_owner_id AS hi FROM g
        UNION ALL
        SELECT q.k, false, l.generation,
               CASE WHEN l.owner_id IS NULL THEN l.revoked_until ELSE l.expires_at END,
               coalesce(l.revision, (SELECT s.revision FROM @schema@.resources s
                                      WHERE s.id = l.resource_id)),
               l.owner_type, l.owner_id
          FROM unnest(v_order) q(k)
          JOIN @schema@.leases l ON l.resource_id = p_resources[q.k]
         WHERE ((l.owner_id IS NOT NULL AND l.expires_at > v_now) OR l.revoked_until > v_now))
    SELECT array_agg(res.k), array_agg(res.granted), array_agg(res.generation),
           array_agg(res.expires_at), array_agg(res.revision), array_agg(res.ht),
           array_agg(res.hi),
           (SELECT array_agg(q.k ORDER BY q.n) FROM unnest(v_order) WITH ORDINALITY q(k, n)
             WHERE q.k NOT IN (SELECT r2.k FROM res r2)),
           (SELECT format('revision %s of %s would be ordered before revision %s', g.revision,
                          g.resource_id, g.revision - 1)
              FROM g WHERE g.prev_xid > pg_current_xact_id() ORDER BY g.n LIMIT 1),
           -- The wake-up election of _bump, after the event rows.
           CASE WHEN (SELECT count(*) FROM e) = 0 THEN false
                WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                          hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                ELSE false END
      INTO v_k, v_claimed, v_gen, v_exp, v_rev, v_ht, v_hi, v_rest, v_late, v_woke
      FROM res;
    IF v_late IS NOT NULL THEN
        RAISE EXCEPTION 'event order: %', v_late
            USING ERRCODE = '40001',
                  HINT = 'lock the lease row before the transaction writes anything else';
    END IF;
    -- The rest, one cold claim each, in id order.
    FOREACH i IN ARRAY coalesce(v_rest, '{}') LOOP
        c := @schema@._claim_cold(p_resources[i], p_owner_type, p_owner_id, p_token_sha256s[i],
                                  p_ttl, NULL, p_now);
        v_k := v_k || i;
        v_claimed := v_claimed || c.claimed;
        v_gen := v_gen || c.generation;
        v_exp := v_exp || c.expires_at;
        v_rev := v_rev || c.revision;
        v_ht := v_ht || c.holder_type;
        v_hi := v_hi || c.holder_id;
    END LOOP;
    RETURN QUERY SELECT * FROM unnest(v_k, v_claimed, v_gen, v_exp, v_rev, v_ht, v_hi)
                  ORDER BY 1;
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
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_order integer[] := @schema@._batch_order('renew_many', p_resources);
    v_had_xid boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
    v_now timestamptz;
    v_k integer[];
    v_exp timestamptz[];
    v_rev bigint[];
    v_code text[];
    v_msg text[];
    v_rest integer[];
    v_late text;
    v_woke boolean;
    i integer;
    c record;
BEGIN
    PERFORM @schema@._check_batch_leases('renew_many', p_resources, p_owner_types, p_owner_ids,
                                         p_generations, p_token_sha256s);
    PERFORM @schema@._check_ttl('ttl', p_ttl);
    PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[q.k], hashtext('@schema@')))
       FROM unnest(v_order) q(k);
    v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE @schema@._clock_now(p_now) END;
    -- renew's one statement, set-based: current and unexpired at v_now.
    WITH g AS (
        UPDATE @schema@.leases x
           SET heartbeat_at = v_now, expires_at = v_now + make_interval(secs => p_ttl),
               revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                 WHERE r.id = x.resource_id)) + 1,
               updated_at = v_now, last_xid = pg_current_xact_id()
          FROM (SELECT q.k, q.n, p_resources[q.k] AS rid, p_owner_types[q.k] AS ot,
                       p_owner_ids[q.k] AS oi, p_generations[q.k] AS gen,
                       p_token_sha256s[q.k] AS t
                  FROM unnest(v_order) WITH ORDINALITY q(k, n)) u
         WHERE x.resource_id = u.rid AND x.owner_id = u.oi AND x.owner_type = u.ot
           AND x.generation = u.gen AND x.token_sha256 = u.t AND x.expires_at > v_now
        RETURNING u.k, u.n, x.resource_id, u.ot, u.oi, u.gen, x.expires_at, x.revision,
                  CASE WHEN v_had_xid THEN
                      coalesce((SELECT o.last_xid FROM @schema@.leases o
                                 WHERE o.resource_id = x.resource_id),
                               (SELECT ev.xid FROM @schema@.events ev
                                 WHERE ev.resource_id = x.resource_id
                                   AND ev.revision = x.revision - 1)) END AS prev_xid),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT g.resource_id, g.revision, 'lease.renewed', g.ot, g.oi, g.gen, g.expires_at,
               v_now FROM g ORDER BY g.n
        RETURNING events.id)
    SELECT array_agg(g.k), array_agg(g.expires_at), array_agg(g.revision),
           (SELECT array_agg(q.k ORDER BY q.n) FROM unnest(v_order) WITH ORDINALITY q(k, n)
             WHERE q.k NOT IN (SELECT g2.k FROM g g2)),
           (SELECT format('revision %s of %s would be ordered before revision %s', g3.revision,
                          g3.resource_id, g3.revision - 1)
              FROM g g3 WHERE g3.prev_xid > pg_current_xact_id() ORDER BY g3.n LIMIT 1),
           CASE WHEN (SELECT count(*) FROM e) = 0 THEN false
                WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                          hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                ELSE false END
      INTO v_k, v_exp, v_rev, v_rest, v_late, v_woke
      FROM g;
    IF v_late IS NOT NULL THEN
        RAISE EXCEPTION 'event order: %', v_late
            USING ERRCODE = '40001',
                  HINT = 'lock the lease row before the transaction writes anything else';
    END IF;
    v_code := array_fill(NULL::text, ARRAY[coalesce(cardinality(v_k), 0)]);
    v_msg := v_code;
    -- The rest, in id order: not current or expired at v_now (or unknown,
    -- malformed: those raise). Each cold call fails in its block, which rolls
    -- back (see the top); the block catches only the currency.
    FOREACH i IN ARRAY coalesce(v_rest, '{}') LOOP
        v_k := v_k || i;
        BEGIN
            c := @schema@._renew_cold(p_resources[i], p_owner_types[i], p_owner_ids[i],
                                      p_generations[i], p_token_sha256s[i], p_ttl, NULL, p_now);
            v_exp := v_exp || c.expires_at;
            v_rev := v_rev || c.revision;
            v_code := v_code || NULL::text;
            v_msg := v_msg || NULL::text;
        EXCEPTION WHEN SQLSTATE 'PGL03' OR SQLSTATE 'PGL04' THEN
            v_exp := v_exp || NULL::timestamptz;
            v_rev := v_rev || NULL::bigint;
            v_code := v_code || SQLSTATE;
            v_msg := v_msg || SQLERRM;
        END;
    END LOOP;
    RETURN QUERY SELECT * FROM unnest(v_k, v_exp, v_rev, v_code, v_msg) ORDER BY 1;
END $$;

CREATE OR REPLACE FUNCTION @schema@.release_many(
    p_resources text[], p_owner_types text[], p_owner_ids text[], p_generations bigint[],
    p_token_sha256s bytea[], p_now timestamptz)
RETURNS TABLE (ord integer, revision bigint, error_code text, error_message text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off AS $$
#variable_conflict use_column
DECLARE
    v_order integer[] := @schema@._batch_order('release_many', p_resources);
    v_had_xid boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
    v_now timestamptz;
    v_k integer[];
    v_rev bigint[];
    v_code text[];
    v_msg text[];
    v_rest integer[];
    v_late text;
    v_woke boolean;
    i integer;
BEGIN
    PERFORM @schema@._check_batch_leases('release_many', p_resources, p_owner_types,
                                         p_owner_ids, p_generations, p_token_sha256s);
    PERFORM pg_advisory_xact_lock(hashtextextended(p_resources[q.k], hashtext('@schema@')))
       FROM unnest(v_order) q(k);
    v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE @schema@._clock_now(p_now) END;
    -- release's one statement, set-based: current (expired or not).
    WITH g AS (
        UPDATE @schema@.leases x
           SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL, expires_at = NULL,
               heartbeat_at = v_now,
               revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                 WHERE r.id = x.resource_id)) + 1,
               updated_at = v_now, last_xid = pg_current_xact_id()
          FROM (SELECT q.k, q.n, p_resources[q.k] AS rid, p_owner_types[q.k] AS ot,
                       p_owner_ids[q.k] AS oi, p_generations[q.k] AS gen,
                       p_token_sha256s[q.k] AS t
                  FROM unnest(v_order) WITH ORDINALITY q(k, n)) u
         WHERE x.resource_id = u.rid AND x.owner_id = u.oi AND x.owner_type = u.ot
           AND x.generation = u.gen AND x.token_sha256 = u.t
        RETURNING u.k, u.n, x.resource_id, u.ot, u.oi, u.gen, x.revision,
                  CASE WHEN v_had_xid THEN
                      coalesce((SELECT o.last_xid FROM @schema@.leases o
                                 WHERE o.resource_id = x.resource_id),
                               (SELECT ev.xid FROM @schema@.events ev
                                 WHERE ev.resource_id = x.resource_id
                                   AND ev.revision = x.revision - 1)) END AS prev_xid),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT g.resource_id, g.revision, 'lease.released', g.ot, g.oi, g.gen,
               NULL::timestamptz, v_now FROM g ORDER BY g.n
        RETURNING events.id)
    SELECT array_agg(g.k), array_agg(g.revision),
           (SELECT array_agg(q.k ORDER BY q.n) FROM unnest(v_order) WITH ORDINALITY q(k, n)
             WHERE q.k NOT IN (SELECT g2.k FROM g g2)),
           (SELECT format('revision %s of %s would be ordered before revision %s', g3.revision,
                          g3.resource_id, g3.revision - 1)
              FROM g g3 WHERE g3.prev_xid > pg_current_xact_id() ORDER BY g3.n LIMIT 1),
           CASE WHEN (SELECT count(*) FROM e) = 0 THEN false
                WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                          hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                ELSE false END
      INTO v_k, v_rev, v_rest, v_late, v_woke
      FROM g;
    IF v_late IS NOT NULL THEN
        RAISE EXCEPTION 'event order: %', v_late
            USING ERRCODE = '40001',
                  HINT = 'lock the lease row before the transaction writes anything else';
    END IF;
    v_code := array_fill(NULL::text, ARRAY[coalesce(cardinality(v_k), 0)]);
    v_msg := v_code;
    -- The rest, in id order: not current at v_now (or unknown, malformed:
    -- those raise), each failing in its block having written nothing.
    FOREACH i IN ARRAY coalesce(v_rest, '{}') LOOP
        v_k := v_k || i;
        BEGIN
            v_rev := v_rev || @schema@._release_cold(p_resources[i], p_owner_types[i],
                                                     p_owner_ids[i], p_generations[i],
                                                     p_token_sha256s[i], NULL, p_now);
            v_code := v_code || NULL::text;
            v_msg := v_msg || NULL::text;
        EXCEPTION WHEN SQLSTATE 'PGL03' OR SQLSTATE 'PGL04' THEN
            v_rev := v_rev || NULL::bigint;
            v_code := v_code || SQLSTATE;
            v_msg := v_msg || SQLERRM;
        END;
    END LOOP;
    RETURN QUERY SELECT * FROM unnest(v_k, v_rev, v_code, v_msg) ORDER BY 1;
END $$;
