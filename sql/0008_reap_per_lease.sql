-- The reaper's unit of work: one lease per transaction.
--
-- reap_expired (0002) writes a whole batch in one transaction, whose xid is
-- taken when it locks the first lease. A write to a later lease of the batch
-- that commits in between carries a larger xid, so the batch's event for that
-- lease would sort before it: _bump's order guard refuses it and the whole
-- batch rolls back until the next pass. reap_next reaps one lease and is
-- called once per transaction; like every other writer it takes the
-- resource's advisory lock before its first write (so before it has an xid),
-- but it never waits: a resource a writer is busy with is left to the next
-- pass, and that writer, if it takes over, records the expiry itself (0007).
--
-- Candidates are taken in resource order after p_after, so a caller looping
-- with the last returned resource visits each at most once per pass. Returns
-- (NULL, false) when there is no candidate left.
CREATE FUNCTION @schema@.reap_next(
    p_after text, OUT lease_resource text, OUT reaped boolean)
LANGUAGE plpgsql AS $$
DECLARE
    l @schema@.leases%ROWTYPE;
    v_now timestamptz;
BEGIN
    reaped := false;
    SELECT c.resource_id INTO lease_resource FROM @schema@.leases c
     WHERE c.owner_id IS NOT NULL AND c.expires_at <= clock_timestamp()
       AND c.expired_generation IS DISTINCT FROM c.generation
       AND c.resource_id > p_after
     ORDER BY c.resource_id LIMIT 1;
    IF lease_resource IS NULL
       OR NOT pg_try_advisory_xact_lock(1886152037, hashtext(lease_resource)) THEN
        RETURN;
    END IF;
    SELECT * INTO l FROM @schema@.leases c
     WHERE c.resource_id = lease_resource FOR UPDATE SKIP LOCKED;
    v_now := clock_timestamp();
    -- Re-checked under the locks: renewed, released or taken over meanwhile?
    IF NOT FOUND OR l.owner_id IS NULL OR l.expires_at > v_now
       OR l.expired_generation IS NOT DISTINCT FROM l.generation THEN
        RETURN;
    END IF;
    UPDATE @schema@.leases c SET expired_generation = l.generation
     WHERE c.resource_id = lease_resource;
    PERFORM @schema@._bump(lease_resource, v_now, 'lease.expired', l.owner_type, l.owner_id,
                           l.generation, l.expires_at, NULL);
    reaped := true;
END $$;
