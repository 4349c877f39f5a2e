-- watch_read's query depends on nothing its arguments could change (an index
-- range scan on events (xid, id)), yet PL/pgSQL kept re-planning it as a
-- custom plan on every call: a watcher's read cost several times a write.
ALTER FUNCTION @schema@.watch_read(xid8, bigint, xid8, bigint, integer)
    SET plan_cache_mode = force_generic_plan;
