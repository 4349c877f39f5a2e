-- pglease core schema: resources, leases, payload blobs, the event log, and
-- the single-round-trip lease functions. `@schema@` is replaced by the
-- configured schema name when the migration is applied.

CREATE TABLE @schema@.resources (
    id          text PRIMARY KEY,
    type        text NOT NULL,
    key         text NOT NULL,
    revision    bigint NOT NULL DEFAULT 0 CHECK (revision >= 0),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (type, key)
);

-- One row per resource, created with it and never deleted, so the generation
-- survives releases and can only rise.
CREATE TABLE @schema@.leases (
    resource_id   text PRIMARY KEY REFERENCES @schema@.resources (id),
    generation    bigint NOT NULL DEFAULT 0 CHECK (generation >= 0),
    owner_type    text,
    owner_id      text,
    token_sha256  bytea,
    acquired_at   timestamptz,
    heartbeat_at  timestamptz,
    expires_at    timestamptz,
    CHECK ((owner_id IS NULL) = (token_sha256 IS NULL)),
    CHECK ((owner_id IS NULL) = (expires_at IS NULL))
);

CREATE TABLE @schema@.payloads (
    sha256      bytea PRIMARY KEY,
    body        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- `xid` records the writing transaction so readers can consume only events of
-- finished transactions: ids are not assigned in commit order.
CREATE TABLE @schema@.events (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    xid               xid8 NOT NULL DEFAULT pg_current_xact_id(),
    resource_id       text NOT NULL REFERENCES @schema@.resources (id),
    revision          bigint NOT NULL,
    type              text NOT NULL,
    actor_type        text,
    actor_id          text,
    lease_generation  bigint,
    lease_expires_at  timestamptz,
    payload_sha256    bytea REFERENCES @schema@.payloads (sha256),
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (resource_id, revision)
);
CREATE INDEX events_xid_id ON @schema@.events (xid, id);
CREATE INDEX events_payload ON @schema@.events (payload_sha256) WHERE payload_sha256 IS NOT NULL;

-- Error codes raised by the functions below (class "PL"):
--   PGL01 unknown resource      PGL02 stale revision (DETAIL = actual revision)
--   PGL03 lease not current     PGL04 lease expired
--   PGL05 resource is leased    PGL06 payload hash conflict

CREATE FUNCTION @schema@.ensure_resource(p_type text, p_key text)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    v_id text := p_type || '-' || left(encode(sha256(
        convert_to(p_type, 'UTF8') || '\x00'::bytea || convert_to(p_key, 'UTF8')), 'hex'), 40);
BEGIN
    INSERT INTO @schema@.resources (id, type, key) VALUES (v_id, p_type, p_key)
        ON CONFLICT DO NOTHING;
    IF FOUND THEN
        INSERT INTO @schema@.leases (resource_id) VALUES (v_id);
    END IF;
    RETURN v_id;
END $$;

-- Lock the lease row first in every writing function: one lock order, no deadlocks.
--
-- Before the row lock, queue on a transaction-scoped advisory lock keyed by the
-- resource. An advisory lock needs no transaction id, while a row lock takes one
-- before it waits, and row-lock waiters are not served strictly in arrival
-- order. Queueing first means a resource's writers obtain their xids in the
-- order they write, so (xid, id) order -- the order readers consume the log in --
-- is also revision order for every resource. (A hash collision between two
-- resources only makes them queue together.)
CREATE FUNCTION @schema@._lock_lease(p_resource text)
RETURNS @schema@.leases LANGUAGE plpgsql AS $$
DECLARE
    l @schema@.leases%ROWTYPE;
BEGIN
    PERFORM pg_advisory_xact_lock(1886152037, hashtext(p_resource));
    SELECT * INTO l FROM @schema@.leases WHERE resource_id = p_resource FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown resource %', p_resource USING ERRCODE = 'PGL01';
    END IF;
    RETURN l;
END $$;

CREATE FUNCTION @schema@._check_revision(p_resource text, p_expected_revision bigint)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_rev bigint;
BEGIN
    IF p_expected_revision IS NOT NULL THEN
        SELECT revision INTO v_rev FROM @schema@.resources WHERE id = p_resource;
        IF v_rev <> p_expected_revision THEN
            RAISE EXCEPTION 'resource % is at revision %, expected %',
                p_resource, v_rev, p_expected_revision
                USING ERRCODE = 'PGL02', DETAIL = v_rev::text;
        END IF;
    END IF;
END $$;

CREATE FUNCTION @schema@._check_current(
    l @schema@.leases, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF l.owner_id IS NULL OR l.owner_type <> p_owner_type OR l.owner_id <> p_owner_id
       OR l.generation <> p_generation OR l.token_sha256 <> p_token_sha256 THEN
        RAISE EXCEPTION 'lease generation % of %:% on % is no longer current (current generation %)',
            p_generation, p_owner_type, p_owner_id, l.resource_id, l.generation
            USING ERRCODE = 'PGL03';
    END IF;
END $$;

CREATE FUNCTION @schema@._bump(
    p_resource text, p_now timestamptz, p_type text, p_actor_type text, p_actor_id text,
    p_generation bigint, p_expires_at timestamptz, p_payload_sha256 bytea,
    OUT revision bigint, OUT event_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    UPDATE @schema@.resources SET revision = revision + 1, updated_at = p_now
        WHERE id = p_resource RETURNING resources.revision INTO _bump.revision;
    INSERT INTO @schema@.events (resource_id, revision, type, actor_type, actor_id,
                                 lease_generation, lease_expires_at, payload_sha256, created_at)
        VALUES (p_resource, _bump.revision, p_type, p_actor_type, p_actor_id,
                p_generation, p_expires_at, p_payload_sha256, p_now)
        RETURNING events.id INTO _bump.event_id;
END $$;

CREATE FUNCTION @schema@.claim(
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
    claimed := true;
    generation := l.generation + 1;
    expires_at := v_now + make_interval(secs => p_ttl);
    holder_type := p_owner_type;
    holder_id := p_owner_id;
    UPDATE @schema@.leases SET generation = claim.generation, owner_type = p_owner_type,
        owner_id = p_owner_id, token_sha256 = p_token_sha256, acquired_at = v_now,
        heartbeat_at = v_now, expires_at = claim.expires_at
        WHERE resource_id = p_resource;
    SELECT b.revision INTO revision FROM @schema@._bump(p_resource, v_now, 'lease.claimed',
        p_owner_type, p_owner_id, claim.generation, claim.expires_at, NULL) b;
END $$;

CREATE FUNCTION @schema@.renew(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_ttl double precision, p_expected_revision bigint,
    p_now timestamptz, OUT expires_at timestamptz, OUT revision bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
BEGIN
    l := @schema@._lock_lease(p_resource);
    PERFORM @schema@._check_current(l, p_owner_type, p_owner_id, p_generation, p_token_sha256);
    PERFORM @schema@._check_revision(p_resource, p_expected_revision);
    v_now := coalesce(p_now, clock_timestamp());
    IF l.expires_at <= v_now THEN
        RAISE EXCEPTION 'lease generation % on % expired at %', l.generation, p_resource,
            l.expires_at USING ERRCODE = 'PGL04';
    END IF;
    expires_at := v_now + make_interval(secs => p_ttl);
    UPDATE @schema@.leases SET heartbeat_at = v_now, expires_at = renew.expires_at
        WHERE resource_id = p_resource;
    SELECT b.revision INTO revision FROM @schema@._bump(p_resource, v_now, 'lease.renewed',
        p_owner_type, p_owner_id, p_generation, renew.expires_at, NULL) b;
END $$;

CREATE FUNCTION @schema@.release(
    p_resource text, p_owner_type text, p_owner_id text, p_generation bigint,
    p_token_sha256 bytea, p_expected_revision bigint, p_now timestamptz,
    OUT revision bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
BEGIN
    l := @schema@._lock_lease(p_resource);
    PERFORM @schema@._check_current(l, p_owner_type, p_owner_id, p_generation, p_token_sha256);
    PERFORM @schema@._check_revision(p_resource, p_expected_revision);
    v_now := coalesce(p_now, clock_timestamp());
    UPDATE @schema@.leases SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL,
        expires_at = NULL, heartbeat_at = v_now
        WHERE resource_id = p_resource;
    SELECT b.revision INTO revision FROM @schema@._bump(p_resource, v_now, 'lease.released',
        p_owner_type, p_owner_id, p_generation, NULL, NULL) b;
END $$;

-- First statement of a mutation's transaction: checks the permit under the row
-- lock, stores the payload, bumps the revision and appends the event. The
-- caller's own SQL runs afterwards in the same transaction, still under the lock.
CREATE FUNCTION @schema@.mutate_begin(
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
        INSERT INTO @schema@.payloads (sha256, body) VALUES (mutate_begin.payload_sha256, p_payload)
            ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            SELECT body INTO v_body FROM @schema@.payloads WHERE sha256 = mutate_begin.payload_sha256;
            IF v_body IS DISTINCT FROM p_payload THEN
                RAISE EXCEPTION 'payload % is stored with different bytes',
                    encode(mutate_begin.payload_sha256, 'hex') USING ERRCODE = 'PGL06';
            END IF;
        END IF;
    END IF;
    SELECT b.revision, b.event_id INTO revision, event_id
      FROM @schema@._bump(p_resource, v_now, p_event_type, p_actor_type, p_actor_id,
                          CASE WHEN p_token_sha256 IS NULL THEN NULL ELSE p_generation END,
                          NULL, mutate_begin.payload_sha256) b;
END $$;
