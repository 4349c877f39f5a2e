"""The SQL of the PostgreSQL session stores: every statement, schema-qualified
once per store (`Sql(schema)`), shared by the blocking and asyncio flavours."""

from __future__ import annotations

from psycopg import sql


class Sql:
    """The session SQL of one schema, composed once per repository."""

    def __init__(self, schema: str) -> None:
        s = sql.Identifier(schema)

        def q(text: str) -> bytes:
            return sql.SQL(text).format(s=s).as_string(None).encode()

        entry_cols = "id, parent_id, seq, type, custom_type, timestamp, payload"
        seg_cols = "branch_id, tip_entry_id, tip_seq, base_branch_id, base_seq"
        self.read_only = q("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        session_cols = (
            "created_at, parent_session_id, storage_version, message_count, usage_payload, next_seq"
        )
        self.session_row = q(
            f"SELECT {session_cols} FROM {{s}}.sessions WHERE id = %s AND import_token IS NULL"
        )
        self.lock_session = q(
            "SELECT next_seq, message_count, usage_payload,"
            " (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
            " FROM {s}.sessions WHERE id = %s AND import_token IS NULL FOR UPDATE"
        )
        self.update_session = q(
            "UPDATE {s}.sessions SET next_seq = %s, message_count = %s, usage_payload = %s"
            " WHERE id = %s"
        )
        self.insert_session = q(
            "INSERT INTO {s}.sessions (id, resource_id, created_at, parent_session_id,"
            " storage_version, metadata, message_count, usage_payload, next_seq)"
            " VALUES (%s, %s, coalesce(%s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint),"
            " %s, %s, NULL, %s, %s, %s) ON CONFLICT DO NOTHING"
        )
        self.session_exists = q(
            "SELECT storage_version FROM {s}.sessions WHERE id = %s AND import_token IS NULL"
        )
        self.entry_count = q("SELECT count(*) FROM {s}.session_entries WHERE session_id = %s")
        self.insert_entry = q(
            f"INSERT INTO {{s}}.session_entries (session_id, {entry_cols})"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
        )
        self.get_entry = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s AND id = %s"
        )
        self.entries_by_ids = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s AND id = ANY(%s)"
        )
        self.known_entries = q(
            "SELECT id, seq FROM {s}.session_entries WHERE session_id = %s AND id = ANY(%s)"
        )
        self.known_usage = q(
            "SELECT id FROM {s}.session_usage_ledger WHERE session_id = %s AND id = ANY(%s)"
        )
        self.scan_entries = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s AND seq > %s"
            " AND (%s::text[] IS NULL OR type = ANY(%s::text[])) ORDER BY seq LIMIT %s"
        )
        self.all_entries = q(
            f"SELECT {entry_cols} FROM {{s}}.session_entries WHERE session_id = %s ORDER BY seq"
        )
        self.upsert_register = q(
            "INSERT INTO {s}.session_registers (session_id, namespace, key, seq, value)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (session_id, namespace, key)"
            " DO UPDATE SET seq = excluded.seq, value = excluded.value"
        )
        self.delete_register = q(
            "DELETE FROM {s}.session_registers WHERE session_id = %s AND namespace = %s"
            " AND key = %s"
        )
        self.get_register = q(
            "SELECT namespace, key, seq, value FROM {s}.session_registers"
            " WHERE session_id = %s AND namespace = %s AND key = %s"
        )
        self.list_registers = q(
            "SELECT namespace, key, seq, value FROM {s}.session_registers"
            " WHERE session_id = %s AND namespace = %s AND key >= %s AND starts_with(key, %s)"
            " ORDER BY key"
        )
        self.all_registers = q(
            "SELECT namespace, key, seq, value FROM {s}.session_registers"
            " WHERE session_id = %s ORDER BY namespace, key"
        )
        usage_cols = "id, seq, entry_id, adjustment, usage, details"
        self.insert_usage = q(
            f"INSERT INTO {{s}}.session_usage_ledger (session_id, {usage_cols})"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)"
        )
        self.usage_rows = q(
            f"SELECT {usage_cols} FROM {{s}}.session_usage_ledger WHERE session_id = %s"
            " ORDER BY seq"
        )
        # -- branch index
        self.segment = q(
            f"SELECT {seg_cols} FROM {{s}}.session_branch_meta"
            " WHERE session_id = %s AND branch_id = %s"
        )
        self.segments_by_tips = q(
            f"SELECT {seg_cols} FROM {{s}}.session_branch_meta"
            " WHERE session_id = %s AND tip_entry_id = ANY(%s)"
        )
        self.segment_by_tip = q(
            f"SELECT {seg_cols} FROM {{s}}.session_branch_meta"
            " WHERE session_id = %s AND tip_entry_id = %s"
        )
        self.covering_segment = q(
            "SELECT m.branch_id, m.tip_entry_id, m.tip_seq, m.base_branch_id, m.base_seq"
            " FROM {s}.session_branch_entries AS e JOIN {s}.session_branch_meta AS m"
            " ON m.session_id = e.session_id AND m.branch_id = e.branch_id"
            " WHERE e.session_id = %s AND e.entry_id = %s AND coalesce(m.base_seq, 0) < %s"
            " AND %s <= m.tip_seq ORDER BY m.tip_seq DESC, m.branch_id LIMIT 1"
        )
        self.newest_row_of_type = q(
            "SELECT entry_id, entry_seq, entry_type FROM {s}.session_branch_entries"
            " WHERE session_id = %s AND branch_id = %s AND entry_type = %s"
            " AND entry_seq > %s AND entry_seq <= %s ORDER BY entry_seq DESC LIMIT 1"
        )
        be_where = (
            " WHERE be.session_id = %s AND be.branch_id = %s AND be.entry_seq > %s"
            " AND be.entry_seq <= %s"
        )
        self.rows = {
            order: q(
                "SELECT be.entry_id, be.entry_seq, be.entry_type"
                " FROM {s}.session_branch_entries AS be"
                + be_where
                + f" ORDER BY be.entry_seq {order} LIMIT %s"
            )
            for order in ("ASC", "DESC")
        }
        self.rows_with_entries = {
            order: q(
                "SELECT be.entry_id, be.entry_seq, be.entry_type, x.id, x.parent_id, x.seq,"
                " x.type, x.custom_type, x.timestamp, x.payload"
                " FROM {s}.session_branch_entries AS be"
                " LEFT JOIN {s}.session_entries AS x"
                " ON x.session_id = be.session_id AND x.id = be.entry_id"
                + be_where
                + f" ORDER BY be.entry_seq {order} LIMIT %s"
            )
            for order in ("ASC", "DESC")
        }
        self.insert_segment = q(
            f"INSERT INTO {{s}}.session_branch_meta (session_id, {seg_cols})"
            " VALUES (%s, %s, %s, %s, %s, %s)"
        )
        self.move_tip = q(
            "UPDATE {s}.session_branch_meta SET tip_entry_id = %s, tip_seq = %s"
            " WHERE session_id = %s AND branch_id = %s"
        )
        self.insert_branch_row = q(
            "INSERT INTO {s}.session_branch_entries"
            " (session_id, branch_id, entry_id, entry_seq, entry_type) VALUES (%s, %s, %s, %s, %s)"
        )
        # -- listing: the live lease only (owner recorded and unexpired by the DB clock)
        self.list_sessions = q(
            "SELECT s.id, s.created_at, s.parent_session_id, s.storage_version, s.message_count,"
            " s.usage_payload, s.next_seq, l.owner_id, l.generation,"
            " (extract(epoch FROM l.expires_at) * 1000)::bigint"
            " FROM {s}.sessions AS s LEFT JOIN {s}.leases AS l ON l.resource_id = s.resource_id"
            " AND l.owner_id IS NOT NULL AND l.expires_at > clock_timestamp()"
            " WHERE s.import_token IS NULL AND (%s::text IS NULL OR s.id = %s)"
        )
        # -- streamed forks and chunked imports (sql/0013_session_imports.sql)
        # A fork reads every row of its cursor: plan for all of them. With the
        # default fraction (0.1) the planner picked a fast-start plan for the
        # path walk that took 1.59 s instead of 15 ms on a 5,000-entry branch.
        self.read_whole_cursor = q("SET LOCAL cursor_tuple_fraction = 1")
        self.path_entries = q(
            "WITH RECURSIVE path (id, parent_id, seq) AS ("
            " SELECT id, parent_id, seq FROM {s}.session_entries WHERE session_id = %s AND id = %s"
            " UNION ALL SELECT e.id, e.parent_id, e.seq FROM path AS p"
            " JOIN {s}.session_entries AS e"
            " ON e.session_id = %s AND e.id = p.parent_id AND e.seq < p.seq)"
            " SELECT x.id, x.parent_id, x.seq, x.type, x.custom_type, x.timestamp, x.payload"
            " FROM path JOIN {s}.session_entries AS x ON x.session_id = %s AND x.id = path.id"
            " ORDER BY x.seq"
        )
        self.begin_import = q(
            "INSERT INTO {s}.sessions (id, resource_id, created_at, parent_session_id,"
            " storage_version, metadata, message_count, usage_payload, next_seq,"
            " import_token, import_touched_at)"
            " VALUES (%s, %s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint, %s, %s,"
            " NULL, 0, %s, 1, %s, clock_timestamp()) ON CONFLICT DO NOTHING"
        )
        self.import_state = q(
            "SELECT import_token IS NOT NULL,"
            " extract(epoch FROM clock_timestamp() - import_touched_at)::float8"
            " FROM {s}.sessions WHERE id = %s"
        )
        self.touch_import = q(
            "UPDATE {s}.sessions SET import_touched_at = clock_timestamp()"
            " WHERE id = %s AND import_token = %s RETURNING 1"
        )
        self.take_import = q(
            "UPDATE {s}.sessions SET import_token = %s, import_touched_at = clock_timestamp()"
            " WHERE id = %s AND import_token IS NOT NULL"
            " AND import_touched_at <= clock_timestamp() - make_interval(secs => %s)"
            " RETURNING 1"
        )
        self.stale_imports = q(
            "SELECT id, extract(epoch FROM clock_timestamp() - import_touched_at)::float8"
            " FROM {s}.sessions WHERE import_token IS NOT NULL"
            " AND import_touched_at <= clock_timestamp() - make_interval(secs => %s)"
            " AND (%s::text IS NULL OR id = %s) ORDER BY import_touched_at, id"
        )
        self.purge_rows = [
            q(
                f"DELETE FROM {{s}}.{table} WHERE ctid = ANY(ARRAY("
                f"SELECT ctid FROM {{s}}.{table} WHERE session_id = %s LIMIT %s))"
            )
            for table in (
                "session_branch_entries",
                "session_branch_meta",
                "session_registers",
                "session_usage_ledger",
                "session_entries",
            )
        ]
        # A chunked delete hides the session the way an import is hidden (a
        # token of its own) inside its fenced `session.deleted` mutation, then
        # removes the rows like a failed import's purge.
        self.hide_session = q(
            "UPDATE {s}.sessions SET import_token = %s, import_touched_at = clock_timestamp()"
            " WHERE id = %s AND import_token IS NULL RETURNING 1"
        )
        self.drop_import = q("DELETE FROM {s}.sessions WHERE id = %s AND import_token = %s")
        self.finish_import = q(
            "UPDATE {s}.sessions SET import_token = NULL, import_touched_at = NULL,"
            " created_at = coalesce(%s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint),"
            " message_count = %s, next_seq = %s WHERE id = %s AND import_token = %s"
        )
        # -- import chunks as one statement each (sql/0015_session_import_chunks.sql)
        self.import_alive = q("SELECT 1 FROM {s}.sessions WHERE id = %s AND import_token = %s")
        # covering_segment's best on the server, plus the segments among the
        # given ones (those whose tip a chunk moved, unsent) that hold the
        # entry: ChunkIndex judges them with their new tips.
        covering = (
            "SELECT m.branch_id, m.tip_entry_id, m.tip_seq, m.base_branch_id, m.base_seq"
            " FROM {s}.session_branch_entries AS e JOIN {s}.session_branch_meta AS m"
            " ON m.session_id = e.session_id AND m.branch_id = e.branch_id"
            " WHERE e.session_id = %s AND e.entry_id = %s AND coalesce(m.base_seq, 0) < %s"
            " AND %s <= m.tip_seq"
        )
        self.covering_segments = q(
            f"({covering} ORDER BY m.tip_seq DESC, m.branch_id LIMIT 1)"
            f" UNION ({covering} AND m.branch_id = ANY(%s::text[]))"
        )
        # The arrays go in binary (%b): psycopg's text format escapes every
        # element with a regular expression, 10 ms of client CPU for 500 JSON
        # payloads against 0.3 ms in binary.
        self.import_chunk = q(
            "SELECT {s}.session_import_chunk(%s, %s,"
            " %b::text[], %b::text[], %b::bigint[], %b::text[], %b::text[], %b::bigint[],"
            " %b::text[], %b::text[], %b::text[], %b::bigint[], %b::text[], %b::bigint[],"
            " %b::text[], %b::text[], %b::bigint[],"
            " %b::text[], %b::text[], %b::bigint[], %b::text[])"
        )
        self.import_registers = q(
            "SELECT {s}.session_import_registers(%s, %s, %b::text[], %b::text[],"
            " %b::bigint[], %b::text[])"
        )
