"""Migration 0016 (leaner event log): an upgrade with data carries everything
forward and ends in the schema a fresh migration builds."""

from __future__ import annotations

import hashlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pglease.migration_files as migration_files
from pglease.migrations import migrate

TOKEN = hashlib.sha256(b"token").digest()


@pytest.fixture
def other_schema(pg_dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def before_0016(tmp_path: Path) -> Path:
    """A copy of sql/ as it was before 0016: the same files without it."""
    here = migration_files.migrations_dir()
    copy = tmp_path / "sql"
    shutil.copytree(here, copy)
    for path in copy.glob("0016_*.sql"):
        path.unlink()
    return copy


def catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """What a schema is made of, with its name written as @schema@."""

    def rows(query: str) -> list[tuple[Any, ...]]:
        found = conn.execute(query, {"s": schema}).fetchall()
        return sorted(tuple(str(v).replace(schema, "@schema@") for v in r) for r in found)

    return {
        "columns": rows(
            "SELECT table_name, column_name, data_type, is_nullable, column_default,"
            " is_identity FROM information_schema.columns WHERE table_schema = %(s)s"
        ),
        "indexes": rows("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(s)s"),
        "constraints": rows(
            "SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)"
            " FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace"
            " WHERE n.nspname = %(s)s"
        ),
        "triggers": rows(
            "SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid)"
            " FROM pg_trigger t JOIN pg_class k ON k.oid = t.tgrelid"
            " JOIN pg_namespace n ON n.oid = k.relnamespace"
            " WHERE n.nspname = %(s)s AND NOT t.tgisinternal"
        ),
        "replica identity": rows(
            "SELECT k.relname, k.relreplident, coalesce(i.indexrelid::regclass::text, '')"
            " FROM pg_class k JOIN pg_namespace n ON n.oid = k.relnamespace"
            " LEFT JOIN pg_index i ON i.indrelid = k.oid AND i.indisreplident"
            " WHERE n.nspname = %(s)s AND k.relkind = 'r'"
        ),
        "functions": rows(
            "SELECT p.proname, pg_get_function_identity_arguments(p.oid), p.prosrc,"
            " p.prosecdef, p.proconfig FROM pg_proc p JOIN pg_namespace n"
            " ON n.oid = p.pronamespace WHERE n.nspname = %(s)s"
        ),
    }


def write_history(conn: psycopg.Connection[Any], s: str) -> list[str]:
    """Claims, releases, a takeover of an expired lease, a mutation with a
    payload, and one lease still held; returns the resource ids."""
    ids = [
        str(conn.execute(f"SELECT {s}.ensure_resource('job', %s)", [f"k{i}"]).fetchone()[0])  # type: ignore[index]
        for i in range(3)
    ]
    for rid in ids:
        for _ in range(3):
            c = conn.execute(
                f"SELECT claimed, generation FROM {s}.claim(%s, 'host', 'a', %s, 30, NULL, NULL)",
                [rid, TOKEN],
            ).fetchone()
            assert c is not None and c[0]
            conn.execute(
                f"SELECT {s}.release(%s, 'host', 'a', %s, %s, NULL, NULL)", [rid, c[1], TOKEN]
            )
    c = conn.execute(
        f"SELECT generation FROM {s}.claim(%s, 'host', 'a', %s, 30, NULL, NULL)", [ids[0], TOKEN]
    ).fetchone()
    assert c is not None
    with conn.transaction():
        conn.execute(
            f"SELECT * FROM {s}.mutate_begin(%s, NULL, 'job.done', 'host', 'a', %s, %s,"
            " NULL, NULL, %s, NULL)",
            [ids[0], c[0], TOKEN, '{"ok": true}'],
        )
    # An expired holder on ids[1], its expiry not recorded: the next claim
    # writes lease.expired then lease.claimed.
    conn.execute(f"SELECT {s}.claim(%s, 'host', 'b', %s, 0.001, NULL, NULL)", [ids[1], TOKEN])
    conn.execute("SELECT pg_sleep(0.01)")
    return ids


def events(conn: psycopg.Connection[Any], s: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        f"SELECT id, xid::text, resource_id, revision, type, actor_id, lease_generation,"
        f" payload_sha256 FROM {s}.events ORDER BY xid, id"
    ).fetchall()


def state(conn: psycopg.Connection[Any], s: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        f"SELECT r.id, coalesce(l.revision, r.revision), l.generation, l.owner_id,"
        f" l.expired_generation"
        f" FROM {s}.resources r JOIN {s}.leases l ON l.resource_id = r.id ORDER BY r.id"
    ).fetchall()


def test_upgrade_with_data_keeps_it_and_matches_a_fresh_schema(
    pg_dsn: str, schema: str, other_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = before_0016(tmp_path)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with monkeypatch.context() as m:
            m.setattr(migration_files, "migrations_dir", lambda: old)
            migrate(conn, schema)
        before = catalog(conn, schema)
        assert ("@schema@.events", "events_pkey", "PRIMARY KEY (id)") in before["constraints"]
        ids = write_history(conn, schema)
        events_before, state_before = events(conn, schema), state(conn, schema)
        assert len({e[7] for e in events_before if e[7] is not None}) == 1

        applied = migrate(conn, schema)
        assert [a.label for a in applied] == ["0016_event_log_cost"]
        assert events(conn, schema) == events_before
        assert state(conn, schema) == state_before

        migrate(conn, other_schema)
        assert catalog(conn, schema) == catalog(conn, other_schema)
        after = catalog(conn, schema)
        names = {c[1] for c in after["constraints"]}
        assert "events_pkey" not in names and "events_resource_id_fkey" not in names
        assert ("events", "i", "@schema@.events_resource_id_revision_key") in after[
            "replica identity"
        ]

        # The history goes on where it stopped: revisions +1, generations up,
        # ids above every old one, and the takeover records the expiry first.
        s = schema
        rev = {r[0]: r[1] for r in state_before}
        gen = {r[0]: r[2] for r in state_before}
        top_id = max(e[0] for e in events_before)
        conn.execute(f"SELECT {s}.release(%s, 'host', 'a', %s, %s, NULL, NULL)",
                     [ids[0], gen[ids[0]], TOKEN])  # fmt: skip
        c = conn.execute(
            f"SELECT claimed, generation, revision FROM {s}.claim(%s, 'host', 'c', %s, 30,"
            " NULL, NULL)",
            [ids[1], TOKEN],
        ).fetchone()
        assert c == (True, gen[ids[1]] + 1, rev[ids[1]] + 2)
        new = events(conn, schema)[len(events_before) :]
        assert [(e[2], e[3], e[4]) for e in new] == [
            (ids[0], rev[ids[0]] + 1, "lease.released"),
            (ids[1], rev[ids[1]] + 1, "lease.expired"),
            (ids[1], rev[ids[1]] + 2, "lease.claimed"),
        ]
        assert all(e[0] > top_id for e in new)

        # A watcher's read from the start returns the whole log in order.
        read = conn.execute(
            f"SELECT id, revision FROM {s}.watch_read('0', 0, %s, 9223372036854775807, 1000)",
            [str(2**62)],
        ).fetchall()
        assert [r[0] for r in read] == [e[0] for e in events(conn, schema)]
