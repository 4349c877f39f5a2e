-- Import chunks as single statements: session_import_chunk and
-- session_import_registers (sql/functions/40_sessions.sql).
--
-- A chunk of an import (0013) used to be a transaction of several round trips:
-- the token check, then the rows, then COMMIT. On a CPU-starved client host
-- the server spent most of a slow chunk waiting for the client's next
-- message with the transaction open and its xid held (longest chunks of
-- 235-606 ms at 1,000,000 entries, bench/RESULTS-sessions.md run 6), holding
-- back the snapshot xmin that every watcher of the cluster reads below. Now
-- the client reads what the branch index needs first (plain reads, no xid),
-- computes the chunk, and sends it as one call in autocommit: the function
-- checks the import token, moves `import_touched_at` and writes every row,
-- and the transaction ends with the statement.
--
-- The function bodies live in sql/functions/ (applied after the migrations);
-- clients get EXECUTE on the two entry points (pglease/roles.py, re-granted
-- to recorded roles by this upgrade). Their helpers are the owner's alone.
-- The import state the functions check needs no new column; this records,
-- in the database itself, what the token columns are now checked by.
COMMENT ON COLUMN @schema@.sessions.import_token IS
    'hidden import or delete in progress: the importer''s token, checked by every chunk (session_import_chunk, session_import_registers); NULL once visible';
COMMENT ON COLUMN @schema@.sessions.import_touched_at IS
    'database time of the import''s last chunk: cleanup_imports and the next import of this id judge staleness by it';
