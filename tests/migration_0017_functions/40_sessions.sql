-- pglease session functions: the chunks of a session import
-- (sql/0015_session_import_chunks.sql says why they exist).
--
-- Error codes (class "PL"), mapped to Python in pglease/sessions/pg_core.py:
--   PGL30 the import is gone (its token no longer matches: taken over, removed or finished)
--   PGL31 invalid chunk arguments

-- Argument checks shared by both chunk functions: the session and token, and
-- the arrays of one row set (all of one length, within `p_max`).
CREATE OR REPLACE FUNCTION @schema@._check_import_args(
    p_session text, p_token text, p_what text, p_lengths integer[], p_max integer
) RETURNS integer LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer := p_lengths[1];
BEGIN
    IF p_session IS NULL OR p_session = '' OR p_token IS NULL OR p_token = '' THEN
        RAISE EXCEPTION 'an import chunk needs a session id and an import token'
            USING ERRCODE = 'PGL31';
    END IF;
    -- A NULL array has a NULL length; an empty one has length 0 (cardinality).
    IF array_position(p_lengths, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'import chunk of session %: the % arrays must not be NULL',
            quote_literal(left(p_session, 120)), p_what USING ERRCODE = 'PGL31';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_lengths) AS l(len) WHERE l.len <> n) THEN
        RAISE EXCEPTION 'import chunk of session %: the % arrays differ in length (%)',
            quote_literal(left(p_session, 120)), p_what, array_to_string(p_lengths, ', ')
            USING ERRCODE = 'PGL31';
    END IF;
    IF n > p_max THEN
        RAISE EXCEPTION 'import chunk of session %: % % rows; at most % fit in one chunk',
            quote_literal(left(p_session, 120)), n, p_what, p_max USING ERRCODE = 'PGL31';
    END IF;
    RETURN n;
END $$;

-- The token check of every chunk: moves the import's progress time (the
-- database clock; cleanup_imports and the next import judge staleness by it)
-- and locks the session row until the chunk commits, so a cleanup that would
-- take the import over waits for this chunk and then sees it fresh.
CREATE OR REPLACE FUNCTION @schema@._touch_import(p_session text, p_token text)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE @schema@.sessions s SET import_touched_at = clock_timestamp()
     WHERE s.id = p_session AND s.import_token = p_token;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the import of session % was removed while it ran (a cleanup took it for abandoned: no chunk within the stale limit); nothing of it is visible',
            p_session USING ERRCODE = 'PGL30';
    END IF;
END $$;

-- One chunk of entries with their branch-index rows, in one statement: the
-- client computed the branch index from reads of earlier chunks (this
-- import's token keeps every other writer out of the hidden session) and sends
-- the result here, so the transaction never waits on the client. Arrays by
-- column: entries; new segments; tip moves of earlier chunks' segments;
-- branch-index rows. Returns the number of entries written.
CREATE OR REPLACE FUNCTION @schema@.session_import_chunk(
    p_session text, p_token text,
    p_ids text[], p_parent_ids text[], p_seqs bigint[], p_types text[],
    p_custom_types text[], p_timestamps bigint[], p_payloads text[],
    p_seg_ids text[], p_seg_tips text[], p_seg_tip_seqs bigint[],
    p_seg_bases text[], p_seg_base_seqs bigint[],
    p_move_ids text[], p_move_tips text[], p_move_tip_seqs bigint[],
    p_row_branches text[], p_row_entries text[], p_row_seqs bigint[], p_row_types text[]
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
    moved integer;
    what text := 'import chunk of session ' || quote_literal(left(p_session, 120));
BEGIN
    -- Entries per chunk: the Python side's limit (check_chunk_size). Segments
    -- and tip moves are at most one per entry; a divergence copies the path
    -- since its newest compaction, hence the larger bound on branch rows.
    n := @schema@._check_import_args(p_session, p_token, 'entry', ARRAY[
        cardinality(p_ids), cardinality(p_parent_ids), cardinality(p_seqs),
        cardinality(p_types), cardinality(p_custom_types), cardinality(p_timestamps),
        cardinality(p_payloads)], 1000000);
    PERFORM @schema@._check_import_args(p_session, p_token, 'segment', ARRAY[
        cardinality(p_seg_ids), cardinality(p_seg_tips), cardinality(p_seg_tip_seqs),
        cardinality(p_seg_bases), cardinality(p_seg_base_seqs)], n);
    PERFORM @schema@._check_import_args(p_session, p_token, 'tip move', ARRAY[
        cardinality(p_move_ids), cardinality(p_move_tips), cardinality(p_move_tip_seqs)], n);
    PERFORM @schema@._check_import_args(p_session, p_token, 'branch row', ARRAY[
        cardinality(p_row_branches), cardinality(p_row_entries), cardinality(p_row_seqs),
        cardinality(p_row_types)], 10000000);
    IF array_position(p_ids, NULL) IS NOT NULL OR array_position(p_seqs, NULL) IS NOT NULL
       OR array_position(p_types, NULL) IS NOT NULL
       OR array_position(p_timestamps, NULL) IS NOT NULL
       OR array_position(p_payloads, NULL) IS NOT NULL THEN
        RAISE EXCEPTION '%: an entry id, seq, type, timestamp or payload is NULL', what
            USING ERRCODE = 'PGL31';
    END IF;
    IF array_position(p_seg_ids, NULL) IS NOT NULL OR array_position(p_seg_tips, NULL) IS NOT NULL
       OR array_position(p_seg_tip_seqs, NULL) IS NOT NULL
       OR array_position(p_move_ids, NULL) IS NOT NULL
       OR array_position(p_move_tips, NULL) IS NOT NULL
       OR array_position(p_move_tip_seqs, NULL) IS NOT NULL
       OR array_position(p_row_branches, NULL) IS NOT NULL
       OR array_position(p_row_entries, NULL) IS NOT NULL
       OR array_position(p_row_seqs, NULL) IS NOT NULL
       OR array_position(p_row_types, NULL) IS NOT NULL THEN
        RAISE EXCEPTION '%: a segment, tip move or branch row has a NULL id, tip or seq', what
            USING ERRCODE = 'PGL31';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_seg_bases, p_seg_base_seqs) AS b(base, seq)
                WHERE (b.base IS NULL) <> (b.seq IS NULL)) THEN
        RAISE EXCEPTION '%: a segment base needs both its branch and its seq', what
            USING ERRCODE = 'PGL31';
    END IF;

    PERFORM @schema@._touch_import(p_session, p_token);
    -- The order of the buffered index writes (pg_core.IndexCore.pending):
    -- new segments, tip moves, rows; then the entries.
    INSERT INTO @schema@.session_branch_meta
        (session_id, branch_id, tip_entry_id, tip_seq, base_branch_id, base_seq)
    SELECT p_session, u.* FROM unnest(p_seg_ids, p_seg_tips, p_seg_tip_seqs,
                                      p_seg_bases, p_seg_base_seqs) AS u;
    UPDATE @schema@.session_branch_meta m SET tip_entry_id = u.tip, tip_seq = u.tip_seq
      FROM unnest(p_move_ids, p_move_tips, p_move_tip_seqs) AS u(branch_id, tip, tip_seq)
     WHERE m.session_id = p_session AND m.branch_id = u.branch_id;
    GET DIAGNOSTICS moved = ROW_COUNT;
    IF moved <> cardinality(p_move_ids) THEN
        RAISE EXCEPTION '%: % of % tip moves found no segment', what,
            cardinality(p_move_ids) - moved, cardinality(p_move_ids) USING ERRCODE = 'PGL31';
    END IF;
    INSERT INTO @schema@.session_branch_entries
        (session_id, branch_id, entry_id, entry_seq, entry_type)
    SELECT p_session, u.* FROM unnest(p_row_branches, p_row_entries, p_row_seqs,
                                      p_row_types) AS u;
    INSERT INTO @schema@.session_entries
        (session_id, id, parent_id, seq, type, custom_type, timestamp, payload)
    SELECT p_session, u.* FROM unnest(p_ids, p_parent_ids, p_seqs, p_types, p_custom_types,
                                      p_timestamps, p_payloads) AS u;
    RETURN n;
END $$;

-- One chunk of an import's registers (the session's last rows before the
-- final fenced step), in one statement, like session_import_chunk.
CREATE OR REPLACE FUNCTION @schema@.session_import_registers(
    p_session text, p_token text,
    p_namespaces text[], p_keys text[], p_seqs bigint[], p_values text[]
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
    what text := 'import chunk of session ' || quote_literal(left(p_session, 120));
BEGIN
    n := @schema@._check_import_args(p_session, p_token, 'register', ARRAY[
        cardinality(p_namespaces), cardinality(p_keys), cardinality(p_seqs),
        cardinality(p_values)], 1000000);
    IF array_position(p_namespaces, NULL) IS NOT NULL OR array_position(p_keys, NULL) IS NOT NULL
       OR array_position(p_seqs, NULL) IS NOT NULL OR array_position(p_values, NULL) IS NOT NULL
    THEN
        RAISE EXCEPTION '%: a register namespace, key, seq or value is NULL', what
            USING ERRCODE = 'PGL31';
    END IF;
    -- ON CONFLICT cannot update one row twice in a statement: refuse that by name.
    IF (SELECT count(DISTINCT (u.ns, u.key)) FROM unnest(p_namespaces, p_keys) AS u(ns, key)) <> n
    THEN
        RAISE EXCEPTION '%: a register (namespace, key) appears twice', what
            USING ERRCODE = 'PGL31';
    END IF;
    PERFORM @schema@._touch_import(p_session, p_token);
    INSERT INTO @schema@.session_registers (session_id, namespace, key, seq, value)
    SELECT p_session, u.* FROM unnest(p_namespaces, p_keys, p_seqs, p_values) AS u
        ON CONFLICT (session_id, namespace, key)
        DO UPDATE SET seq = excluded.seq, value = excluded.value;
    RETURN n;
END $$;
