-- Watch wake-ups, second version (0002's _bump tried key 1 before key 2).
--
-- 0002 let a writer that lost key 1 take key 2 afterwards. In the instants
-- between the two calls a notifier could commit and a watcher's probe run and
-- find key 2 free, so that writer's event could wait for the fallback poll.
-- Taking key 2 first closes that window: see the proof in
-- pglease/watch/__init__.py. Same signature and behaviour otherwise.

CREATE OR REPLACE FUNCTION @schema@._bump(
    p_resource text, p_now timestamptz, p_type text, p_actor_type text, p_actor_id text,
    p_generation bigint, p_expires_at timestamptz, p_payload_sha256 bytea,
    OUT revision bigint, OUT event_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_prev xid8;
    v_marked boolean;
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
    -- Every writer takes key 2 (shared, to its commit) BEFORE it tries key 1,
    -- so a watcher's probe (watch_read) sees every writer that may be relying
    -- on someone else's NOTIFY, even one whose xid is above the probe's
    -- snapshot xmax. Key 1 elects the one in-flight writer that notifies. A
    -- writer that cannot get key 2 (a probe holds it for an instant)
    -- notifies itself.
    v_marked := pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'), hashtext('@schema@'));
    IF NOT v_marked
       OR pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@')) THEN
        PERFORM pg_notify(left('pglease_@schema@', 63), '');
    END IF;
END $$;
