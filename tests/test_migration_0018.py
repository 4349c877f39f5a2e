"""Migration 0018 (the revision, its time and the order guard's previous xid in
the lease row): a database written by the 0017 functions upgrades in place and
then reads and writes exactly as a fresh install with the same history, before
its rows are moved, while they are moved, and after."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pglease._migrate as migrate_module
import pglease.migration_files as migration_files
from pglease import PostgresStore
from pglease.listing import fetch_resource, iter_resources
from pglease.migrations import migrate, move_revisions
from tests.test_migration_0016 import catalog

TOKEN = hashlib.sha256(b"token").digest()
BIG = 86400.0
OLD_FUNCTIONS = Path(__file__).parent / "migration_0017_functions"


@pytest.fixture
def fresh_schema(pg_dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def at_0017(tmp_path: Path) -> Path:
    """sql/ as it was at 0017: the migrations up to 0017 and that time's functions."""
    copy = tmp_path / "sql"
    shutil.copytree(migration_files.migrations_dir(), copy)
    for path in copy.glob("*.sql"):
        if int(path.name[:4]) >= 18:
            path.unlink()
    shutil.rmtree(copy / "functions")
    shutil.copytree(OLD_FUNCTIONS, copy / "functions", ignore=shutil.ignore_patterns("*.md"))
    return copy


def build_0017(
    conn: psycopg.Connection[Any], schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = at_0017(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(migration_files, "migrations_dir", lambda: old)
        migrate(conn, schema)
    assert "revision" not in columns(conn, schema)


def upgrade_unmoved(
    conn: psycopg.Connection[Any], schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Apply 0018 and the current functions, but move no row yet."""
    with monkeypatch.context() as m:
        m.setattr(migrate_module, "move_revisions", lambda *a, **k: 0)
        assert migrate(conn, schema)[0].label == "0018_lease_row_revision"
    assert unmoved(conn, schema) > 0


def columns(conn: psycopg.Connection[Any], schema: str) -> set[str]:
    rows = conn.execute(
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = %s AND table_name = 'leases'",
        [schema],
    ).fetchall()
    return {str(r[0]) for r in rows}


def unmoved(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {schema}.leases WHERE revision IS NULL").fetchone()
    assert row is not None
    return int(row[0])


class Writer:
    """The same calls on any schema, through the SQL functions (the 0017 ones
    and the current ones take the same arguments)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        self.conn = conn
        self.s = schema
        self.ids: dict[str, str] = {}

    def one(self, query: str, args: list[Any]) -> tuple[Any, ...]:
        row = self.conn.execute(query.replace("@s", self.s), args).fetchone()
        assert row is not None
        return tuple(row)

    def new(self, key: str) -> str:
        self.ids[key] = str(self.one("SELECT @s.ensure_resource('job', %s)", [key])[0])
        return self.ids[key]

    def claim(self, key: str, owner: str, ttl: float = BIG) -> tuple[Any, ...]:
        return self.one(
            "SELECT claimed, generation, revision FROM @s.claim(%s, 'host', %s, %s, %s,"
            " NULL, NULL)",
            [self.ids[key], owner, TOKEN, ttl],
        )

    def renew(self, key: str, owner: str, generation: int) -> int:
        return int(
            self.one(
                "SELECT revision FROM @s.renew(%s, 'host', %s, %s, %s, %s, NULL, NULL)",
                [self.ids[key], owner, generation, TOKEN, BIG],
            )[0]
        )

    def release(self, key: str, owner: str, generation: int, expected: int | None = None) -> int:
        return int(
            self.one(
                "SELECT revision FROM @s.release(%s, 'host', %s, %s, %s, %s, NULL)",
                [self.ids[key], owner, generation, TOKEN, expected],
            )[0]
        )

    def mutate(
        self, key: str, payload: object, owner: str | None = None,
        generation: int | None = None, expected: int | None = None,
    ) -> int:  # fmt: skip
        with self.conn.transaction():
            row = self.one(
                "SELECT revision FROM @s.mutate_begin(%s, %s, 'job.step', %s, %s, %s, %s,"
                " %s, %s, %s, NULL)",
                [
                    self.ids[key], expected,
                    None if owner is None else "host", owner, generation,
                    None if owner is None else TOKEN,
                    "host" if owner is None else None, "w" if owner is None else None,
                    json.dumps(payload),
                ],
            )  # fmt: skip
        return int(row[0])

    def refused(self, query: str, args: list[Any]) -> tuple[str | None, str | None]:
        try:
            with self.conn.transaction():
                self.conn.execute(query.replace("@s", self.s), args)
        except psycopg.Error as exc:
            return exc.diag.sqlstate, exc.diag.message_detail
        raise AssertionError("not refused")


def write_history(w: Writer) -> None:
    """Leases in every state: free, held and renewed, released, taken again
    after a release, reaped, expired with the expiry unrecorded, written by
    fenced and unleased mutations, and revoked."""
    w.new("free")
    w.new("held")
    assert w.claim("held", "a")[0]
    w.renew("held", "a", 1)
    w.new("released")
    w.claim("released", "a")
    w.release("released", "a", 1)
    w.new("reclaimed")
    w.claim("reclaimed", "a")
    w.release("reclaimed", "a", 1)
    w.claim("reclaimed", "b")
    w.new("mutated")
    w.claim("mutated", "a")
    w.mutate("mutated", {"n": 1}, "a", 1)
    w.mutate("mutated", {"n": 2}, "a", 1)
    w.release("mutated", "a", 1)
    w.new("written")
    w.mutate("written", {"w": 1})
    w.new("revoked")
    w.claim("revoked", "a")
    w.one("SELECT revoked FROM @s.revoke_lease(%s)", [w.ids["revoked"]])
    w.new("reaped")
    w.claim("reaped", "a", ttl=0.001)
    time.sleep(0.02)
    assert w.one("SELECT @s.reap_expired(100)", [])[0] == 1
    w.new("expired")
    w.claim("expired", "a", ttl=0.001)
    time.sleep(0.02)


def write_more(w: Writer) -> list[Any]:
    """One more change of every lease (and what each call returned): the first
    write of each row after the upgrade, through every writer and refusal."""
    out: list[Any] = [
        w.claim("free", "c"),
        w.renew("held", "a", 1),
        w.claim("released", "c"),
        w.release("reclaimed", "b", 2, expected=3),  # the cold way: an expected revision
        w.claim("expired", "c"),  # lease.expired, then lease.claimed
        w.claim("reaped", "c"),
        w.claim("revoked", "c"),  # refused: waits for the revoked holder's expiry
    ]  # fmt: skip
    claimed, gen, rev = w.claim("mutated", "c")
    out.append((claimed, gen, rev))
    out.append(w.mutate("mutated", {"n": 3}, "c", gen, expected=rev))
    out.append(w.mutate("written", {"w": 2}, expected=1))
    # Stale expected revisions are refused naming the actual one (DETAIL).
    out.append(
        w.refused(
            "SELECT @s.mutate_begin(%s, 0, 'job.step', NULL, NULL, NULL, NULL, 'host', 'w',"
            " NULL, NULL)",
            [w.ids["written"]],
        )
    )
    out.append(
        w.refused(
            "SELECT @s.release(%s, 'host', 'c', %s, %s, 0, NULL)",
            [w.ids["mutated"], gen, TOKEN],
        )
    )
    out.append(
        w.refused("SELECT @s.claim(%s, 'host', 'c', %s, %s, 0, NULL)", [w.ids["free"], TOKEN, BIG])
    )
    return out


def cycle(w: Writer) -> None:
    for key in ("free", "released", "expired", "reaped"):
        gen = int(w.one("SELECT generation FROM @s.leases WHERE resource_id = %s",
                        [w.ids[key]])[0])  # fmt: skip
        w.release(key, "c", gen)
        claimed, gen, _ = w.claim(key, "d")
        assert claimed
        w.release(key, "d", gen)


def view(store: PostgresStore, schema: str) -> dict[str, Any]:
    """Everything a reader sees, without the instants (the two schemas were
    written at different times); the instants are checked by `check_times`."""

    def state(s: Any) -> tuple[Any, ...]:
        lease = s.lease
        return (s.id, s.type, s.key, s.revision, lease.generation, lease.owner, lease.held,
                lease.expires_at is None)  # fmt: skip

    def event(e: Any) -> tuple[Any, ...]:
        return (e.resource_id, e.resource_key, e.revision, e.type, e.actor,
                e.lease_generation, e.payload)  # fmt: skip

    ids = [s.id for s in store.list_resources("job")]
    with store.connection() as conn:
        fetched = [fetch_resource(conn, schema, rid) for rid in ids]
    return {
        "get": [state(store.get(rid)) for rid in ids],
        "list": [state(s) for s in store.list_resources("job")],
        "listing": [state(x.state) for x in iter_resources(store, schema, page_size=3)],
        "held": [state(x.state) for x in iter_resources(store, schema, held=True)],
        "fetch": [
            (state(f[0].state), None if f[1] is None else event(f[1]))
            for f in fetched
            if f is not None
        ],
        "events": {rid: [event(e) for e in store.events(rid)] for rid in ids},
        "events_after": [event(e) for e in store.events_after(None)],
    }


def check_times(store: PostgresStore, conn: psycopg.Connection[Any], schema: str) -> None:
    """updated_at is the instant of the resource's latest event, or the
    resource's own for one never changed; revisions run 1..n with no gap."""
    for s in store.list_resources("job"):
        evs = store.events(s.id)
        assert [e.revision for e in evs] == list(range(1, s.revision + 1))
        if evs:
            assert s.updated_at == evs[-1].created_at
        else:
            row = conn.execute(
                f"SELECT updated_at FROM {schema}.resources WHERE id = %s", [s.id]
            ).fetchone()
            assert row is not None and s.updated_at == row[0]


def test_upgrade_in_place_reads_and_writes_as_a_fresh_install(
    pg_dsn: str, schema: str, fresh_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        build_0017(conn, schema, tmp_path, monkeypatch)
        old = Writer(conn, schema)
        write_history(old)
        frozen = conn.execute(
            f"SELECT id, revision, updated_at FROM {schema}.resources ORDER BY id"
        ).fetchall()
        upgrade_unmoved(conn, schema, monkeypatch)
        assert unmoved(conn, schema) == len(old.ids)
        # Applying 0018 changed no value of the old columns.
        assert (
            frozen
            == conn.execute(
                f"SELECT id, revision, updated_at FROM {schema}.resources ORDER BY id"
            ).fetchall()
        )

        migrate(conn, fresh_schema)
        fresh = Writer(conn, fresh_schema)
        write_history(fresh)
        assert unmoved(conn, fresh_schema) == 0

        with (
            PostgresStore(pg_dsn, schema=schema, max_size=2) as up,
            PostgresStore(pg_dsn, schema=fresh_schema, max_size=2) as new,
        ):
            # Nothing moved yet: every row is read through the coalesce.
            assert unmoved(conn, schema) == len(old.ids)
            assert view(up, schema) == view(new, fresh_schema)
            check_times(up, conn, schema)

            # The first write of each row after the upgrade continues its
            # revision (old + 1) and returns, refuses and records the same.
            assert write_more(old) == write_more(fresh)
            assert view(up, schema) == view(new, fresh_schema)
            check_times(up, conn, schema)
            check_times(new, conn, fresh_schema)
            left = unmoved(conn, schema)
            assert 0 < left < len(old.ids)  # "revoked" was only refused: not moved

            # The chunked move: rows in chunks of 2, each its own transaction.
            assert move_revisions(conn, schema, chunk=2) == len(old.ids)
            assert unmoved(conn, schema) == 0
            assert move_revisions(conn, schema) == 0  # done: nothing looked at
            assert view(up, schema) == view(new, fresh_schema)
            check_times(up, conn, schema)

            cycle(old)
            cycle(fresh)
            assert view(up, schema) == view(new, fresh_schema)
            check_times(up, conn, schema)
            check_times(new, conn, fresh_schema)

        # The moved rows hold what the frozen resource columns held, and the
        # upgraded schema is made of what a fresh one is.
        assert catalog(conn, schema) == catalog(conn, fresh_schema)


def test_the_migration_runner_moves_every_row(
    pg_dsn: str, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        build_0017(conn, schema, tmp_path, monkeypatch)
        w = Writer(conn, schema)
        write_history(w)
        frozen = dict(
            conn.execute(f"SELECT id, (revision, updated_at) FROM {schema}.resources").fetchall()
        )
        assert migrate(conn, schema)[0].label == "0018_lease_row_revision"
        assert unmoved(conn, schema) == 0
        moved = dict(
            conn.execute(
                f"SELECT resource_id, (revision, updated_at) FROM {schema}.leases"
            ).fetchall()
        )
        assert moved == frozen
        row = conn.execute(f"SELECT done FROM {schema}.lease_row_moves").fetchone()
        assert row == (True,)


def test_a_chunk_skips_a_locked_row_and_its_writer_moves_it(
    pg_dsn: str, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        psycopg.connect(pg_dsn) as holder,
    ):
        build_0017(conn, schema, tmp_path, monkeypatch)
        w = Writer(conn, schema)
        for key in ("a", "b", "c"):
            w.new(key)
            w.claim(key, "x")
        upgrade_unmoved(conn, schema, monkeypatch)
        holder.execute(
            f"SELECT 1 FROM {schema}.leases WHERE resource_id = %s FOR UPDATE", [w.ids["b"]]
        )
        # A chunk never waits for a row a writer holds (it would here, for good).
        conn.execute("SET lock_timeout = '5s'")
        assert move_revisions(conn, schema, chunk=1) == 3
        assert unmoved(conn, schema) == 1
        holder.rollback()
        # Its next writer moves it: revision 1 (the claim) + 1.
        assert w.release("b", "x", 1) == 2
        assert unmoved(conn, schema) == 0


def test_the_order_guard_covers_a_transaction_older_than_the_upgrade(
    pg_dsn: str, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction that took its xid before the migration writes a resource
    whose last event (written before the migration, by a younger transaction)
    the lease row has no xid of: the guard looks that event up and refuses."""
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        psycopg.connect(pg_dsn) as early,
    ):
        build_0017(conn, schema, tmp_path, monkeypatch)
        w = Writer(conn, schema)
        w.new("r")
        early.execute("SELECT pg_current_xact_id()")  # an xid, and no lock on leases
        w.claim("r", "a")  # revision 1, by a younger transaction
        done = threading.Event()

        def upgrade() -> None:
            with psycopg.connect(pg_dsn, autocommit=True) as other:
                migrate(other, schema)
            done.set()

        t = threading.Thread(target=upgrade)
        t.start()
        t.join(60)
        assert done.is_set()
        row = conn.execute(
            f"SELECT revision, last_xid FROM {schema}.leases WHERE resource_id = %s",
            [w.ids["r"]],
        ).fetchone()
        assert row is not None and row[0] == 1 and row[1] is None  # moved, no xid
        with pytest.raises(psycopg.errors.SerializationFailure) as info:
            early.execute(
                f"SELECT {schema}.release(%s, 'host', 'a', 1, %s, NULL, NULL)",
                [w.ids["r"], TOKEN],
            )
        assert "event order" in (info.value.diag.message_primary or "")
        early.rollback()
        # A fresh transaction writes, and from then on the row carries its xid.
        assert w.release("r", "a", 1) == 2
        row = conn.execute(
            f"SELECT last_xid IS NOT NULL FROM {schema}.leases WHERE resource_id = %s",
            [w.ids["r"]],
        ).fetchone()
        assert row == (True,)


def test_the_cli_reads_unmoved_rows_and_migrate_finishes_the_move(
    pg_dsn: str, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_cli import run

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        build_0017(conn, schema, tmp_path, monkeypatch)
        w = Writer(conn, schema)
        write_history(w)
        upgrade_unmoved(conn, schema, monkeypatch)
        with PostgresStore(pg_dsn, schema=schema, max_size=1) as store:
            for key in ("held", "mutated", "revoked", "free"):
                got = run(pg_dsn, schema, "get", "job", key, "--json")
                assert got.returncode == 0, got.stderr
                shown = json.loads(got.stdout)
                state = store.get(w.ids[key])
                assert (shown["revision"], shown["updated_at"]) == (
                    state.revision,
                    state.updated_at.isoformat(),
                )
                assert state.revision == (shown["last_event"] or {"revision": 0})["revision"]
        # An interrupted move (here: never started) is finished by `pglease migrate`.
        migrated = run(pg_dsn, schema, "migrate")
        assert migrated.returncode == 0, migrated.stderr
        assert "up to date" in migrated.stdout
        assert unmoved(conn, schema) == 0
