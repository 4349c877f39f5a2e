-- The floor of one claim and one release, for bench/server_cost.py --floor only
-- (never migrated): the leanest SQL we could write that still keeps every
-- guarantee pglease gives, in its own schema with its own two tables. It is
-- what issue 24's "0.9 of the floor" targets are measured against.
--
-- Kept, as in sql/functions/10_core.sql:
--  * fencing: the generation rises by one on every grant; release and renew
--    match owner, generation and token hash;
--  * the revision, its time and the order guard's previous xid in the lease
--    row, bumped by the one lease UPDATE;
--  * the event row per change, with the two indexes the log needs:
--    (xid, id) for readers and the unique (resource_id, revision) for a
--    resource's history and the replica identity;
--  * the order guard, complete: the UPDATE returns the previous writer's xid
--    (PG 18 `RETURNING old.`) and a later revision may not carry a smaller
--    xid (40001), for any transaction, not only one without an xid yet;
--  * the queue lock (the advisory lock of the resource) taken before the row
--    lock is kept, only when the row is claimable / held by the caller;
--  * the NOTIFY election (K2 shared, then K1; pg_notify by the elected one);
--  * the reaper's partial index leases_to_reap, same definition;
--  * the role model: tables owned by the schema owner, no grant on them; the
--    entries are SECURITY DEFINER with search_path pinned, so a client role
--    with EXECUTE alone can claim and release and cannot write a table;
--  * input checks of what the row does not vouch for (owner type and id, TTL,
--    token hash length) in the statement's WHERE; a caller's clock (p_now)
--    and an expected revision are honoured by refusing the first and
--    matching the second in the WHERE.
-- Left out (none of them a guarantee): the wording of a refusal or error (a
-- refused call returns the row's holder, a bad argument raises one generic
-- error), the test clock, the takeover of an expiry the reaper has not
-- recorded yet (refused here: ours' cold way writes lease.expired first), the
-- `resources` table and the migration's NULL-revision rows.
-- `@schema@` is the bench's floor schema.

CREATE TABLE @schema@.leases (
    resource_id         text PRIMARY KEY,
    generation          bigint NOT NULL DEFAULT 0 CHECK (generation >= 0),
    owner_type          text,
    owner_id            text,
    token_sha256        bytea,
    acquired_at         timestamptz,
    heartbeat_at        timestamptz,
    expires_at          timestamptz,
    expired_generation  bigint,
    revoked_until       timestamptz,
    revision            bigint NOT NULL DEFAULT 0,
    updated_at          timestamptz,
    last_xid            xid8,
    CHECK ((owner_id IS NULL) = (token_sha256 IS NULL)),
    CHECK ((owner_id IS NULL) = (expires_at IS NULL))
);
CREATE INDEX leases_to_reap ON @schema@.leases (expires_at, resource_id)
    WHERE owner_id IS NOT NULL AND expired_generation IS DISTINCT FROM generation;

CREATE TABLE @schema@.events (
    id                bigint GENERATED ALWAYS AS IDENTITY,
    xid               xid8 NOT NULL DEFAULT pg_current_xact_id(),
    resource_id       text NOT NULL,
    revision          bigint NOT NULL,
    type              text NOT NULL,
    actor_type        text,
    actor_id          text,
    lease_generation  bigint,
    lease_expires_at  timestamptz,
    payload_sha256    bytea,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (resource_id, revision)
);
CREATE INDEX events_xid_id ON @schema@.events (xid, id);
ALTER TABLE @schema@.events REPLICA IDENTITY USING INDEX events_resource_id_revision_key;

CREATE FUNCTION @schema@.claim(
    p_resource text, p_owner_type text, p_owner_id text, p_token_sha256 bytea,
    p_ttl double precision, p_expected_revision bigint, p_now timestamptz,
    OUT claimed boolean, OUT generation bigint, OUT expires_at timestamptz,
    OUT revision bigint, OUT holder_type text, OUT holder_id text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_late boolean;
BEGIN
    WITH g AS (
        UPDATE @schema@.leases x
           SET generation = x.generation + 1, owner_type = p_owner_type,
               owner_id = p_owner_id, token_sha256 = p_token_sha256,
               revision = x.revision + 1, last_xid = pg_current_xact_id(),
               (acquired_at, heartbeat_at, updated_at, expires_at) = (
                   SELECT n.t, n.t, n.t, n.t + make_interval(secs => p_ttl)
                     FROM (SELECT clock_timestamp() AS t) n)
         WHERE x.resource_id = p_resource
           AND p_now IS NULL
           AND p_owner_type ~ '^[a-z][a-z0-9_]{0,62}$'
           AND p_owner_id <> '' AND octet_length(p_owner_id) <= 256
           AND p_ttl BETWEEN 0.001 AND 604800 AND octet_length(p_token_sha256) = 32
           AND (p_expected_revision IS NULL OR x.revision = p_expected_revision)
           AND (x.owner_id IS NULL
                OR (x.expires_at <= clock_timestamp()
                    AND x.expired_generation IS NOT DISTINCT FROM x.generation))
           AND (x.revoked_until IS NULL OR x.revoked_until <= clock_timestamp())
           AND pg_advisory_xact_lock(hashtextextended(p_resource, hashtext('@schema@')))
               IS NOT NULL
        RETURNING x.generation, x.expires_at, x.acquired_at, x.revision,
                  old.last_xid > new.last_xid AS late),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT p_resource, g.revision, 'lease.claimed', p_owner_type, p_owner_id,
               g.generation, g.expires_at, g.acquired_at FROM g
        RETURNING events.revision)
    SELECT true, g.generation, g.expires_at, e.revision, p_owner_type, p_owner_id, g.late
      FROM g, e
     WHERE CASE WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                          hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'),
                                               hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                ELSE true END
      INTO claimed, generation, expires_at, revision, holder_type, holder_id, v_late;
    IF FOUND THEN
        IF v_late THEN
            RAISE EXCEPTION 'event order' USING ERRCODE = '40001';
        END IF;
        RETURN;
    END IF;
    -- Refused (or a bad argument): one read of the row, no lock.
    SELECT false, l.generation, l.expires_at, l.revision, l.owner_type, l.owner_id
      INTO claimed, generation, expires_at, revision, holder_type, holder_id
      FROM @schema@.leases l WHERE l.resource_id = p_resource;
    IF NOT FOUND OR p_now IS NOT NULL OR p_owner_type !~ '^[a-z][a-z0-9_]{0,62}$'
       OR p_owner_id = '' OR octet_length(p_owner_id) > 256
       OR NOT (p_ttl BETWEEN 0.001 AND 604800) OR octet_length(p_token_sha256) <> 32
       OR p_owner_type IS NULL OR p_owner_id IS NULL OR p_ttl IS NULL
       OR p_token_sha256 IS NULL THEN
        RAISE EXCEPTION 'claim refused: bad argument' USING ERRCODE = 'PGL20';
    END IF;
END $$;

CREATE FUNCTION @schema@.release(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_expected_revision bigint, p_now timestamptz,
    OUT revision bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_late boolean;
BEGIN
    WITH g AS (
        UPDATE @schema@.leases x
           SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL, expires_at = NULL,
               revision = x.revision + 1, last_xid = pg_current_xact_id(),
               (heartbeat_at, updated_at) = (
                   SELECT n.t, n.t FROM (SELECT clock_timestamp() AS t) n)
         WHERE x.resource_id = p_resource
           AND p_now IS NULL
           AND x.owner_id = p_owner_id AND x.owner_type = p_owner_type
           AND x.generation = p_generation AND x.token_sha256 = p_token_sha256
           AND (p_expected_revision IS NULL OR x.revision = p_expected_revision)
           AND pg_advisory_xact_lock(hashtextextended(p_resource, hashtext('@schema@')))
               IS NOT NULL
        RETURNING x.heartbeat_at, x.revision, old.last_xid > new.last_xid AS late),
    e AS (
        INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                     lease_generation, lease_expires_at, created_at)
        SELECT p_resource, g.revision, 'lease.released', p_owner_type, p_owner_id,
               p_generation, NULL::timestamptz, g.heartbeat_at FROM g
        RETURNING events.revision)
    SELECT e.revision, g.late
      FROM g, e
     WHERE CASE WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                          hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'),
                                               hashtext('@schema@'))
                THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
                ELSE true END
      INTO revision, v_late;
    IF FOUND THEN
        IF v_late THEN
            RAISE EXCEPTION 'event order' USING ERRCODE = '40001';
        END IF;
        RETURN;
    END IF;
    RAISE EXCEPTION 'release refused: lease not current' USING ERRCODE = 'PGL03';
END $$;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA @schema@ FROM PUBLIC;
