-- Fence at commit: a fenced mutation whose lease expires before its
-- transaction commits is refused at COMMIT.
--
-- mutate_begin checks the lease when the transaction starts; the caller's own
-- SQL runs afterwards, for as long as it takes, under the lease row lock. A
-- holder that stalls there past its TTL would otherwise commit a write of
-- generation g after g expired. A deferred constraint trigger on the event a
-- fenced mutation appends (lease_generation set, not a lease.* event) checks
-- the lease again at commit time by the database clock.
--
-- The trigger's function is defined in sql/functions/10_core.sql (applied
-- right after the migrations, in the same transaction); this placeholder only
-- lets the trigger be created here.
CREATE FUNCTION @schema@._fence_at_commit() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER events_fence_at_commit
    AFTER INSERT ON @schema@.events
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.lease_generation IS NOT NULL AND NEW.type NOT LIKE 'lease.%')
    EXECUTE FUNCTION @schema@._fence_at_commit();
