"""Trust: only the database clock decides expiry, the SQL functions check their own
inputs and pin search_path, schemas never queue on each other, and the role
model (owner, client, reader) holds with real login roles."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from pglease import (
    ClockOverrideError,
    InvalidTTLError,
    MigrationError,
    Owner,
    PermissionDeniedError,
    Permit,
    PostgresStore,
)
from pglease.errors import InvalidOwnerError, InvalidResourceIdError, InvalidTokenError
from pglease.migrations import grant, revoke
from pglease.postgres import _core
from pglease.testing import is_test_clock_on, set_test_clock

A = Owner("host", "a")
B = Owner("host", "b")


def sql(dsn: str, text: str, args: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(text, args)
        return [tuple(r) for r in cur.fetchall()] if cur.description else []


def counts(dsn: str, schema: str) -> tuple[int, int, int]:
    """(resources, events, payloads): what a refused call must leave unchanged."""
    [row] = sql(
        dsn,
        f'SELECT (SELECT count(*) FROM "{schema}".resources),'
        f' (SELECT count(*) FROM "{schema}".events), (SELECT count(*) FROM "{schema}".payloads)',
    )
    return row  # type: ignore[return-value]


@pytest.fixture
def store(pg_dsn: str, schema: str) -> Iterator[PostgresStore]:
    """A store on a schema as a deployment has it: the test clock is off."""
    with PostgresStore(pg_dsn, schema=schema, max_size=4) as s:
        yield s


# --- the clock -------------------------------------------------------------------


def test_now_cannot_take_over_a_live_lease(store: PostgresStore, pg_dsn: str, schema: str) -> None:
    rid = store.ensure_resource("job", "live")
    held = store.claim(rid, A, 60)
    assert held is not None
    before = counts(pg_dsn, schema)
    an_hour_on = datetime.now(UTC) + timedelta(hours=1)
    with pytest.raises(ClockOverrideError, match="database clock"):
        store.claim(rid, B, 10, now=an_hour_on)
    with pytest.raises(ClockOverrideError):
        store.claim(rid, B, 1, now=datetime(2100, 1, 1, tzinfo=UTC))
    state = store.get(rid)
    assert state.lease.owner == A and state.lease.generation == held.generation
    assert counts(pg_dsn, schema) == before


def test_an_expired_holder_cannot_renew_or_write_with_an_earlier_now(
    store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = store.ensure_resource("job", "late")
    claim = store.claim(rid, A, 60)
    assert claim is not None
    earlier = claim.expires_at - timedelta(hours=2)
    before = counts(pg_dsn, schema)
    with pytest.raises(ClockOverrideError):
        store.renew(claim, 60, now=earlier)
    with pytest.raises(ClockOverrideError):
        store.mutate(Permit(rid, claim.revision, claim), "job.step", now=earlier)
    with pytest.raises(ClockOverrideError):
        store.release(claim, now=earlier)
    with pytest.raises(ClockOverrideError):
        store.get(rid, now=earlier)
    with pytest.raises(ClockOverrideError):
        store.list_resources(now=earlier)
    assert counts(pg_dsn, schema) == before


def test_the_test_clock_is_the_owners_switch(
    store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = store.ensure_resource("job", "clock")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert not is_test_clock_on(conn, schema)
        set_test_clock(conn, schema)
        assert is_test_clock_on(conn, schema)
    far = datetime(2100, 1, 1, tzinfo=UTC)
    claim = store.claim(rid, A, 10, now=far)
    assert claim is not None and claim.expires_at == far + timedelta(seconds=10)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        set_test_clock(conn, schema, enabled=False)
    with pytest.raises(ClockOverrideError):
        store.claim(rid, B, 10, now=far + timedelta(hours=1))


def test_a_hostile_clock_timestamp_in_the_search_path_has_no_effect(
    store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = store.ensure_resource("job", "path")
    evil = f"evil_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {evil}")
        try:
            conn.execute(
                f"CREATE FUNCTION {evil}.clock_timestamp() RETURNS timestamptz"
                " LANGUAGE sql AS $$ SELECT '2100-01-01'::timestamptz $$"
            )
            conn.execute(
                f"CREATE FUNCTION {evil}.hashtextextended(text, bigint) RETURNS bigint"
                " LANGUAGE sql AS $$ SELECT 42::bigint $$"
            )
            conn.execute(f"SET search_path = {evil}, pg_catalog, public")
            # The hostile function is what an unqualified call finds here...
            [(hostile,)] = conn.execute("SELECT clock_timestamp()").fetchall()
            assert hostile.year == 2100
            # ...but not inside pglease's functions.
            [(claimed, expires_at)] = conn.execute(
                f'SELECT claimed, expires_at FROM "{schema}".claim(%s, %s, %s, %s, 30, NULL, NULL)',
                [rid, A.type, A.id, hashlib.sha256(b"t").digest()],
            ).fetchall()
        finally:
            conn.execute("RESET search_path")
            conn.execute(f"DROP SCHEMA {evil} CASCADE")
    assert claimed
    assert expires_at < datetime.now(UTC) + timedelta(minutes=5)


def test_every_function_pins_its_search_path(
    pg_dsn: str, store: PostgresStore, schema: str
) -> None:
    rows = sql(
        pg_dsn,
        "SELECT p.proname, p.proconfig FROM pg_proc p JOIN pg_namespace n"
        " ON n.oid = p.pronamespace WHERE n.nspname = %s",
        [schema],
    )
    assert len(rows) >= 20
    unpinned = [
        name
        for name, config in rows
        if not config or "search_path=pg_catalog, pg_temp" not in config
    ]
    assert unpinned == []


# --- the functions' own input checks -----------------------------------------------


@pytest.mark.parametrize("ttl", [1e9, -5, 0, float("nan"), float("inf")])
def test_direct_sql_claim_with_a_bad_ttl_is_refused(
    store: PostgresStore, pg_dsn: str, schema: str, ttl: float
) -> None:
    rid = store.ensure_resource("job", "ttl")
    before = counts(pg_dsn, schema)
    with pytest.raises(psycopg.Error) as info:
        sql(
            pg_dsn,
            f'SELECT * FROM "{schema}".claim(p_resource => %s, p_owner_type => %s,'
            " p_owner_id => %s, p_token_sha256 => %s, p_ttl => %s, p_expected_revision => NULL,"
            " p_now => NULL)",
            [rid, A.type, A.id, hashlib.sha256(b"t").digest(), ttl],
        )
    assert info.value.diag.sqlstate == "PGL11"
    assert isinstance(_core.translate(info.value), InvalidTTLError)
    assert counts(pg_dsn, schema) == before
    assert store.get(rid).lease.owner is None


def test_direct_sql_renew_and_heartbeat_with_a_huge_ttl_are_refused(
    store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = store.ensure_resource("job", "renew")
    claim = store.claim(rid, A, 30)
    assert claim is not None
    token_hash = hashlib.sha256(claim.token.encode()).digest()
    with pytest.raises(psycopg.Error) as info:
        sql(
            pg_dsn,
            f'SELECT * FROM "{schema}".renew(%s, %s, %s, %s, %s, 1e9, NULL, NULL)',
            [rid, A.type, A.id, claim.generation, token_hash],
        )
    assert info.value.diag.sqlstate == "PGL11"
    with pytest.raises(psycopg.Error) as info:
        sql(
            pg_dsn,
            f'SELECT * FROM "{schema}".heartbeat(%s, %s, %s, %s, %s, %s)',
            [[rid], [claim.generation], [token_hash], [A.type], [A.id], [1e9]],
        )
    assert info.value.diag.sqlstate == "PGL11"
    assert store.get(rid).lease.expires_at == claim.expires_at


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["not-an-id", "host", "a", b"x" * 32], InvalidResourceIdError),
        (["job-" + "0" * 40, "Host!", "a", b"x" * 32], InvalidOwnerError),
        (["job-" + "0" * 40, "host", "", b"x" * 32], InvalidOwnerError),
        (["job-" + "0" * 40, "host", "a" * 257, b"x" * 32], InvalidOwnerError),
        (["job-" + "0" * 40, "host", "a", b"short"], InvalidTokenError),
    ],
)
def test_direct_sql_claim_checks_ids_owners_and_tokens(
    store: PostgresStore, pg_dsn: str, schema: str, args: list[Any], error: type[Exception]
) -> None:
    before = counts(pg_dsn, schema)
    with pytest.raises(psycopg.Error) as info:
        sql(pg_dsn, f'SELECT * FROM "{schema}".claim(%s, %s, %s, %s, 30, NULL, NULL)', args)
    assert isinstance(_core.translate(info.value), error)
    assert counts(pg_dsn, schema) == before


def test_direct_sql_mutation_checks_event_type_and_payload(
    store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = store.ensure_resource("job", "mutate")
    call = (
        f'SELECT * FROM "{schema}".mutate_begin(%s, 0, %s, NULL, NULL, NULL, NULL, NULL, NULL,'
        " %s, NULL)"
    )
    before = counts(pg_dsn, schema)
    for event_type, payload, sqlstate in [
        ("lease.claimed", None, "PGL18"),
        ("Bad Type", None, "PGL18"),
        ("job.step", "{not json", "22P02"),
        ("job.step", '"' + "x" * (1024 * 1024) + '"', "PGL19"),
    ]:
        with pytest.raises(psycopg.Error) as info:
            sql(pg_dsn, call, [rid, event_type, payload])
        assert info.value.diag.sqlstate == sqlstate
    assert counts(pg_dsn, schema) == before
    with pytest.raises(psycopg.Error) as info:
        sql(pg_dsn, f'SELECT "{schema}".ensure_resource(%s, %s)', ["job", "k" * 1025])
    assert info.value.diag.sqlstate == "PGL17"


# --- tenants ----------------------------------------------------------------------------


def test_two_schemas_with_the_same_resource_never_queue_on_each_other(
    pg_dsn: str, schema: str
) -> None:
    other = f"{schema}_b"
    try:
        with (
            PostgresStore(pg_dsn, schema=schema, max_size=2) as a,
            PostgresStore(pg_dsn, schema=other, max_size=2) as b,
        ):
            rid = a.ensure_resource("job", "shared")
            assert b.ensure_resource("job", "shared") == rid  # ids are deterministic
            with psycopg.connect(pg_dsn) as busy:
                # A mutation of (job, shared) in schema B holds B's queue lock and row lock.
                busy.execute(
                    f'SELECT * FROM "{other}".mutate_begin(%s, 0, %s, NULL, NULL, NULL, NULL,'
                    " NULL, NULL, NULL, NULL)",
                    [rid, "job.step"],
                )
                # Schema A's claim of its own (job, shared) must not wait for it: a
                # lock wait would fail after lock_timeout, however fast the host is.
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("SET lock_timeout = '2s'")
                    [(claimed,)] = conn.execute(
                        f'SELECT claimed FROM "{schema}".claim(%s, %s, %s, %s, 30, NULL, NULL)',
                        [rid, A.type, A.id, hashlib.sha256(b"t").digest()],
                    ).fetchall()
                assert claimed
                busy.rollback()
    finally:
        sql(pg_dsn, f'DROP SCHEMA IF EXISTS "{other}" CASCADE')


# --- roles ------------------------------------------------------------------------------


class Roles:
    """Login roles made for one test, dropped afterwards."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.made: list[str] = []

    def make(self, kind: str) -> tuple[str, str]:
        name = f"pgl_{kind}_{uuid.uuid4().hex[:8]}"
        sql(self.admin_dsn, f"CREATE ROLE {name} LOGIN")
        self.made.append(name)
        return name, conninfo.make_conninfo(self.admin_dsn, user=name)

    def drop(self) -> None:
        for name in self.made:
            sql(self.admin_dsn, f"DROP OWNED BY {name}")
            sql(self.admin_dsn, f"DROP ROLE {name}")


@pytest.fixture
def roles(pg_dsn: str) -> Iterator[Roles]:
    [(can,)] = sql(
        pg_dsn, "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
    )
    if not can:
        pytest.skip("the test server's user cannot create roles")
    made = Roles(pg_dsn)
    try:
        yield made
    finally:
        made.drop()


def _denied(dsn: str, text: str) -> None:
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        sql(dsn, text)


def test_a_client_role_without_create_runs_the_store(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    name, dsn = roles.make("client")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, name, "client")
    [(may_create,)] = sql(dsn, "SELECT has_database_privilege(current_database(), 'CREATE')")
    assert not may_create
    with PostgresStore(dsn, schema=schema, max_size=2) as client:
        rid = client.ensure_resource("job", "client")
        claim = client.claim(rid, A, 30)
        assert claim is not None
        claim = client.renew(claim, 30)
        result = client.mutate(Permit(rid, claim.revision, claim), "job.step", payload={"n": 1})
        assert client.get(rid).revision == result.revision
        assert [e.type for e in client.events(rid)][-1] == "job.step"
        assert client.events_after(None)
        client.release(claim)
        with client.watch(after="start") as watcher:
            assert watcher.get(timeout=10) is not None
    # ... and nothing else: no direct writes, no token hashes, no owner's work.
    _denied(dsn, f'UPDATE "{schema}".leases SET generation = 0')
    _denied(
        dsn, f"INSERT INTO \"{schema}\".events (resource_id, revision, type) VALUES ('x', 1, 'x')"
    )
    _denied(dsn, f'DELETE FROM "{schema}".events')
    _denied(dsn, f'SELECT token_sha256 FROM "{schema}".leases')
    _denied(dsn, f'UPDATE "{schema}".settings SET test_clock = true')
    _denied(dsn, f"SELECT * FROM \"{schema}\".prune_log(interval '0')")
    _denied(
        dsn,
        f"SELECT * FROM \"{schema}\"._bump(%s, now(), 'x', NULL, NULL, NULL, NULL, NULL)".replace(
            "%s", "'x'"
        ),
    )


def test_a_reader_role_reads_and_changes_nothing(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    rid = store.ensure_resource("job", "reader")
    claim = store.claim(rid, A, 30)
    assert claim is not None
    name, dsn = roles.make("reader")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, name, "reader")
    before = counts(pg_dsn, schema)
    with PostgresStore(dsn, schema=schema, max_size=2) as reader:
        assert reader.get(rid).lease.owner == A
        assert [s.id for s in reader.list_resources()] == [rid]
        assert [e.type for e in reader.events(rid)] == ["lease.claimed"]
        with reader.watch(after="start") as watcher:
            event = watcher.get(timeout=10)
            assert event is not None and event.type == "lease.claimed"
        with pytest.raises(PermissionDeniedError):
            reader.claim(rid, B, 30)
        with pytest.raises(PermissionDeniedError):
            reader.ensure_resource("job", "new")
        with pytest.raises(PermissionDeniedError):
            reader.mutate(Permit(rid, 1), "job.step")
    assert counts(pg_dsn, schema) == before


def test_revoke_takes_every_privilege_away(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    name, dsn = roles.make("client")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, name, "client")
        revoke(conn, schema, name)
    with pytest.raises(MigrationError, match="cannot read the migration state"):
        PostgresStore(dsn, schema=schema, max_size=1)


def test_a_role_that_cannot_migrate_gets_a_migration_error(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    name, dsn = roles.make("client")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, name, "client")
    # A schema that does not exist yet: the client may not create it.
    with pytest.raises(
        MigrationError, match=r"no pglease tables \(this role may not .*--schema \w+ migrate`$"
    ):
        PostgresStore(dsn, schema=f"{schema}_new", max_size=1)
    with pytest.raises(MigrationError, match=r"^schema '\w+' has no pglease tables: check"):
        PostgresStore(dsn, schema=f"{schema}_new", max_size=1, auto_migrate=False)
    # A schema whose function set is out of date (as after a pglease upgrade).
    sql(pg_dsn, f'DELETE FROM "{schema}".schema_functions')
    with pytest.raises(MigrationError, match=r"needs functions@\w+ \(this role may not apply it"):
        PostgresStore(dsn, schema=schema, max_size=1)
    [(schemas,)] = sql(
        pg_dsn, "SELECT count(*) FROM pg_namespace WHERE nspname = %s", [f"{schema}_new"]
    )
    assert schemas == 0


def test_an_upgrade_grants_new_functions_to_recorded_roles(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    name, dsn = roles.make("client")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, name, "client")
        # Recreate a function as an upgrade would: it loses its grants...
        conn.execute(f'DROP FUNCTION "{schema}".leave_queue(text)')
        conn.execute(f'DELETE FROM "{schema}".schema_functions')
        assert store.migrate()[-1].startswith("functions@")
    # ...and the owner's migration granted it to the recorded client again.
    [(ok,)] = sql(dsn, f'SELECT "{schema}".leave_queue(%s)', ["nobody"])
    assert ok is False
    [(public,)] = sql(
        pg_dsn,
        "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND has_function_privilege('public', p.oid, 'EXECUTE')",
        [schema],
    )
    assert public == 0


def test_the_cli_runs_as_a_client_role(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    name, dsn = roles.make("client")

    def cli(as_dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pglease", "--dsn", as_dsn, "--schema", schema, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    # Before the owner grants anything the role cannot even read the state.
    refused = cli(dsn, "ls")
    assert refused.returncode == 1
    assert "cannot read the migration state" in refused.stderr
    granted = cli(pg_dsn, "--json", "migrate", "--grant-client", name)
    assert granted.returncode == 0, granted.stderr
    assert json.loads(granted.stdout)["granted"] == [{"role": name, "kind": "client"}]
    claimed = cli(dsn, "claim", "job", "cli", "--owner", "host:a", "--ttl", "30")
    assert claimed.returncode == 0, claimed.stderr
    listed = cli(dsn, "ls")
    assert listed.returncode == 0, listed.stderr
    assert "host:a" in listed.stdout
    # The owner's job stays the owner's.
    pruned = cli(dsn, "prune", "--older-than", "1d")
    assert pruned.returncode != 0
    assert "permission denied" in pruned.stderr
    assert "Traceback" not in pruned.stderr
    assert cli(pg_dsn, "migrate", "--revoke", name).returncode == 0
    assert cli(dsn, "ls").returncode == 1


def test_cli_grants_a_reader_that_cannot_write(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    name, dsn = roles.make("reader")
    base = [sys.executable, "-m", "pglease", "--schema", schema]
    granted = subprocess.run(
        [*base, "--dsn", pg_dsn, "migrate", "--grant-reader", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert granted.returncode == 0, granted.stderr
    assert f"granted reader to {name}" in granted.stdout
    before = counts(pg_dsn, schema)
    claim = subprocess.run(
        [*base, "--dsn", dsn, "claim", "job", "r", "--owner", "host:a", "--ttl", "30"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert claim.returncode == 1
    assert "permission denied" in claim.stderr and "role model" in claim.stderr
    assert counts(pg_dsn, schema) == before


# --- fence at commit ----------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_write_whose_lease_expires_before_commit_is_refused(
    pg_dsn: str, schema: str, flavour: str
) -> None:
    """A holder whose own SQL stalls past its TTL cannot commit its fenced write."""
    import asyncio

    from pglease import AsyncPostgresStore, LeaseExpiredError

    with PostgresStore(pg_dsn, schema=schema, max_size=2) as store:
        rid = store.ensure_resource("job", f"stall-{flavour}")
        claim = store.claim(rid, A, 0.5)
        assert claim is not None
        before = counts(pg_dsn, schema)
        # The stall outlasts the TTL by the database's own clock, however fast
        # the host: the apply sleeps until the lease's expiry has passed.
        until = claim.expires_at.isoformat()
        stall = f"SELECT pg_sleep_until('{until}'::timestamptz + interval '100 ms')"
        permit = Permit(rid, claim.revision, claim)
        with pytest.raises(LeaseExpiredError, match="before the write committed"):
            if flavour == "sync":
                store.mutate(permit, "job.step", lambda conn: conn.execute(stall))
            else:

                async def run() -> None:
                    async def apply(conn: psycopg.AsyncConnection[Any]) -> None:
                        await conn.execute(stall)

                    async with AsyncPostgresStore(pg_dsn, schema=schema, max_size=1) as s:
                        await s.mutate(permit, "job.step", apply)

                asyncio.run(run())
        assert counts(pg_dsn, schema) == before
        # A rival takes over; the log holds no write of the old generation after it.
        taken = store.claim(rid, B, 30)
        assert taken is not None and taken.generation == claim.generation + 1
        assert [e.type for e in store.events(rid)] == [
            "lease.claimed",
            "lease.expired",
            "lease.claimed",
        ]


def test_a_write_that_commits_in_time_passes_the_fence(store: PostgresStore) -> None:
    rid = store.ensure_resource("job", "in-time")
    claim = store.claim(rid, A, 30)
    assert claim is not None
    result = store.mutate(Permit(rid, claim.revision, claim), "job.step", payload={"ok": True})
    assert store.events(rid)[-1].revision == result.revision


def test_a_client_role_runs_postgres_sessions_and_a_reader_reads_them(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    from pglease.sessions import PostgresSessionRepository

    client_name, client_dsn = roles.make("client")
    reader_name, reader_dsn = roles.make("reader")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, client_name, "client")
        grant(conn, schema, reader_name, "reader")
    with PostgresStore(client_dsn, schema=schema, max_size=2) as client:
        repo = PostgresSessionRepository(client, renew_interval=None)
        with repo.create("s1") as session:
            entry = session.append_entry("message", None, {"message": {"role": "user"}})
        assert [e.id for e in repo.open("s1").scan_entries()] == [entry.id]
    with PostgresStore(reader_dsn, schema=schema, max_size=2) as reader:
        [(entries,)] = sql(reader_dsn, f'SELECT count(*) FROM "{schema}".session_entries')
        assert entries == 1
        _denied(reader_dsn, f'DELETE FROM "{schema}".session_entries')
        assert reader.list_resources("session")


def test_a_client_role_imports_through_the_chunk_functions_and_a_reader_cannot(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """Import chunks are calls of session_import_chunk / session_import_registers:
    a client is granted them (a reader is not), and a client without them
    gets a PermissionDeniedError and no visible session."""
    from pglease.sessions import PostgresSessionRepository, SessionRepository

    client_name, client_dsn = roles.make("client")
    reader_name, reader_dsn = roles.make("reader")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, client_name, "client")
        grant(conn, schema, reader_name, "reader")
    with SessionRepository(tmp_path, renew_interval=None) as files, files.create("src") as src:
        parent = None
        for i in range(5):
            parent = src.append_entry("message", parent, {"message": {"n": i}}).id
    path = tmp_path / "src.sqlite"
    functions = ("session_import_chunk", "session_import_registers")
    for role, allowed in ((client_name, True), (reader_name, False), ("public", False)):
        for function in functions:
            [(may,)] = sql(
                pg_dsn,
                "SELECT has_function_privilege(%s, p.oid, 'EXECUTE') FROM pg_proc p"
                " JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = %s AND p.proname = %s",
                [role, schema, function],
            )
            assert may is allowed, (role, function)
    with PostgresStore(client_dsn, schema=schema, max_size=2) as client:
        repo = PostgresSessionRepository(client, renew_interval=None)
        with repo.import_file(path, id="imp", chunk_entries=2) as imported:
            assert len(imported.scan_entries()) == 5
        chunk_function = f'"{schema}".session_import_chunk'
        sql(pg_dsn, f"REVOKE EXECUTE ON FUNCTION {chunk_function} FROM {client_name}")
        with pytest.raises(PermissionDeniedError):
            repo.import_file(path, id="denied", chunk_entries=2)
        assert not repo.exists("denied")
    with PostgresStore(reader_dsn, schema=schema, max_size=2) as reader:
        rows = PostgresSessionRepository(reader, renew_interval=None).snapshot("imp").entries
        assert len(rows) == 5
    _denied(
        reader_dsn,
        f"SELECT \"{schema}\".session_import_registers('imp', 't', '{{}}', '{{}}', '{{}}', '{{}}')",
    )


def test_the_owner_revokes_a_stuck_lease_and_a_client_cannot(
    store: PostgresStore, roles: Roles, pg_dsn: str, schema: str
) -> None:
    from pglease import LeaseLostError
    from pglease.admin import revoke_lease

    rid = store.ensure_resource("job", "stuck")
    stuck = store.claim(rid, A, 600)
    assert stuck is not None
    name, dsn = roles.make("client")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant(conn, schema, name, "client")
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(PermissionDeniedError):
        revoke_lease(conn, schema, rid)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        done = revoke_lease(conn, schema, rid)
        assert done.revoked and done.holder == A and done.generation == stuck.generation + 1
        again = revoke_lease(conn, schema, rid)
        assert not again.revoked and again.revision == done.revision
    with pytest.raises(LeaseLostError):
        store.mutate(Permit(rid, done.revision, stuck), "job.step")
    with pytest.raises(LeaseLostError):
        store.renew(stuck, 30)
    events = store.events(rid)
    assert [e.type for e in events] == ["lease.claimed", "lease.revoked"]
    assert events[-1].lease_generation == done.generation and events[-1].actor == A
    # Nobody can claim before the revoked holder's last granted expiry (600 s).
    assert store.claim(rid, B, 30) is None
