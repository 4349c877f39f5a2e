"""The store driver's named SQL statements, composed once per schema.

Every statement the PostgreSQL store driver sends (besides the prepared fast
path of claim, renew and release in `_fastpath`) is an attribute here, so the
text of a call is in one place and rendered by the one schema renderer.
"""

from __future__ import annotations

from ._sqltext import for_schema


class Queries:
    """The SQL of one schema, composed once per store."""

    def __init__(self, schema: str):
        q = for_schema(schema)
        self.ensure = q("SELECT {s}.ensure_resource(%s, %s)")
        self.claim = q(
            "SELECT * FROM {s}.claim(%s, %s, %s, %s, %s::float8, %s::bigint, %s::timestamptz)"
        )
        self.renew = q(
            "SELECT * FROM {s}.renew(%s, %s, %s, %s::bigint, %s, %s::float8, %s::bigint,"
            " %s::timestamptz)"
        )
        self.release = q(
            "SELECT * FROM {s}.release(%s, %s, %s, %s::bigint, %s, %s::bigint, %s::timestamptz)"
        )
        # The batches (sql/functions/15_batch.sql): one row per item, `ord` its
        # 1-based position in the arrays sent.
        self.claim_many = q(
            "SELECT ord, claimed, generation, expires_at, revision FROM {s}.claim_many("
            "%s::text[], %s, %s, %s::bytea[], %s::float8, %s::timestamptz)"
        )
        self.renew_many = q(
            "SELECT ord, expires_at, revision, error_code, error_message FROM {s}.renew_many("
            "%s::text[], %s::text[], %s::text[], %s::bigint[], %s::bytea[], %s::float8,"
            " %s::timestamptz)"
        )
        self.release_many = q(
            "SELECT ord, revision, error_code, error_message FROM {s}.release_many("
            "%s::text[], %s::text[], %s::text[], %s::bigint[], %s::bytea[], %s::timestamptz)"
        )
        # Read after the function ran (its FROM item is evaluated first): the
        # seconds a fenced mutation's lease had left, set by _bound_by_lease.
        self.mutate_begin = q(
            "SELECT b.revision, b.event_id, current_setting('pglease.lease_left', true)"
            " FROM {s}.mutate_begin(%s, %s::bigint, %s, %s, %s, %s::bigint, %s, %s, %s,"
            " %s, %s::timestamptz) b"
        )
        # `held` is judged once per statement by `_clock_now`: the database
        # clock, or a test time where the schema's owner switched that on.
        resource_cols = (
            "r.id, r.type, r.key, coalesce(l.revision, r.revision), r.created_at,"
            " coalesce(l.updated_at, r.updated_at), l.generation,"
            " l.owner_type, l.owner_id, l.acquired_at, l.heartbeat_at, l.expires_at,"
            " (l.owner_id IS NOT NULL AND l.expires_at > c.now),"
            " CASE WHEN l.owner_id IS NULL AND l.revoked_until > c.now THEN l.revoked_until END"
        )
        resource_from = (
            " FROM (SELECT {s}._clock_now(%s::timestamptz) AS now) c"
            " CROSS JOIN {s}.resources r JOIN {s}.leases l ON l.resource_id = r.id"
        )
        self.get = q("SELECT " + resource_cols + resource_from + " WHERE r.id = %s")
        self.list_all = q("SELECT " + resource_cols + resource_from + " ORDER BY r.type, r.key")
        self.list_type = q(
            "SELECT " + resource_cols + resource_from + " WHERE r.type = %s ORDER BY r.key"
        )
        event_cols = (
            "SELECT e.id, e.xid::text, e.resource_id, r.type, r.key, e.revision, e.type,"
            " e.actor_type, e.actor_id, e.lease_generation, e.lease_expires_at, p.body,"
            " e.payload_sha256, e.created_at FROM {s}.events e"
            " JOIN {s}.resources r ON r.id = e.resource_id"
            " LEFT JOIN {s}.payloads p ON p.sha256 = e.payload_sha256"
        )
        self.resource_exists = q("SELECT 1 FROM {s}.resources WHERE id = %s")
        self.events_of = q(
            event_cols + " WHERE e.resource_id = %s AND e.revision > %s"
            " ORDER BY e.revision LIMIT %s"
        )
