-- Chunked imports: a session written in many short transactions stays hidden
-- until the last one.
--
-- An import inserts its session row with an `import_token` (the importer's
-- own random id) and writes entries, branch-index rows and registers in
-- chunks, each its own short transaction (a long one would hold back
-- pg_snapshot_xmin, and with it every watcher of the cluster). Listings,
-- opens, reads and deletes only see rows whose `import_token` is NULL; the
-- final fenced mutation sets it to NULL, so the session appears complete or
-- not at all. Every chunk checks the token and moves `import_touched_at` (the
-- database clock): a partial whose importer died stops moving, and a cleanup
-- or the next import of that id takes it over (by changing the token) and
-- removes it, again in chunks.
ALTER TABLE @schema@.sessions
    ADD COLUMN import_token text COLLATE "C",
    ADD COLUMN import_touched_at timestamptz,
    ADD CONSTRAINT sessions_import_state CHECK ((import_token IS NULL) = (import_touched_at IS NULL));
CREATE INDEX sessions_imports ON @schema@.sessions (import_touched_at)
    WHERE import_token IS NOT NULL;
