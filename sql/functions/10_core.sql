-- pglease core functions: the current definitions (applied after the ordered
-- migrations with CREATE OR REPLACE; see migrations.py). `@schema@` is the
-- configured schema name.
--
-- Every function pins `search_path` to pg_catalog (then pg_temp, last, so a
-- temporary object can never shadow anything) and names every pglease object
-- with its schema: a caller's own `clock_timestamp()` or operator earlier in
-- its search_path is never what runs here. Entry points are SECURITY DEFINER:
-- they run with the schema owner's rights, so a client role needs EXECUTE on
-- them and no write privilege on any table (see the role model in README).
--
-- Error codes (class "PL"), mapped to Python classes in pglease/postgres/_core.py:
--   PGL01 unknown resource          PGL02 stale revision (DETAIL = actual)
--   PGL03 lease not current         PGL04 lease expired
--   PGL05 resource is leased        PGL06 payload hash conflict
--   PGL10 test clock refused        PGL11 invalid TTL
--   PGL12 invalid resource id       PGL13 invalid owner or actor
--   PGL14 invalid token hash        PGL15 invalid revision or generation
--   PGL16 invalid resource type     PGL17 invalid key
--   PGL18 invalid event type        PGL19 invalid payload
--   PGL20 other invalid argument

-- The time a call judges expiry by: the database clock, read now (so after
-- any lock wait of the caller). A caller's `p_now` is honoured only where the
-- schema owner switched the test clock on (settings.test_clock); anywhere
-- else it is refused, never silently replaced, so a test or a skewed host
-- learns that its clock is not the one that counts.
CREATE OR REPLACE FUNCTION @schema@._clock_now(p_now timestamptz)
RETURNS timestamptz LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF p_now IS NULL THEN
        RETURN clock_timestamp();
    END IF;
    IF NOT coalesce((SELECT s.test_clock FROM @schema@.settings s), false) THEN
        RAISE EXCEPTION 'a caller-supplied time (now=%) is refused: schema @schema@ judges expiry by the database clock only', p_now
            USING ERRCODE = 'PGL10',
                  HINT = 'omit now=; only the schema owner can switch the test clock on, for test schemas';
    END IF;
    RETURN p_now;
END $$;

-- Input checks shared by the entry points; the same rules as pglease/validation.py.
CREATE OR REPLACE FUNCTION @schema@._check_resource_id(p_resource text)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_]{0,62}-[0-9a-f]{40}$' THEN
        RAISE EXCEPTION 'resource id % is not of the form TYPE-<40 hex digits>',
            coalesce(quote_literal(left(p_resource, 120)), 'NULL') USING ERRCODE = 'PGL12';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION @schema@._check_owner(p_what text, p_type text, p_id text)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF p_type IS NULL OR p_type !~ '^[a-z][a-z0-9_]{0,62}$' THEN
        RAISE EXCEPTION '% type % must match [a-z][a-z0-9_]{0,62}', p_what,
            coalesce(quote_literal(left(p_type, 120)), 'NULL') USING ERRCODE = 'PGL13';
    END IF;
    IF p_id IS NULL OR p_id = '' OR octet_length(p_id) > 256 THEN
        RAISE EXCEPTION '% id must be 1 to 256 bytes, got %', p_what,
            coalesce(octet_length(p_id)::text || ' bytes', 'NULL') USING ERRCODE = 'PGL13';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION @schema@._check_ttl(p_what text, p_ttl double precision)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- NaN sorts above every number in PostgreSQL, so BETWEEN refuses it too.
    IF p_ttl IS NULL OR NOT (p_ttl BETWEEN 0.001 AND 604800) THEN
        RAISE EXCEPTION '% must be between 0.001 and 604800 seconds, got %', p_what,
            coalesce(p_ttl::text, 'NULL') USING ERRCODE = 'PGL11';
    END IF;
END $$;

-- The lease arguments of renew, release and a leased mutation.
CREATE OR REPLACE FUNCTION @schema@._check_lease_args(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_expected_revision bigint)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM @schema@._check_resource_id(p_resource);
    PERFORM @schema@._check_owner('owner', p_owner_type, p_owner_id);
    IF p_generation IS NULL OR p_generation < 0 THEN
        RAISE EXCEPTION 'generation must be >= 0, got %', coalesce(p_generation::text, 'NULL')
            USING ERRCODE = 'PGL15';
    END IF;
    IF p_token_sha256 IS NULL OR octet_length(p_token_sha256) <> 32 THEN
        RAISE EXCEPTION 'lease token hash must be the 32-byte sha256 of the token'
            USING ERRCODE = 'PGL14';
    END IF;
    IF p_expected_revision < 0 THEN
        RAISE EXCEPTION 'expected revision must be >= 0, got %', p_expected_revision
            USING ERRCODE = 'PGL15';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION @schema@.ensure_resource(p_type text, p_key text)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_id text;
    v_at timestamptz;
BEGIN
    IF p_type IS NULL OR p_type !~ '^[a-z][a-z0-9_]{0,62}$' THEN
        RAISE EXCEPTION 'resource type % must match [a-z][a-z0-9_]{0,62}',
            coalesce(quote_literal(left(p_type, 120)), 'NULL') USING ERRCODE = 'PGL16';
    END IF;
    IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 1024 THEN
        RAISE EXCEPTION 'resource key must be 1 to 1024 bytes, got %',
            coalesce(octet_length(p_key)::text || ' bytes', 'NULL') USING ERRCODE = 'PGL17';
    END IF;
    v_id := p_type || '-' || left(encode(sha256(
        convert_to(p_type, 'UTF8') || '\x00'::bytea || convert_to(p_key, 'UTF8')), 'hex'), 40);
    INSERT INTO @schema@.resources (id, type, key) VALUES (v_id, p_type, p_key)
        ON CONFLICT DO NOTHING RETURNING updated_at INTO v_at;
    IF FOUND THEN
        -- The revision lives in the lease row (sql/0018): revision 0, at the
        -- resource's creation, so a new row never needs moving.
        INSERT INTO @schema@.leases (resource_id, revision, updated_at) VALUES (v_id, 0, v_at);
    END IF;
    RETURN v_id;
END $$;

-- Move the revision of up to p_limit lease rows not written since migration
-- 0018 into the lease row, in resource-id order after the position kept in
-- lease_row_moves; returns how many rows it looked at (0: nothing is left).
-- One call is one short transaction (the migration runner drives the calls,
-- see pglease/_migrate_async.py): it locks only the rows it moves, with SKIP
-- LOCKED, so it never waits for a writer, and a writer waits for it at most
-- one chunk. A skipped row is moved by its writer (every writer sets the
-- revision) or stays NULL, which readers coalesce: correct either way.
-- `last_xid` is left NULL: the order guard looks a moved row's previous
-- event up until its next write. The schema owner's job: no role is granted it.
CREATE OR REPLACE FUNCTION @schema@.move_revisions_chunk(p_limit integer)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_after text;
    v_last text;
    v_seen integer;
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'limit must be between 1 and 100000, got %', coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'PGL20';
    END IF;
    -- Locked: two runners at once take turns instead of moving the same rows.
    SELECT m.after_resource INTO v_after FROM @schema@.lease_row_moves m
     WHERE NOT m.done FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT count(*)::integer, max(c.resource_id) INTO v_seen, v_last
      FROM (SELECT x.resource_id FROM @schema@.leases x WHERE x.resource_id > v_after
             ORDER BY x.resource_id LIMIT p_limit) c;
    IF v_seen = 0 THEN
        UPDATE @schema@.lease_row_moves SET done = true;
        RETURN 0;
    END IF;
    UPDATE @schema@.leases l SET revision = r.revision, updated_at = r.updated_at
      FROM @schema@.resources r
     WHERE l.resource_id IN (SELECT x.resource_id FROM @schema@.leases x
                              WHERE x.resource_id > v_after AND x.resource_id <= v_last
                                AND x.revision IS NULL
                              ORDER BY x.resource_id FOR UPDATE SKIP LOCKED)
       AND r.id = l.resource_id AND l.revision IS NULL;
    UPDATE @schema@.lease_row_moves SET after_resource = v_last;
    RETURN v_seen;
END $$;

-- Lock the lease row first in every writing function: one lock order, no deadlocks.
--
-- Before the row lock, queue on a transaction-scoped advisory lock keyed by the
-- resource. An advisory lock needs no transaction id, while a row lock takes one
-- before it waits, and row-lock waiters are not served strictly in arrival
-- order. Queueing first means a resource's writers obtain their xids in the
-- order they write, so (xid, id) order -- the order readers consume the log in --
-- is also revision order for every resource.
--
-- The key is one bigint seeded by the schema name: advisory locks are
-- database-wide, so two schemas with the same (type, key), hence the same
-- resource id, must not queue on each other. (A hash collision only makes two
-- resources queue together; the one-bigint key space never meets the two-int
-- keys of the NOTIFY election in _bump.)
CREATE OR REPLACE FUNCTION @schema@._lock_lease(p_resource text)
RETURNS @schema@.leases LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    l @schema@.leases%ROWTYPE;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_resource, hashtext('@schema@')));
    SELECT * INTO l FROM @schema@.leases WHERE resource_id = p_resource FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown resource %', p_resource USING ERRCODE = 'PGL01';
    END IF;
    RETURN l;
END $$;

CREATE OR REPLACE FUNCTION @schema@._check_revision(p_resource text, p_expected_revision bigint)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_rev bigint;
BEGIN
    IF p_expected_revision IS NOT NULL THEN
        SELECT coalesce(l.revision, (SELECT r.revision FROM @schema@.resources r
                                      WHERE r.id = l.resource_id))
          INTO v_rev FROM @schema@.leases l WHERE l.resource_id = p_resource;
        IF v_rev <> p_expected_revision THEN
            RAISE EXCEPTION 'resource % is at revision %, expected %',
                p_resource, v_rev, p_expected_revision
                USING ERRCODE = 'PGL02', DETAIL = v_rev::text;
        END IF;
    END IF;
END $$;

CREATE OR REPLACE FUNCTION @schema@._check_current(
    l @schema@.leases, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_why text;
BEGIN
    IF l.owner_id IS NULL OR l.owner_type <> p_owner_type OR l.owner_id <> p_owner_id
       OR l.generation <> p_generation OR l.token_sha256 <> p_token_sha256 THEN
        -- Name the reason: a caller with a wrong token or owner must not be
        -- told its generation was superseded when it is the current one.
        -- Same wording as the SQLite store (pglease/sqlite/_ops.py).
        v_why := CASE
            WHEN l.generation > p_generation THEN
                format('superseded by generation %s', l.generation)
            WHEN l.generation < p_generation THEN
                format('there is no such generation yet (current generation %s)', l.generation)
            WHEN l.owner_id IS NULL THEN 'it was released'
            WHEN l.owner_type <> p_owner_type OR l.owner_id <> p_owner_id THEN
                format('the owner does not match (it is held by %s:%s)', l.owner_type, l.owner_id)
            ELSE 'the token does not match the holder''s' END;
        RAISE EXCEPTION 'lease generation % of %:% on % is no longer current: %',
            p_generation, p_owner_type, p_owner_id, l.resource_id, v_why
            USING ERRCODE = 'PGL03';
    END IF;
END $$;

-- Bump the revision and append the event; then the order guard and the
-- coalesced wake-up. The caller holds the lease row's lock.
--  * revision: kept in the lease row since sql/0018 (one row update per
--    operation, not a lease and a resource update); a row not written since
--    then continues from the resource's frozen revision.
--  * order guard: readers deliver events in (xid, id) order, so a resource's
--    revision n+1 must not carry a smaller xid than revision n. That can only
--    happen to a transaction that took its xid before waiting for the lease
--    row lock (several writes in one transaction); it is refused as a
--    serialization failure, which clients retry. Revision n's xid is the lease
--    row's last_xid (each event writer sets it); NULL on a row not written
--    since the migration, whose previous event is looked up instead: a
--    transaction that took its xid before the migration may write after it.
--  * wake-up: every writer takes key 2 (shared, to its commit) BEFORE it
--    tries key 1, so a watcher's probe (watch_read) sees every writer that
--    may be relying on someone else's NOTIFY, even one whose xid is above the
--    probe's snapshot xmax. Key 1 elects the one in-flight writer that
--    notifies (NOTIFY takes a cluster-wide lock at commit). A writer that
--    cannot get key 2 (a probe holds it for an instant) notifies itself. See
--    the proof in pglease/watch/__init__.py.
CREATE OR REPLACE FUNCTION @schema@._bump(
    p_resource text, p_now timestamptz, p_type text, p_actor_type text, p_actor_id text,
    p_generation bigint, p_expires_at timestamptz, p_payload_sha256 bytea,
    OUT revision bigint, OUT event_id bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_prev xid8;
BEGIN
    -- One statement: the bump, the append, and the previous revision's xid
    -- for the order guard (each statement of a PL/pgSQL body costs an
    -- executor start and a snapshot; see bench/RESULTS.md, server cost). The
    -- RETURNING subquery reads the row as it was before this statement (a
    -- statement does not see its own changes).
    WITH u AS (
        UPDATE @schema@.leases x
           SET revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                 WHERE r.id = x.resource_id)) + 1,
               updated_at = p_now, last_xid = pg_current_xact_id()
         WHERE x.resource_id = p_resource
        RETURNING x.revision,
                  (SELECT o.last_xid FROM @schema@.leases o WHERE o.resource_id = p_resource)
                      AS prev_xid),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, payload_sha256,
                                     created_at)
        SELECT p_resource, u.revision, p_type, p_actor_type, p_actor_id,
               p_generation, p_expires_at, p_payload_sha256, p_now FROM u
        RETURNING events.id)
    SELECT u.revision, e.id,
           coalesce(u.prev_xid,
                    (SELECT x.xid FROM @schema@.events x
                      WHERE x.resource_id = p_resource AND x.revision = u.revision - 1))
      INTO _bump.revision, _bump.event_id, v_prev FROM u, e;
    IF v_prev > pg_current_xact_id() THEN
        RAISE EXCEPTION 'event order: revision % of % would be ordered before revision %',
            _bump.revision, p_resource, _bump.revision - 1
            USING ERRCODE = '40001',
                  HINT = 'lock the lease row before the transaction writes anything else';
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@'))
       OR pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@')) THEN
        PERFORM pg_notify(left('pglease_@schema@', 63), '');
    END IF;
END $$;

-- _bump, and in the same UPDATE the lease's own columns as `p_lease` has
-- them: for a cold way that changes the lease and writes an event, one
-- update of the lease row instead of its own UPDATE then _bump's (two heap
-- updates and WAL records of one row in one transaction). The revision,
-- updated_at and last_xid of `p_lease` are ignored: they are _bump's.
CREATE OR REPLACE FUNCTION @schema@._bump_lease(
    p_lease @schema@.leases, p_now timestamptz, p_type text, p_actor_type text,
    p_actor_id text, p_generation bigint, p_expires_at timestamptz,
    OUT revision bigint, OUT event_id bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_prev xid8;
BEGIN
    -- As _bump's statement, with the lease columns set too.
    WITH u AS (
        UPDATE @schema@.leases x
           SET generation = p_lease.generation, owner_type = p_lease.owner_type,
               owner_id = p_lease.owner_id, token_sha256 = p_lease.token_sha256,
               acquired_at = p_lease.acquired_at, heartbeat_at = p_lease.heartbeat_at,
               expires_at = p_lease.expires_at, expired_generation = p_lease.expired_generation,
               revoked_until = p_lease.revoked_until,
               revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                 WHERE r.id = x.resource_id)) + 1,
               updated_at = p_now, last_xid = pg_current_xact_id()
         WHERE x.resource_id = p_lease.resource_id
        RETURNING x.revision,
                  (SELECT o.last_xid FROM @schema@.leases o
                    WHERE o.resource_id = p_lease.resource_id) AS prev_xid),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT p_lease.resource_id, u.revision, p_type, p_actor_type, p_actor_id,
               p_generation, p_expires_at, p_now FROM u
        RETURNING events.id)
    SELECT u.revision, e.id,
           coalesce(u.prev_xid,
                    (SELECT x.xid FROM @schema@.events x
                      WHERE x.resource_id = p_lease.resource_id AND x.revision = u.revision - 1))
      INTO _bump_lease.revision, _bump_lease.event_id, v_prev FROM u, e;
    IF v_prev > pg_current_xact_id() THEN
        RAISE EXCEPTION 'event order: revision % of % would be ordered before revision %',
            _bump_lease.revision, p_lease.resource_id, _bump_lease.revision - 1
            USING ERRCODE = '40001',
                  HINT = 'lock the lease row before the transaction writes anything else';
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@'))
       OR pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@')) THEN
        PERFORM pg_notify(left('pglease_@schema@', 63), '');
    END IF;
END $$;

-- The cold ways of claim, renew and release (the entry points below run
-- these when their one statement matched no row, or cannot be used): the
-- complete checks and judgements, statement by statement, which word every
-- refusal and error. Internal: no role is granted them.
--
-- Claim: take the lease if it is free or its holder's TTL ran out. Taking over a
-- holder whose expiry the reaper has not recorded yet first writes that
-- generation's `lease.expired` (revision n+1), then `lease.claimed` (n+2),
-- under the one row lock.
CREATE OR REPLACE FUNCTION @schema@._claim_cold(
    p_resource text, p_owner_type text, p_owner_id text, p_token_sha256 bytea,
    p_ttl double precision, p_expected_revision bigint, p_now timestamptz,
    OUT claimed boolean, OUT generation bigint, OUT expires_at timestamptz,
    OUT revision bigint, OUT holder_type text, OUT holder_id text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
    v_prev xid8;
BEGIN
    -- The argument checks in one expression; only when it fails do the
    -- checking functions run, to raise the first error as they word it. (A
    -- call of a function with a SET clause costs about as much as a
    -- statement, and valid calls are nearly all calls.)
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_]{0,62}-[0-9a-f]{40}$'
       OR p_owner_type IS NULL OR p_owner_type !~ '^[a-z][a-z0-9_]{0,62}$'
       OR p_owner_id IS NULL OR p_owner_id = '' OR octet_length(p_owner_id) > 256
       OR p_ttl IS NULL OR NOT (p_ttl BETWEEN 0.001 AND 604800)
       OR p_token_sha256 IS NULL OR octet_length(p_token_sha256) <> 32
       OR p_expected_revision < 0 THEN
        PERFORM @schema@._check_resource_id(p_resource);
        PERFORM @schema@._check_owner('owner', p_owner_type, p_owner_id);
        PERFORM @schema@._check_ttl('ttl', p_ttl);
        IF p_token_sha256 IS NULL OR octet_length(p_token_sha256) <> 32 THEN
            RAISE EXCEPTION 'lease token hash must be the 32-byte sha256 of the token'
                USING ERRCODE = 'PGL14';
        END IF;
        IF p_expected_revision < 0 THEN
            RAISE EXCEPTION 'expected revision must be >= 0, got %', p_expected_revision
                USING ERRCODE = 'PGL15';
        END IF;
        RAISE EXCEPTION 'invalid claim arguments' USING ERRCODE = 'PGL20';
    END IF;
    IF p_expected_revision IS NULL THEN
        -- A claim of a lease that is live in the committed state is refused
        -- without a lock: the refusal changes nothing, so it needs no row
        -- lock, no transaction id and no WAL flush at commit (a locked refusal
        -- cost all three, and on a hot key refusals are most calls). One
        -- statement reads the lease and the revision from one snapshot.
        -- Granting always takes the locks below and judges again. With an
        -- expected revision the locked path runs, so a stale revision is
        -- reported as before.
        v_now := CASE WHEN p_now IS NULL THEN clock_timestamp()
                      ELSE @schema@._clock_now(p_now) END;
        -- A revoked lease counts as live until the revoked holder's last
        -- granted expiry (see revoke_lease): refused with no holder and the
        -- time it frees.
        SELECT false, l2.generation,
               CASE WHEN l2.owner_id IS NULL THEN l2.revoked_until ELSE l2.expires_at END,
               coalesce(l2.revision, (SELECT r.revision FROM @schema@.resources r
                                       WHERE r.id = l2.resource_id)),
               l2.owner_type, l2.owner_id
          INTO claimed, generation, expires_at, revision, holder_type, holder_id
          FROM @schema@.leases l2
         WHERE l2.resource_id = p_resource
           AND ((l2.owner_id IS NOT NULL AND l2.expires_at > v_now)
                OR l2.revoked_until > v_now);
        IF FOUND THEN
            RETURN;
        END IF;
        -- The common grant in one UPDATE: a free lease, or an expired one
        -- whose expiry is recorded already, so there is no `lease.expired`
        -- to write and nothing of the old holder to read. The queue lock
        -- first (see _lock_lease); the UPDATE takes the row lock, and if it
        -- had to wait for one (a heartbeat's) it judges the newest row again.
        -- Anything else (unknown, taken meanwhile, an unrecorded expiry)
        -- goes the locked way below.
        PERFORM pg_advisory_xact_lock(hashtextextended(p_resource, hashtext('@schema@')));
        v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE v_now END;
        -- The revision bump and the order guard's xid are in the same row
        -- (see _bump); the RETURNING subquery reads the row as it was.
        UPDATE @schema@.leases x SET generation = x.generation + 1, owner_type = p_owner_type,
            owner_id = p_owner_id, token_sha256 = p_token_sha256, acquired_at = v_now,
            heartbeat_at = v_now, expires_at = v_now + make_interval(secs => p_ttl),
            revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                              WHERE r.id = x.resource_id)) + 1,
            updated_at = v_now, last_xid = pg_current_xact_id()
         WHERE x.resource_id = p_resource
           AND (x.owner_id IS NULL
                OR (x.expires_at <= v_now AND x.expired_generation IS NOT DISTINCT FROM x.generation))
           AND (x.revoked_until IS NULL OR x.revoked_until <= v_now)
        RETURNING x.generation, x.expires_at, x.revision,
                  (SELECT o.last_xid FROM @schema@.leases o WHERE o.resource_id = p_resource)
             INTO generation, expires_at, revision, v_prev;
        IF FOUND THEN
            claimed := true;
            holder_type := p_owner_type;
            holder_id := p_owner_id;
            WITH e AS (
                INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                             lease_generation, lease_expires_at, created_at)
                VALUES (p_resource, _claim_cold.revision, 'lease.claimed', p_owner_type,
                        p_owner_id, _claim_cold.generation, _claim_cold.expires_at, v_now))
            SELECT coalesce(v_prev,
                            (SELECT x.xid FROM @schema@.events x
                              WHERE x.resource_id = p_resource
                                AND x.revision = _claim_cold.revision - 1))
              INTO v_prev;
            IF v_prev > pg_current_xact_id() THEN
                RAISE EXCEPTION 'event order: revision % of % would be ordered before revision %',
                    revision, p_resource, revision - 1
                    USING ERRCODE = '40001',
                          HINT = 'lock the lease row before the transaction writes anything else';
            END IF;
            IF NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@'))
               OR pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@')) THEN
                PERFORM pg_notify(left('pglease_@schema@', 63), '');
            END IF;
            RETURN;
        END IF;
    END IF;
    l := @schema@._lock_lease(p_resource);
    PERFORM @schema@._check_revision(p_resource, p_expected_revision);
    -- Judge expiry after the lock wait, by the database clock.
    v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE @schema@._clock_now(p_now) END;
    IF l.owner_id IS NOT NULL AND l.expires_at > v_now THEN
        SELECT false, l.generation, l.expires_at,
               coalesce(l.revision, (SELECT r.revision FROM @schema@.resources r
                                      WHERE r.id = p_resource)),
               l.owner_type, l.owner_id
          INTO claimed, generation, expires_at, revision, holder_type, holder_id;
        RETURN;
    END IF;
    IF l.revoked_until > v_now THEN
        SELECT false, l.generation, l.revoked_until,
               coalesce(l.revision, (SELECT r.revision FROM @schema@.resources r
                                      WHERE r.id = p_resource)),
               NULL, NULL
          INTO claimed, generation, expires_at, revision, holder_type, holder_id;
        RETURN;
    END IF;
    IF l.owner_id IS NOT NULL AND l.expired_generation IS DISTINCT FROM l.generation THEN
        -- Each event's bump writes the lease as it is after that event.
        l.expired_generation := l.generation;
        PERFORM @schema@._bump_lease(l, v_now, 'lease.expired', l.owner_type, l.owner_id,
                                     l.generation, l.expires_at);
    END IF;
    claimed := true;
    generation := l.generation + 1;
    expires_at := v_now + make_interval(secs => p_ttl);
    holder_type := p_owner_type;
    holder_id := p_owner_id;
    l.generation := _claim_cold.generation;
    l.owner_type := p_owner_type;
    l.owner_id := p_owner_id;
    l.token_sha256 := p_token_sha256;
    l.acquired_at := v_now;
    l.heartbeat_at := v_now;
    l.expires_at := _claim_cold.expires_at;
    SELECT b.revision INTO revision FROM @schema@._bump_lease(l, v_now, 'lease.claimed',
        p_owner_type, p_owner_id, _claim_cold.generation, _claim_cold.expires_at) b;
END $$;

-- Renew: extend a current, unexpired lease; bump and log `lease.renewed`.
CREATE OR REPLACE FUNCTION @schema@._renew_cold(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_ttl double precision, p_expected_revision bigint,
    p_now timestamptz, OUT expires_at timestamptz, OUT revision bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
BEGIN
    PERFORM @schema@._check_lease_args(p_resource, p_owner_type, p_owner_id, p_generation,
                                       p_token_sha256, p_expected_revision);
    PERFORM @schema@._check_ttl('ttl', p_ttl);
    l := @schema@._lock_lease(p_resource);
    PERFORM @schema@._check_current(l, p_owner_type, p_owner_id, p_generation, p_token_sha256);
    PERFORM @schema@._check_revision(p_resource, p_expected_revision);
    v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE @schema@._clock_now(p_now) END;
    IF l.expires_at <= v_now THEN
        RAISE EXCEPTION 'lease generation % on % expired at %', l.generation, p_resource,
            l.expires_at USING ERRCODE = 'PGL04';
    END IF;
    expires_at := v_now + make_interval(secs => p_ttl);
    l.heartbeat_at := v_now;
    l.expires_at := _renew_cold.expires_at;
    SELECT b.revision INTO revision FROM @schema@._bump_lease(l, v_now, 'lease.renewed',
        p_owner_type, p_owner_id, p_generation, _renew_cold.expires_at) b;
END $$;

-- Release: end a current lease (expired or not); bump and log `lease.released`.
CREATE OR REPLACE FUNCTION @schema@._release_cold(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_expected_revision bigint, p_now timestamptz,
    OUT revision bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    l @schema@.leases%ROWTYPE;
    v_rev bigint;
    v_prev xid8;
BEGIN
    -- The checks of _check_lease_args in one expression (as in claim).
    IF p_resource IS NULL OR p_resource !~ '^[a-z][a-z0-9_]{0,62}-[0-9a-f]{40}$'
       OR p_owner_type IS NULL OR p_owner_type !~ '^[a-z][a-z0-9_]{0,62}$'
       OR p_owner_id IS NULL OR p_owner_id = '' OR octet_length(p_owner_id) > 256
       OR p_generation IS NULL OR p_generation < 0
       OR p_token_sha256 IS NULL OR octet_length(p_token_sha256) <> 32
       OR p_expected_revision < 0 THEN
        PERFORM @schema@._check_lease_args(p_resource, p_owner_type, p_owner_id, p_generation,
                                           p_token_sha256, p_expected_revision);
        RAISE EXCEPTION 'invalid release arguments' USING ERRCODE = 'PGL20';
    END IF;
    -- The queue lock, then one UPDATE that is both the currency check and
    -- the release: it takes the row lock itself (re-judging the newest row
    -- if it waited), so no separate SELECT ... FOR UPDATE is needed. It bumps
    -- the revision in the same row and returns the order guard's previous
    -- xid as the row was (see _bump).
    PERFORM pg_advisory_xact_lock(hashtextextended(p_resource, hashtext('@schema@')));
    v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE @schema@._clock_now(p_now) END;
    UPDATE @schema@.leases x SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL,
        expires_at = NULL, heartbeat_at = v_now,
        revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                          WHERE r.id = x.resource_id)) + 1,
        updated_at = v_now, last_xid = pg_current_xact_id()
     WHERE x.resource_id = p_resource AND x.owner_type = p_owner_type
       AND x.owner_id = p_owner_id AND x.generation = p_generation
       AND x.token_sha256 = p_token_sha256
    RETURNING x.revision,
              (SELECT o.last_xid FROM @schema@.leases o WHERE o.resource_id = p_resource)
         INTO revision, v_prev;
    IF NOT FOUND THEN
        SELECT * INTO l FROM @schema@.leases x WHERE x.resource_id = p_resource;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'unknown resource %', p_resource USING ERRCODE = 'PGL01';
        END IF;
        -- Raises PGL03 naming why (the UPDATE matched no row, so it differs).
        PERFORM @schema@._check_current(l, p_owner_type, p_owner_id, p_generation,
                                        p_token_sha256);
        RAISE EXCEPTION 'lease generation % of %:% on % is no longer current',
            p_generation, p_owner_type, p_owner_id, p_resource USING ERRCODE = 'PGL03';
    END IF;
    IF p_expected_revision IS NOT NULL THEN
        -- Under the queue lock and the row lock no one else bumps the
        -- revision; the one the release found is the one before its bump
        -- (a refusal rolls the bump back).
        v_rev := revision - 1;
        IF v_rev <> p_expected_revision THEN
            RAISE EXCEPTION 'resource % is at revision %, expected %',
                p_resource, v_rev, p_expected_revision
                USING ERRCODE = 'PGL02', DETAIL = v_rev::text;
        END IF;
    END IF;
    WITH e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        VALUES (p_resource, _release_cold.revision, 'lease.released', p_owner_type, p_owner_id,
                p_generation, NULL::timestamptz, v_now))
    SELECT coalesce(v_prev,
                    (SELECT x.xid FROM @schema@.events x
                      WHERE x.resource_id = p_resource
                        AND x.revision = _release_cold.revision - 1))
      INTO v_prev;
    IF v_prev > pg_current_xact_id() THEN
        RAISE EXCEPTION 'event order: revision % of % would be ordered before revision %',
            revision, p_resource, revision - 1
            USING ERRCODE = '40001',
                  HINT = 'lock the lease row before the transaction writes anything else';
    END IF;
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@'))
       OR pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@')) THEN
        PERFORM pg_notify(left('pglease_@schema@', 63), '');
    END IF;
END $$;

-- The entry points claim, renew and release: one statement on the way that
-- succeeds.
--
-- Each runs as one guarded UPDATE of the lease row, which also bumps the
-- revision kept in that row (sql/0018: no second row to update), with the
-- event and the wake-up election in the same statement (CTEs): each
-- statement of a PL/pgSQL body pays an executor start and a snapshot, and
-- that, not the work, was most of an operation's server time (bench/RESULTS.md,
-- server cost). Everything else (bad arguments, an unknown resource, a lease
-- that is not current, an expected revision, a takeover that must record the
-- old holder's expiry first, a transaction that wrote before) goes to the
-- cold functions above, which are the earlier bodies unchanged: the UPDATE
-- changed nothing when it matched no row, so they judge from the start and
-- word every refusal and error as before.
--
-- How the one statement keeps each guarantee:
--  * queue lock before row lock: the UPDATE's WHERE takes the resource's
--    queue lock (see _lock_lease) only when the committed row it is looking
--    at would be changed (a CASE: evaluated in order, the lock last), so a
--    refusal waits for nobody, and a write queues before heap_update locks
--    the row and assigns the transaction id. If the row changed meanwhile,
--    READ COMMITTED re-judges the newest version (the WHERE again, the lock
--    then re-entrant).
--  * database clock: `now` is read in the SET list, after the WHERE (and so
--    after any wait for the queue lock), once per statement (an InitPlan),
--    as v_now was; expiry conditions that only become true as time passes
--    (claim's) are judged on the same row before the wait, and the one that
--    becomes false (renew's "not expired") after it.
--  * order guard: run only when the transaction had no id before the
--    statement. Its id is then assigned in the UPDATE, after the queue lock,
--    so after the previous writer of the resource committed: the previous
--    revision's xid is smaller and the guard could not fire. A transaction
--    that already has an id takes the cold way, which checks it. The UPDATE
--    still records its xid in the row (last_xid), for the next cold writer's
--    guard; pg_current_xact_id() in the SET list is evaluated after the
--    WHERE, so the id is still assigned after the queue lock.
--  * inputs: a resource id, owner, generation or token that equals the lease
--    row's is one of the row's own, written by a checked claim; only what
--    the row does not vouch for (claim's owner and token, the TTL) is
--    checked in the statement, as a condition that makes it match nothing.
--    The cold functions then raise the first error as before.
CREATE OR REPLACE FUNCTION @schema@.claim(
    p_resource text, p_owner_type text, p_owner_id text, p_token_sha256 bytea,
    p_ttl double precision, p_expected_revision bigint, p_now timestamptz,
    OUT claimed boolean, OUT generation bigint, OUT expires_at timestamptz,
    OUT revision bigint, OUT holder_type text, OUT holder_id text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_woke boolean;
BEGIN
    IF p_expected_revision IS NULL AND pg_current_xact_id_if_assigned() IS NULL THEN
        -- A grant of a free lease or of one whose expiry is recorded; else
        -- the refusal of a live (or revoked, see revoke_lease) lease read
        -- from the committed row without a lock, as the cold way refuses it.
        WITH g AS (
            UPDATE @schema@.leases x
               SET generation = x.generation + 1, owner_type = p_owner_type,
                   owner_id = p_owner_id, token_sha256 = p_token_sha256,
                   revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                     WHERE r.id = x.resource_id)) + 1,
                   last_xid = pg_current_xact_id(),
                   -- (The CASE keeps a custom plan from folding a bad TTL
                   -- into an error before the WHERE has refused it.)
                   (acquired_at, heartbeat_at, updated_at, expires_at) = (
                       SELECT n.t, n.t, n.t,
                              n.t + make_interval(secs => CASE WHEN p_ttl BETWEEN 0.001
                                                               AND 604800 THEN p_ttl END)
                         FROM (SELECT CASE WHEN p_now IS NULL THEN clock_timestamp()
                                           ELSE @schema@._clock_now(p_now) END AS t) n)
             WHERE x.resource_id = p_resource
               AND CASE WHEN p_owner_type IS NULL OR p_owner_type !~ '^[a-z][a-z0-9_]{0,62}$'
                              OR p_owner_id IS NULL OR p_owner_id = ''
                              OR octet_length(p_owner_id) > 256
                              OR p_ttl IS NULL OR NOT (p_ttl BETWEEN 0.001 AND 604800)
                              OR p_token_sha256 IS NULL OR octet_length(p_token_sha256) <> 32
                        THEN false
                        WHEN (x.owner_id IS NULL
                              OR (x.expires_at <= CASE WHEN p_now IS NULL THEN clock_timestamp()
                                                       ELSE @schema@._clock_now(p_now) END
                                  AND x.expired_generation IS NOT DISTINCT FROM x.generation))
                             AND (x.revoked_until IS NULL
                                  OR x.revoked_until <= CASE WHEN p_now IS NULL
                                                             THEN clock_timestamp()
                                                             ELSE @schema@._clock_now(p_now) END)
                        THEN pg_advisory_xact_lock(
                                 hashtextextended(p_resource, hashtext('@schema@'))) IS NOT NULL
                        ELSE false END
            RETURNING x.generation, x.expires_at, x.acquired_at, x.revision),
        e AS (
            INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                         lease_generation, lease_expires_at, created_at)
            SELECT p_resource, g.revision, 'lease.claimed', p_owner_type, p_owner_id,
                   g.generation, g.expires_at, g.acquired_at FROM g
            RETURNING events.revision)
        -- The wake-up election of _bump, after the event row: K2 shared
        -- first, then K1; a writer that cannot get K2 notifies itself.
        SELECT true, g.generation, g.expires_at, e.revision, p_owner_type, p_owner_id,
               CASE WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                              hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'),
                                                   hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    ELSE false END
          FROM g, e
        UNION ALL
        SELECT false, l.generation,
               CASE WHEN l.owner_id IS NULL THEN l.revoked_until ELSE l.expires_at END,
               coalesce(l.revision, (SELECT s.revision FROM @schema@.resources s
                                      WHERE s.id = l.resource_id)),
               l.owner_type, l.owner_id, false
          FROM @schema@.leases l
         WHERE NOT EXISTS (SELECT FROM g) AND l.resource_id = p_resource
           AND p_owner_type ~ '^[a-z][a-z0-9_]{0,62}$'
           AND p_owner_id <> '' AND octet_length(p_owner_id) <= 256
           AND p_ttl BETWEEN 0.001 AND 604800 AND octet_length(p_token_sha256) = 32
           AND ((l.owner_id IS NOT NULL
                 AND l.expires_at > CASE WHEN p_now IS NULL THEN clock_timestamp()
                                         ELSE @schema@._clock_now(p_now) END)
                OR l.revoked_until > CASE WHEN p_now IS NULL THEN clock_timestamp()
                                          ELSE @schema@._clock_now(p_now) END)
          INTO claimed, generation, expires_at, revision, holder_type, holder_id, v_woke;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    SELECT c.claimed, c.generation, c.expires_at, c.revision, c.holder_type, c.holder_id
      INTO claimed, generation, expires_at, revision, holder_type, holder_id
      FROM @schema@._claim_cold(p_resource, p_owner_type, p_owner_id, p_token_sha256, p_ttl,
                                p_expected_revision, p_now) c;
END $$;

CREATE OR REPLACE FUNCTION @schema@.renew(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_ttl double precision, p_expected_revision bigint,
    p_now timestamptz, OUT expires_at timestamptz, OUT revision bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_woke boolean;
BEGIN
    IF p_expected_revision IS NULL AND pg_current_xact_id_if_assigned() IS NULL THEN
        WITH g AS (
            UPDATE @schema@.leases x
               SET revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                     WHERE r.id = x.resource_id)) + 1,
                   last_xid = pg_current_xact_id(),
                   (heartbeat_at, updated_at, expires_at) = (
                       SELECT n.t, n.t,
                              n.t + make_interval(secs => CASE WHEN p_ttl BETWEEN 0.001
                                                               AND 604800 THEN p_ttl END)
                         FROM (SELECT CASE WHEN p_now IS NULL THEN clock_timestamp()
                                           ELSE @schema@._clock_now(p_now) END AS t) n)
             WHERE x.resource_id = p_resource
               AND CASE WHEN p_ttl IS NULL OR NOT (p_ttl BETWEEN 0.001 AND 604800) THEN false
                        WHEN x.owner_id = p_owner_id AND x.owner_type = p_owner_type
                             AND x.generation = p_generation
                             AND x.token_sha256 = p_token_sha256
                        THEN CASE WHEN pg_advisory_xact_lock(
                                      hashtextextended(p_resource, hashtext('@schema@')))
                                      IS NOT NULL
                                  -- Judged after the queue wait: the lease may
                                  -- have run out meanwhile.
                                  THEN x.expires_at > CASE WHEN p_now IS NULL
                                                           THEN clock_timestamp()
                                                           ELSE @schema@._clock_now(p_now) END
                                  END
                        ELSE false END
            RETURNING x.expires_at, x.heartbeat_at, x.revision),
        e AS (
            INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                         lease_generation, lease_expires_at, created_at)
            SELECT p_resource, g.revision, 'lease.renewed', p_owner_type, p_owner_id,
                   p_generation, g.expires_at, g.heartbeat_at FROM g
            RETURNING events.revision)
        SELECT g.expires_at, e.revision,
               CASE WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                              hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'),
                                                   hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    ELSE false END
          FROM g, e
          INTO expires_at, revision, v_woke;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    SELECT c.expires_at, c.revision INTO expires_at, revision
      FROM @schema@._renew_cold(p_resource, p_owner_type, p_owner_id, p_generation,
                                p_token_sha256, p_ttl, p_expected_revision, p_now) c;
END $$;

CREATE OR REPLACE FUNCTION @schema@.release(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_expected_revision bigint, p_now timestamptz,
    OUT revision bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_woke boolean;
BEGIN
    IF p_expected_revision IS NULL AND pg_current_xact_id_if_assigned() IS NULL THEN
        WITH g AS (
            UPDATE @schema@.leases x
               SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL, expires_at = NULL,
                   revision = coalesce(x.revision, (SELECT r.revision FROM @schema@.resources r
                                                     WHERE r.id = x.resource_id)) + 1,
                   last_xid = pg_current_xact_id(),
                   (heartbeat_at, updated_at) = (
                       SELECT n.t, n.t
                         FROM (SELECT CASE WHEN p_now IS NULL THEN clock_timestamp()
                                           ELSE @schema@._clock_now(p_now) END AS t) n)
             WHERE x.resource_id = p_resource
               AND CASE WHEN x.owner_id = p_owner_id AND x.owner_type = p_owner_type
                             AND x.generation = p_generation
                             AND x.token_sha256 = p_token_sha256
                        THEN pg_advisory_xact_lock(
                                 hashtextextended(p_resource, hashtext('@schema@'))) IS NOT NULL
                        ELSE false END
            RETURNING x.heartbeat_at, x.revision),
        e AS (
            INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                         lease_generation, lease_expires_at, created_at)
            SELECT p_resource, g.revision, 'lease.released', p_owner_type, p_owner_id,
                   p_generation, NULL::timestamptz, g.heartbeat_at FROM g
            RETURNING events.revision)
        SELECT e.revision,
               CASE WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                              hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'),
                                                   hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    ELSE false END
          FROM g, e
          INTO revision, v_woke;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    revision := @schema@._release_cold(p_resource, p_owner_type, p_owner_id, p_generation,
                                       p_token_sha256, p_expected_revision, p_now);
END $$;

-- Fence at commit (trigger events_fence_at_commit, sql/0011): the lease of a
-- fenced mutation must still be unexpired, by the database clock, when its
-- transaction commits. No one else can have changed the lease meanwhile: the
-- transaction holds its row lock since mutate_begin, which is also why a
-- heartbeat (SKIP LOCKED) cannot extend it while the mutation runs. Under the
-- owner's test clock the mutation's own `now` (stashed by mutate_begin) is
-- the commit time; a `pglease.test_now` set by anyone else is ignored.
CREATE OR REPLACE FUNCTION @schema@._fence_at_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    l record;
    v_now timestamptz := clock_timestamp();
    v_test text := current_setting('pglease.test_now', true);
BEGIN
    IF coalesce(v_test, '') <> ''
       AND coalesce((SELECT s.test_clock FROM @schema@.settings s), false) THEN
        v_now := v_test::timestamptz;
    END IF;
    SELECT x.generation, x.owner_id, x.expires_at INTO l
      FROM @schema@.leases x WHERE x.resource_id = NEW.resource_id;
    IF NOT FOUND OR l.owner_id IS NULL OR l.generation <> NEW.lease_generation THEN
        RAISE EXCEPTION 'lease generation % on % is no longer current at commit',
            NEW.lease_generation, NEW.resource_id USING ERRCODE = 'PGL03';
    END IF;
    IF l.expires_at <= v_now THEN
        RAISE EXCEPTION 'lease generation % on % expired at % before the write committed (%)',
            NEW.lease_generation, NEW.resource_id, l.expires_at, v_now
            USING ERRCODE = 'PGL04',
                  HINT = 'a fenced mutation must commit before its lease expires';
    END IF;
    RETURN NULL;
END $$;

-- Bound a fenced mutation's transaction by its lease, on the server: after
-- mutate_begin's checks, the transaction's statements, its idle time and (on
-- PostgreSQL 17+) the whole transaction may last at most the lease's
-- remaining time plus a margin of 0.5 s. The server itself then ends a holder
-- that stalls (sleeps in its own code, hangs on the network, vanishes) at about
-- its lease's expiry, and its row lock goes with it: a rival's claim waits at
-- most that margin past the expiry instead of the rival's own lock_timeout.
-- The margin keeps the cut after the expiry, so a holder's COMMIT that arrives
-- just too late is refused by the fence at commit (PGL04) on a live
-- connection; a timeout never fires before the lease has run out.
--
-- The settings are transaction-local (set_config(..., true); they survive the
-- return from this function and mutate_begin, whose SET clauses save only
-- search_path) and only ever shorten a limit already in force. On 15 and 16 a
-- holder that keeps sending statements can outlive the bound (each statement
-- and each idle spell is bounded on its own); the fence at commit still refuses
-- its write. A running transaction_timeout is re-armed by disarming it first:
-- setting it only arms a timer when none runs. `pglease.lease_left` tells the
-- client the seconds left when the transaction was bounded.
CREATE OR REPLACE FUNCTION @schema@._bound_by_lease(p_left interval)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_left double precision := greatest(extract(epoch FROM p_left), 0);
    -- Seconds; the GUCs take int milliseconds (at most 2147483647).
    v_bound double precision := least(v_left + 0.5, 2147483);
    v_ms text := ceil(v_bound * 1000)::bigint::text;
    v_cur double precision;
BEGIN
    PERFORM set_config('pglease.lease_left', v_left::text, true);
    v_cur := extract(epoch FROM current_setting('statement_timeout')::interval);
    IF v_cur = 0 OR v_bound < v_cur THEN
        PERFORM set_config('statement_timeout', v_ms, true);
    END IF;
    v_cur := extract(epoch FROM current_setting('idle_in_transaction_session_timeout')::interval);
    IF v_cur = 0 OR v_bound < v_cur THEN
        PERFORM set_config('idle_in_transaction_session_timeout', v_ms, true);
    END IF;
    IF current_setting('server_version_num')::int >= 170000 THEN
        v_cur := extract(epoch FROM current_setting('transaction_timeout')::interval);
        -- A limit in force counts from the transaction's start (now()).
        IF v_cur = 0 OR v_bound < v_cur - extract(epoch FROM clock_timestamp() - now()) THEN
            PERFORM set_config('transaction_timeout', '0', true);
            PERFORM set_config('transaction_timeout', v_ms, true);
        END IF;
    END IF;
END $$;

-- The cold way of mutate_begin (the entry point below runs it when its one
-- statement matched nothing or cannot be used; internal: no role is granted
-- it). First statement of a mutation's transaction: checks the permit under
-- the row lock, stores the payload, bumps the revision and appends the event. The
-- caller's own SQL runs afterwards in the same transaction, still under the lock,
-- and a fenced one no longer than its lease allows (_bound_by_lease).
--
-- A payload that is already stored is locked FOR KEY SHARE before the event
-- that references it is inserted, and stored again if a concurrent prune
-- deleted it meanwhile (INSERT ... ON CONFLICT DO NOTHING locks nothing):
-- prune skips key-share-locked rows, and a writer that comes second finds the
-- row gone and inserts it again. The loop ends: each turn inserts the row,
-- locks it, or saw it deleted by a prune that has committed.
CREATE OR REPLACE FUNCTION @schema@._mutate_begin_cold(
    p_resource text, p_expected_revision bigint, p_event_type text,
    p_owner_type text, p_owner_id text, p_generation bigint, p_token_sha256 bytea,
    p_actor_type text, p_actor_id text, p_payload text, p_now timestamptz,
    OUT revision bigint, OUT event_id bigint, OUT payload_sha256 bytea)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
    v_body text;
BEGIN
    -- A NULL expected revision (direct SQL callers only) skips the revision check.
    IF p_token_sha256 IS NOT NULL THEN
        PERFORM @schema@._check_lease_args(p_resource, p_owner_type, p_owner_id, p_generation,
                                           p_token_sha256, p_expected_revision);
    ELSE
        PERFORM @schema@._check_resource_id(p_resource);
        IF p_expected_revision < 0 THEN
            RAISE EXCEPTION 'expected revision must be >= 0, got %', p_expected_revision
                USING ERRCODE = 'PGL15';
        END IF;
    END IF;
    IF p_event_type IS NULL OR length(p_event_type) > 128
       OR p_event_type !~ '^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$'
       OR p_event_type LIKE 'lease.%' THEN
        RAISE EXCEPTION 'event type % must be dotted lowercase identifiers outside the reserved lease. prefix',
            coalesce(quote_literal(left(p_event_type, 140)), 'NULL') USING ERRCODE = 'PGL18';
    END IF;
    IF p_actor_type IS NOT NULL OR p_actor_id IS NOT NULL THEN
        PERFORM @schema@._check_owner('actor', p_actor_type, p_actor_id);
    END IF;
    IF p_payload IS NOT NULL THEN
        IF octet_length(p_payload) > 1048576 THEN
            RAISE EXCEPTION 'payload is % bytes; the limit is 1048576', octet_length(p_payload)
                USING ERRCODE = 'PGL19';
        END IF;
        -- Refuse text that is not JSON (the cast raises 22P02 with the position).
        PERFORM p_payload::json;
    END IF;
    l := @schema@._lock_lease(p_resource);
    v_now := CASE WHEN p_now IS NULL THEN clock_timestamp() ELSE @schema@._clock_now(p_now) END;
    IF p_now IS NOT NULL THEN
        -- The test clock is on (else _clock_now refused): the fence at commit
        -- judges by this time too.
        PERFORM set_config('pglease.test_now', v_now::text, true);
    END IF;
    IF p_token_sha256 IS NOT NULL THEN
        PERFORM @schema@._check_current(l, p_owner_type, p_owner_id, p_generation,
                                        p_token_sha256);
        PERFORM @schema@._check_revision(p_resource, p_expected_revision);
        IF l.expires_at <= v_now THEN
            RAISE EXCEPTION 'lease generation % on % expired at %', l.generation, p_resource,
                l.expires_at USING ERRCODE = 'PGL04';
        END IF;
        PERFORM @schema@._bound_by_lease(l.expires_at - v_now);
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
                VALUES (_mutate_begin_cold.payload_sha256, p_payload)
                ON CONFLICT DO NOTHING;
            EXIT WHEN FOUND;
            SELECT body INTO v_body FROM @schema@.payloads
             WHERE sha256 = _mutate_begin_cold.payload_sha256 FOR KEY SHARE;
            IF FOUND THEN
                IF v_body IS DISTINCT FROM p_payload THEN
                    RAISE EXCEPTION 'payload % is stored with different bytes',
                        encode(_mutate_begin_cold.payload_sha256, 'hex') USING ERRCODE = 'PGL06';
                END IF;
                EXIT;
            END IF;
        END LOOP;
    END IF;
    SELECT b.revision, b.event_id INTO revision, event_id
      FROM @schema@._bump(p_resource, v_now, p_event_type, p_actor_type, p_actor_id,
                          CASE WHEN p_token_sha256 IS NULL THEN NULL ELSE p_generation END,
                          NULL, _mutate_begin_cold.payload_sha256) b;
END $$;

-- The entry point mutate_begin: one statement on the way that succeeds, as
-- claim, renew and release (see the comment above them for how one statement
-- keeps the queue lock, the database clock, the order guard and the inputs).
-- It covers the writes users make: leased (fenced) or not, with an expected
-- revision or without, with a payload or without. Everything else goes to
-- _mutate_begin_cold above, the earlier body unchanged, which judges from the
-- start and words every refusal and error as before: bad arguments, an
-- unknown resource, a lease that is not current or has expired, a stale
-- revision, a leased resource written without its lease, a payload stored
-- with other bytes or deleted by a prune meanwhile, a test clock (`now`), a
-- transaction that wrote before. When the statement matched nothing it wrote
-- nothing: every write in it hangs on the lease row it locked and judged.
--
-- What the statement adds to claim's pattern:
--  * the row lock: `l` takes the queue lock in its WHERE (only when the
--    committed row is one this write would be accepted on) and then the row
--    lock FOR UPDATE, as _lock_lease; if the row changed meanwhile, READ
--    COMMITTED re-judges its newest version. `now` (l.t) is read in its
--    target list, after the queue wait; `g` judges expiry by it (a leased
--    write needs an unexpired lease, an unleased one a free or expired lease),
--    so the event, the revision's updated_at and the bound share one instant.
--  * the inputs: the resource, owner, generation and token equal the row's
--    (written by a checked claim), an expected revision must equal the
--    resource's; what no row vouches for is checked as a condition that makes
--    `l` match nothing (event type, actor, payload size, a negative expected
--    revision). The payload's JSON is checked (cast, raising 22P02 as the
--    cold way does) only on a row `g` accepted, through a column of `l`, so a
--    custom plan cannot fold it into an error that the cold way would word
--    differently (another argument error comes first there).
--  * the payload and a concurrent prune (see the loop in _mutate_begin_cold):
--    `pi` inserts the payload; when it was stored already (ON CONFLICT DO
--    NOTHING locks nothing), `po` locks the stored row FOR KEY SHARE, which
--    prune skips. A row prune deleted meanwhile (committed before the lock, or
--    deleted while `po` waited for prune's lock) is not returned, and neither
--    is one inserted by a transaction that committed after the statement's
--    snapshot: the statement then writes nothing and the cold way stores the
--    payload again, in its loop. Other bytes under the same hash: cold, PGL06.
--  * the revision bump is one CTE (`r`); the order guard is not read, as in
--    claim: the transaction had no id before the statement, and takes it in
--    `l` after the queue lock.
--  * the bound (_bound_by_lease's settings, same values and rules) is set in
--    the statement's last SELECT for a leased write, with
--    `pglease.lease_left`, which the client reads.
CREATE OR REPLACE FUNCTION @schema@.mutate_begin(
    p_resource text, p_expected_revision bigint, p_event_type text,
    p_owner_type text, p_owner_id text, p_generation bigint, p_token_sha256 bytea,
    p_actor_type text, p_actor_id text, p_payload text, p_now timestamptz,
    OUT revision bigint, OUT event_id bigint, OUT payload_sha256 bytea)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_set text;
    v_woke boolean;
BEGIN
    IF p_now IS NULL AND pg_current_xact_id_if_assigned() IS NULL THEN
        WITH l AS MATERIALIZED (
            SELECT x.generation, x.owner_id, x.expires_at, clock_timestamp() AS t,
                   p_payload AS body, sha256(convert_to(p_payload, 'UTF8')) AS h
              FROM @schema@.leases x
             WHERE x.resource_id = p_resource
               AND CASE WHEN p_expected_revision < 0
                              OR p_event_type IS NULL OR length(p_event_type) > 128
                              OR p_event_type !~ '^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$'
                              OR p_event_type LIKE 'lease.%'
                              OR octet_length(p_payload) > 1048576
                        THEN false
                        -- An actor: none, the lease's owner (the row vouches
                        -- for it), or checked as _check_owner does.
                        WHEN NOT coalesce((p_actor_type IS NULL AND p_actor_id IS NULL)
                                          OR (p_token_sha256 IS NOT NULL
                                              AND p_actor_type = p_owner_type
                                              AND p_actor_id = p_owner_id)
                                          OR (p_actor_type ~ '^[a-z][a-z0-9_]{0,62}$'
                                              AND p_actor_id <> ''
                                              AND octet_length(p_actor_id) <= 256), false)
                        THEN false
                        WHEN CASE WHEN p_token_sha256 IS NULL
                                  THEN x.owner_id IS NULL OR x.expires_at <= clock_timestamp()
                                  ELSE x.owner_id = p_owner_id AND x.owner_type = p_owner_type
                                       AND x.generation = p_generation
                                       AND x.token_sha256 = p_token_sha256 END
                        THEN pg_advisory_xact_lock(
                                 hashtextextended(p_resource, hashtext('@schema@'))) IS NOT NULL
                        ELSE false END
               FOR UPDATE OF x),
        g AS MATERIALIZED (
            SELECT l.t, l.expires_at, l.body, l.h FROM l
             WHERE CASE WHEN p_token_sha256 IS NULL
                        THEN l.owner_id IS NULL OR l.expires_at <= l.t
                        ELSE l.expires_at > l.t END),
        pi AS (
            INSERT INTO @schema@.payloads (sha256, body)
            SELECT g.h, g.body FROM g WHERE g.body IS NOT NULL AND g.body::json IS NOT NULL
            ON CONFLICT DO NOTHING
            RETURNING payloads.sha256),
        po AS MATERIALIZED (
            SELECT p.body FROM g JOIN @schema@.payloads p ON p.sha256 = g.h
             WHERE NOT EXISTS (SELECT FROM pi)
               FOR KEY SHARE OF p),
        pay AS MATERIALIZED (
            SELECT g.t, g.expires_at, g.h FROM g
             WHERE g.body IS NULL OR EXISTS (SELECT FROM pi)
                OR EXISTS (SELECT FROM po WHERE po.body = g.body)),
        -- The revision bump and its check, in the lease row `l` locked
        -- (migration 0018: a row not moved yet still reads its revision
        -- from `resources`). Under the queue lock no one else bumps it; a
        -- bump committed while this statement queued is seen (READ
        -- COMMITTED re-judges the row it updates). The transaction got its
        -- xid after the queue lock, so the order guard could not fire; the
        -- row records it for the next cold writer's guard.
        r AS (
            UPDATE @schema@.leases x
               SET revision = coalesce(x.revision, (SELECT s.revision FROM @schema@.resources s
                                                     WHERE s.id = x.resource_id)) + 1,
                   updated_at = pay.t, last_xid = pg_current_xact_id()
              FROM pay
             WHERE x.resource_id = p_resource
               AND (p_expected_revision IS NULL
                    OR coalesce(x.revision, (SELECT s.revision FROM @schema@.resources s
                                              WHERE s.id = x.resource_id)) = p_expected_revision)
            RETURNING x.revision),
        e AS (
            INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                         lease_generation, lease_expires_at, payload_sha256,
                                         created_at)
            SELECT p_resource, r.revision, p_event_type,
                   CASE WHEN p_token_sha256 IS NULL THEN p_actor_type ELSE p_owner_type END,
                   CASE WHEN p_token_sha256 IS NULL THEN p_actor_id ELSE p_owner_id END,
                   CASE WHEN p_token_sha256 IS NULL THEN NULL ELSE p_generation END,
                   NULL::timestamptz, pay.h, pay.t
              FROM pay, r
            RETURNING events.id, events.revision),
        -- _bound_by_lease's values: seconds left, the bound (left + 0.5 s) and
        -- its milliseconds, and the limits in force (0: none).
        b AS (
            SELECT s.secs, s.bound, ceil(s.bound * 1000)::bigint::text AS ms,
                   extract(epoch FROM current_setting('statement_timeout')::interval)::float8
                       AS stmt,
                   extract(epoch FROM current_setting('idle_in_transaction_session_timeout')
                                          ::interval)::float8 AS idle,
                   CASE WHEN current_setting('server_version_num')::int >= 170000
                        THEN extract(epoch FROM current_setting('transaction_timeout')
                                                   ::interval)::float8 END AS xact
              FROM (SELECT v.secs, least(v.secs + 0.5, 2147483) AS bound
                      FROM (SELECT greatest(extract(epoch FROM pay.expires_at - pay.t), 0)::float8
                                   AS secs FROM pay) v) s
             WHERE p_token_sha256 IS NOT NULL)
        SELECT e.revision, e.id, pay.h,
               -- The settings of _bound_by_lease, set only ever to shorten.
               CASE WHEN b.secs IS NOT NULL THEN concat(
                      set_config('pglease.lease_left', b.secs::text, true),
                      CASE WHEN b.stmt = 0 OR b.bound < b.stmt
                           THEN set_config('statement_timeout', b.ms, true) END,
                      CASE WHEN b.idle = 0 OR b.bound < b.idle
                           THEN set_config('idle_in_transaction_session_timeout', b.ms, true) END,
                      -- A limit in force counts from the transaction's start;
                      -- a running timer is re-armed by disarming it first.
                      CASE WHEN b.xact = 0
                                OR b.bound < b.xact - extract(epoch FROM clock_timestamp() - now())
                           THEN set_config('transaction_timeout',
                                           CASE WHEN set_config('transaction_timeout', '0', true)
                                                     IS NOT NULL THEN b.ms END, true) END)
               END,
               CASE WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                              hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'),
                                                   hashtext('@schema@'))
                    THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                    ELSE false END
          FROM pay CROSS JOIN e LEFT JOIN b ON true
          INTO revision, event_id, payload_sha256, v_set, v_woke;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    SELECT c.revision, c.event_id, c.payload_sha256 INTO revision, event_id, payload_sha256
      FROM @schema@._mutate_begin_cold(p_resource, p_expected_revision, p_event_type,
                                       p_owner_type, p_owner_id, p_generation, p_token_sha256,
                                       p_actor_type, p_actor_id, p_payload, p_now) c;
END $$;

-- An operator ends the current lease (the owner's tool for a stuck holder):
-- the generation rises, the holder is cleared and `lease.revoked` records the
-- holder that was fenced and the new generation. The old holder's renew,
-- release and fenced writes fail at once (not current), and any downstream
-- system comparing fencing tokens sees a higher generation. A claim is still
-- refused until the old holder's last granted expiry (`revoked_until`): the
-- database can fence the holder's writes at once but cannot stop its process
-- on another host, which its runner stops by its own trust window, closing
-- before that expiry. The schema owner's job: no client or reader role is
-- granted it. Returns revoked = false (and changes nothing) when no one holds
-- the lease.
CREATE OR REPLACE FUNCTION @schema@.revoke_lease(
    p_resource text, OUT revoked boolean, OUT generation bigint, OUT revision bigint,
    OUT holder_type text, OUT holder_id text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
BEGIN
    PERFORM @schema@._check_resource_id(p_resource);
    l := @schema@._lock_lease(p_resource);
    v_now := clock_timestamp();
    holder_type := l.owner_type;
    holder_id := l.owner_id;
    IF l.owner_id IS NULL THEN
        revoked := false;
        generation := l.generation;
        revision := coalesce(l.revision, (SELECT r.revision FROM @schema@.resources r
                                           WHERE r.id = p_resource));
        RETURN;
    END IF;
    revoked := true;
    generation := l.generation + 1;
    l.revoked_until := CASE WHEN l.expires_at > v_now THEN l.expires_at END;
    l.generation := revoke_lease.generation;
    l.expired_generation := revoke_lease.generation;
    l.owner_type := NULL;
    l.owner_id := NULL;
    l.token_sha256 := NULL;
    l.expires_at := NULL;
    l.heartbeat_at := v_now;
    -- The event names the revoked holder (holder_type/holder_id, read above).
    SELECT b.revision INTO revision FROM @schema@._bump_lease(l, v_now, 'lease.revoked',
        holder_type, holder_id, revoke_lease.generation, NULL) b;
END $$;
