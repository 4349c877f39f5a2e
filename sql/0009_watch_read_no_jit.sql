-- watch_read's generic plan (0003) is costed for millions of rows: its LIMIT
-- is a parameter, so the planner cannot see that a read returns at most a
-- page. On a server built with LLVM (Debian's and most distributions'
-- packages) that cost is far above jit_above_cost, and every read was JIT
-- compiled: about 200 ms of inlining and optimisation for a read that runs in
-- 2 ms. Measured on PostgreSQL 15: one watcher halved the writers' throughput.
-- A read is always small, so it never pays to compile it.
ALTER FUNCTION @schema@.watch_read(xid8, bigint, xid8, bigint, integer) SET jit = off;
