"""Prune in bounded chunks (sql/0014, prune_chunk and gc_payloads_chunk in
sql/functions/20_watch.sql): the same result as the single-transaction prune,
one short transaction per chunk, no gap or duplicate for a watcher across it,
the typed error for a cursor below the horizon, and payload collection that
only looks at the payloads of deleted events.

Real PostgreSQL, real watchers, real concurrent connections.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    CursorExpiredError,
    DatabaseError,
    Event,
    PermissionDeniedError,
    Permit,
    PgleaseError,
    PostgresStore,
    ValidationError,
)
from pglease.migrations import grant, migrate
from pglease.payloads import canonical_payload
from pglease.watch import Watcher, prune, prune_async
from pglease.watch.prune import DEFAULT_CHUNK

from .conftest import enable_test_clock

LONG_AGO = datetime.now(UTC) - timedelta(days=2)
DAY = 86400.0


def sha(payload: Any) -> bytes:
    return canonical_payload(payload).sha256


def rows(dsn: str, schema: str, query: str, args: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(r) for r in conn.execute(query.replace("@s", f'"{schema}"'), args).fetchall()]


def payloads(dsn: str, schema: str) -> set[bytes]:
    return {bytes(r[0]) for r in rows(dsn, schema, "SELECT sha256 FROM @s.payloads")}


def queued(dsn: str, schema: str) -> set[bytes]:
    return {bytes(r[0]) for r in rows(dsn, schema, "SELECT sha256 FROM @s.payload_gc_queue")}


def left(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    """What is left of the log, in read order, without anything schema-specific."""
    return rows(
        dsn,
        schema,
        "SELECT r.key, e.revision, e.type, e.payload_sha256 FROM @s.events e"
        " JOIN @s.resources r ON r.id = e.resource_id ORDER BY e.xid, e.id",
    )


def horizon(dsn: str, schema: str) -> tuple[Any, ...]:
    [row] = rows(dsn, schema, "SELECT pruned_xid::text, pruned_id, pruned_at FROM @s.event_horizon")
    return row


# Old and recent events, interleaved: the prefix ends at the first recent one,
# and old events after it stay. Payloads shared between deleted and kept
# events, unique to deleted ones, and none.
WORKLOAD: list[tuple[str, bool, Any]] = [
    ("a", True, {"p": "shared"}),
    ("b", True, {"p": "gone1"}),
    ("a", True, None),
    ("c", True, {"p": "gone2"}),
    ("b", True, {"p": "shared"}),
    ("a", True, {"p": "gone1"}),
    ("c", True, {"p": "later"}),
    ("a", False, {"p": "shared"}),  # the first keeper
    ("b", True, {"p": "later"}),  # old, but after a keeper: stays
    ("c", False, None),
]


def build(store: PostgresStore) -> None:
    for key, old, payload in WORKLOAD:
        rid = store.ensure_resource("run", key)
        revision = store.get(rid).revision
        now = LONG_AGO if old else None
        store.mutate(Permit(rid, revision), "run.step", payload=payload, now=now)


def old_prune(dsn: str, schema: str, older_than: float) -> tuple[int, int]:
    """The prune before 0014, statement for statement: one transaction, one
    delete of the whole prefix, then an anti-join of every payload."""
    with psycopg.connect(dsn) as conn:
        conn.execute(f'SELECT 1 FROM "{schema}".event_horizon FOR UPDATE')
        xmin, cutoff = conn.execute(
            "SELECT pg_snapshot_xmin(pg_current_snapshot()),"
            " clock_timestamp() - make_interval(secs => %s)",
            [older_than],
        ).fetchone() or (None, None)
        keep = conn.execute(
            f'SELECT xid, id FROM "{schema}".events WHERE created_at >= %s OR xid >= %s'
            " ORDER BY xid, id LIMIT 1",
            [cutoff, xmin],
        ).fetchone()
        events = conn.execute(
            f'DELETE FROM "{schema}".events e WHERE e.xid < %s'
            " AND (%s::xid8 IS NULL OR (e.xid, e.id) < (%s::xid8, %s::bigint))",
            [xmin, keep and keep[0], keep and keep[0], keep and keep[1]],
        ).rowcount
        gone = conn.execute(
            f'DELETE FROM "{schema}".payloads p WHERE NOT EXISTS'
            f' (SELECT 1 FROM "{schema}".events e WHERE e.payload_sha256 = p.sha256)'
        ).rowcount
    return events, gone


@pytest.fixture
def twin(pg_dsn: str) -> Iterator[PostgresStore]:
    """A second store, in its own schema, for the reference prune."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with PostgresStore(pg_dsn, schema=name, max_size=2) as store:
        enable_test_clock(pg_dsn, name)
        yield store
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


# --------------------------------------------------------------------------- same result


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, DEFAULT_CHUNK])
def test_chunked_prune_leaves_what_the_old_prune_left(
    pg_store: PostgresStore, twin: PostgresStore, pg_dsn: str, chunk: int
) -> None:
    build(pg_store)
    build(twin)
    result = prune(pg_store, DAY, chunk=chunk)
    assert old_prune(pg_dsn, twin.schema, DAY) == (result.events, result.payloads) == (7, 2)
    assert left(pg_dsn, pg_store.schema) == left(pg_dsn, twin.schema)
    assert [r[:2] for r in left(pg_dsn, pg_store.schema)] == [("a", 4), ("b", 3), ("c", 3)]
    assert payloads(pg_dsn, pg_store.schema) == payloads(pg_dsn, twin.schema)
    assert payloads(pg_dsn, pg_store.schema) == {sha({"p": "shared"}), sha({"p": "later"})}
    assert queued(pg_dsn, pg_store.schema) == set()  # every candidate was judged
    # Everything, then: again the same.
    result = prune(pg_store, 0, chunk=chunk)
    assert old_prune(pg_dsn, twin.schema, 0) == (result.events, result.payloads) == (3, 2)
    assert left(pg_dsn, pg_store.schema) == left(pg_dsn, twin.schema) == []
    assert payloads(pg_dsn, pg_store.schema) == payloads(pg_dsn, twin.schema) == set()


def test_prune_log_single_transaction_gives_the_same_result(
    pg_store: PostgresStore, twin: PostgresStore, pg_dsn: str
) -> None:
    # The SQL entry points kept for direct callers run the chunks in one transaction.
    build(pg_store)
    build(twin)
    [got] = rows(pg_dsn, pg_store.schema, "SELECT * FROM @s.prune_log(interval '1 day')")
    assert got == old_prune(pg_dsn, twin.schema, DAY) == (7, 2)
    assert left(pg_dsn, pg_store.schema) == left(pg_dsn, twin.schema)
    assert payloads(pg_dsn, pg_store.schema) == payloads(pg_dsn, twin.schema)


async def test_prune_async_in_chunks(apg_store: AsyncPostgresStore, pg_dsn: str) -> None:
    rid = await apg_store.ensure_resource("run", "async")
    for n in range(5):
        await apg_store.mutate(Permit(rid, n), "run.old", payload={"n": n % 2}, now=LONG_AGO)
    await apg_store.mutate(Permit(rid, 5), "run.new", payload={"n": 1})
    result = await prune_async(apg_store, DAY, chunk=2)
    assert (result.events, result.payloads) == (5, 1)  # {"n": 1} is still referenced
    assert payloads(pg_dsn, apg_store.schema) == {sha({"n": 1})}
    with pytest.raises(ValidationError, match="chunk"):
        await prune_async(apg_store, 0, chunk=0)
    assert len(left(pg_dsn, apg_store.schema)) == 1


# ------------------------------------------------------------------ one transaction per chunk


def _count_deleting_transactions(dsn: str, schema: str) -> None:
    # A statement trigger records the xid of every transaction that deletes events.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".delete_xacts (xid xid8, n bigint);'
            f' CREATE FUNCTION "{schema}".note_delete() RETURNS trigger LANGUAGE plpgsql AS $$'
            f' BEGIN INSERT INTO "{schema}".delete_xacts SELECT pg_current_xact_id(), count(*)'
            " FROM gone; RETURN NULL; END $$;"
            f' CREATE TRIGGER note_delete AFTER DELETE ON "{schema}".events'
            " REFERENCING OLD TABLE AS gone FOR EACH STATEMENT"
            f' EXECUTE FUNCTION "{schema}".note_delete()'
        )


@pytest.mark.parametrize(("chunk", "sizes"), [(2, [2, 2, 2, 1]), (3, [3, 3, 1]), (7, [7])])
def test_each_chunk_is_its_own_transaction_of_at_most_chunk_events(
    pg_store: PostgresStore, pg_dsn: str, chunk: int, sizes: list[int]
) -> None:
    rid = pg_store.ensure_resource("run", "tx")
    for n in range(7):
        pg_store.mutate(Permit(rid, n), "run.old", now=LONG_AGO)
    _count_deleting_transactions(pg_dsn, pg_store.schema)
    assert prune(pg_store, DAY, chunk=chunk) == 7
    got = rows(pg_dsn, pg_store.schema, "SELECT xid::text, n FROM @s.delete_xacts ORDER BY xid")
    assert [n for _, n in got] == sizes
    assert len({xid for xid, _ in got}) == len(sizes)  # each its own transaction


def test_prune_chunk_raises_the_horizon_chunk_by_chunk(
    pg_store: PostgresStore, pg_dsn: str
) -> None:
    rid = pg_store.ensure_resource("run", "h")
    for n in range(5):
        pg_store.mutate(Permit(rid, n), "run.old", now=LONG_AGO)
    ids = [r[0] for r in rows(pg_dsn, pg_store.schema, "SELECT id FROM @s.events ORDER BY xid, id")]
    chunk = "SELECT events, done FROM @s.prune_chunk(clock_timestamp() - interval '1 day', 2)"
    assert rows(pg_dsn, pg_store.schema, chunk) == [(2, False)]
    assert horizon(pg_dsn, pg_store.schema)[1] == ids[1]
    assert rows(pg_dsn, pg_store.schema, chunk) == [(2, False)]
    assert horizon(pg_dsn, pg_store.schema)[1] == ids[3]
    assert rows(pg_dsn, pg_store.schema, chunk) == [(1, True)]
    assert horizon(pg_dsn, pg_store.schema)[1] == ids[4]
    before = horizon(pg_dsn, pg_store.schema)
    assert rows(pg_dsn, pg_store.schema, chunk) == [(0, True)]
    assert horizon(pg_dsn, pg_store.schema) == before  # nothing deleted: unchanged


# --------------------------------------------------------------------------- watchers


def test_watcher_across_a_chunked_prune_sees_no_gap_and_no_duplicate(
    pg_store: PostgresStore, pg_dsn: str
) -> None:
    rids = [pg_store.ensure_resource("run", f"w{i}") for i in range(3)]
    for n in range(40):
        rid = rids[n % 3]
        pg_store.mutate(Permit(rid, pg_store.get(rid).revision), "run.old", now=LONG_AGO)
    with Watcher(pg_store, after="start") as watcher:
        seen: list[Event] = []
        while len(seen) < 40:
            event = watcher.get(10)
            assert event is not None, "watcher stalled before the prune"
            seen.append(event)
        # Now a writer and a prune of the old events run while the watcher reads.
        errors: list[BaseException] = []

        def write() -> None:
            try:
                for n in range(60):
                    rid = rids[n % 3]
                    pg_store.mutate(Permit(rid, pg_store.get(rid).revision), "run.new")
            except BaseException as exc:  # reported below
                errors.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        result = prune(pg_store, DAY, chunk=3)
        while len(seen) < 100:
            event = watcher.get(15)
            assert event is not None, "watcher stalled across the prune"
            seen.append(event)
        writer.join(30)
        assert not writer.is_alive() and errors == []
        assert watcher.get(0.2) is None  # nothing more, nothing twice
    assert result == 40
    by_resource: dict[str, list[int]] = {}
    for event in seen:
        by_resource.setdefault(event.resource_id, []).append(event.revision)
    # Every revision of every resource exactly once, in order.
    for rid in rids:
        assert by_resource[rid] == list(range(1, len(by_resource[rid]) + 1))
    assert sum(len(v) for v in by_resource.values()) == 100
    assert [e.type for e in seen[40:]] == ["run.new"] * 60


def test_a_cursor_below_the_horizon_gets_the_typed_error(
    pg_store: PostgresStore, pg_dsn: str
) -> None:
    rid = pg_store.ensure_resource("run", "exp")
    for n in range(9):
        pg_store.mutate(Permit(rid, n), "run.old", now=LONG_AGO)
    pg_store.mutate(Permit(rid, 9), "run.new")
    with Watcher(pg_store, after="start") as w:
        early = [w.get(10) for _ in range(3)]
    assert all(e is not None for e in early)
    assert prune(pg_store, DAY, chunk=2) == 9
    # Below the horizon: typed, and again on retry, never a silent skip to rev 10.
    assert early[0] is not None
    with Watcher(pg_store, after=early[0].cursor) as stale:
        for _ in range(2):
            with pytest.raises(CursorExpiredError):
                stale.get(5)
    # "start" reads what is left.
    with Watcher(pg_store, after="start") as w:
        event = w.get(10)
        assert event is not None and event.revision == 10


def test_a_cursor_between_chunks_gets_the_typed_error(pg_store: PostgresStore) -> None:
    # One chunk has gone (horizon past the cursor), the rest not yet.
    rid = pg_store.ensure_resource("run", "mid")
    for n in range(6):
        pg_store.mutate(Permit(rid, n), "run.old", now=LONG_AGO)
    with Watcher(pg_store, after="start") as w:
        first = w.get(10)
    assert first is not None
    with pg_store.connection() as conn:
        conn.execute(
            f'SELECT * FROM "{pg_store.schema}".prune_chunk('
            "clock_timestamp() - interval '1 day', 2)"
        )
    with Watcher(pg_store, after=first.cursor) as stale, pytest.raises(CursorExpiredError):
        stale.get(5)
    assert [e.revision for e in pg_store.events(rid)] == [3, 4, 5, 6]


# --------------------------------------------------------------------------- payload queue


def test_a_payload_a_writer_holds_stays_queued_until_the_next_prune(
    pg_store: PostgresStore, pg_dsn: str
) -> None:
    rid = pg_store.ensure_resource("run", "held")
    payload = {"held": True}
    text = canonical_payload(payload).text
    pg_store.mutate(Permit(rid, 0), "run.old", payload=payload, now=LONG_AGO)
    schema = pg_store.schema
    with psycopg.connect(pg_dsn) as writer:
        # mutate_begin's reuse of a stored payload: FOR KEY SHARE, event not committed.
        writer.execute(
            f'SELECT * FROM "{schema}".mutate_begin(%s, 1, %s, NULL, NULL, NULL, NULL,'
            " 'host', 'w', %s, NULL)",
            [rid, "run.new", text],
        )
        result = prune(pg_store, DAY)
        assert (result.events, result.payloads) == (1, 0)
        assert queued(pg_dsn, schema) == {sha(payload)}  # judged again later
        writer.rollback()
    # The writer gave up: the next prune (with nothing to delete) collects it.
    result = prune(pg_store, DAY)
    assert (result.events, result.payloads) == (0, 1)
    assert payloads(pg_dsn, schema) == set() and queued(pg_dsn, schema) == set()


def test_a_queued_payload_referenced_again_stays(pg_store: PostgresStore, pg_dsn: str) -> None:
    rid = pg_store.ensure_resource("run", "again")
    payload = {"again": 1}
    pg_store.mutate(Permit(rid, 0), "run.old", payload=payload, now=LONG_AGO)
    schema = pg_store.schema
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'SELECT * FROM "{schema}".prune_chunk(clock_timestamp(), 10)')
        assert queued(pg_dsn, schema) == {sha(payload)}
        pg_store.mutate(Permit(rid, 1), "run.new", payload=payload)  # referenced again
        assert conn.execute(
            f"SELECT * FROM \"{schema}\".gc_payloads_chunk('\\x', 10)"
        ).fetchall() == [(0, sha(payload), True)]
    assert payloads(pg_dsn, schema) == {sha(payload)}
    assert queued(pg_dsn, schema) == set()  # the next prune of its event queues it again
    assert prune(pg_store, 0).payloads == 1


def test_an_unqueued_orphan_is_left_alone(pg_store: PostgresStore, pg_dsn: str) -> None:
    # Collection reads the queue, never the whole payload table.
    digest = sha({"orphan": 1})
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{pg_store.schema}".payloads (sha256, body) VALUES (%s, %s)',
            [digest, canonical_payload({"orphan": 1}).text],
        )
    result = prune(pg_store, 0)
    assert (result.events, result.payloads) == (0, 0)
    assert payloads(pg_dsn, pg_store.schema) == {digest}


def test_migration_0014_queues_the_orphans_already_there(pg_dsn: str, schema: str) -> None:
    with PostgresStore(pg_dsn, schema=schema, max_size=2) as store:
        rid = store.ensure_resource("run", "mig")
        store.mutate(Permit(rid, 0), "run.a", payload={"kept": 1})
    digest = sha({"orphan": 2})
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # The schema as it was before 0014, with an orphan left by an older prune.
        conn.execute(f'DROP TABLE "{schema}".payload_gc_queue')
        conn.execute(f'DELETE FROM "{schema}".schema_migrations WHERE version = 14')
        conn.execute(
            f'INSERT INTO "{schema}".payloads (sha256, body) VALUES (%s, %s)',
            [digest, canonical_payload({"orphan": 2}).text],
        )
        migrate(conn, schema)
    assert queued(pg_dsn, schema) == {digest}
    with PostgresStore(pg_dsn, schema=schema, max_size=2) as store:
        result = prune(store, DAY)
    assert (result.events, result.payloads) == (0, 1)
    assert payloads(pg_dsn, schema) == {sha({"kept": 1})}


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("chunk", [0, -1, 100_001, True, 2.5, "10", None])
def test_a_bad_chunk_changes_nothing(pg_store: PostgresStore, pg_dsn: str, chunk: Any) -> None:
    rid = pg_store.ensure_resource("run", "bad")
    pg_store.mutate(Permit(rid, 0), "run.old", payload={"b": 1}, now=LONG_AGO)
    before = (left(pg_dsn, pg_store.schema), horizon(pg_dsn, pg_store.schema))
    with pytest.raises(ValidationError, match="chunk"):
        prune(pg_store, 0, chunk=chunk)
    assert (left(pg_dsn, pg_store.schema), horizon(pg_dsn, pg_store.schema)) == before


@pytest.mark.parametrize(
    "call",
    [
        "prune_chunk(NULL, 10)",
        "prune_chunk(clock_timestamp() + interval '1 hour', 10)",
        "prune_chunk(clock_timestamp(), 0)",
        "prune_chunk(clock_timestamp(), 100001)",
        "prune_chunk(clock_timestamp(), NULL)",
        "gc_payloads_chunk(NULL, 10)",
        "gc_payloads_chunk('\\x', 0)",
        "prune_log(interval '-1 second')",
    ],
)
def test_the_sql_functions_check_their_input(
    pg_store: PostgresStore, pg_dsn: str, call: str
) -> None:
    rid = pg_store.ensure_resource("run", "sqlbad")
    pg_store.mutate(Permit(rid, 0), "run.old", payload={"s": 1}, now=LONG_AGO)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'SELECT * FROM "{pg_store.schema}".prune_chunk(clock_timestamp(), 1)')
        pg_store.mutate(Permit(rid, 1), "run.old", payload={"s": 2}, now=LONG_AGO)
        before = (
            left(pg_dsn, pg_store.schema),
            horizon(pg_dsn, pg_store.schema),
            queued(pg_dsn, pg_store.schema),
            payloads(pg_dsn, pg_store.schema),
        )
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(f'SELECT * FROM "{pg_store.schema}".{call}')
    assert caught.value.diag.sqlstate == "PGL20"
    after = (
        left(pg_dsn, pg_store.schema),
        horizon(pg_dsn, pg_store.schema),
        queued(pg_dsn, pg_store.schema),
        payloads(pg_dsn, pg_store.schema),
    )
    assert after == before


def test_a_negative_age_changes_nothing(pg_store: PostgresStore, pg_dsn: str) -> None:
    rid = pg_store.ensure_resource("run", "neg")
    pg_store.mutate(Permit(rid, 0), "run.old", now=LONG_AGO)
    with pytest.raises(ValidationError, match="older_than"):
        prune(pg_store, -1)
    assert len(left(pg_dsn, pg_store.schema)) == 1


def test_a_client_role_may_not_prune(pg_store: PostgresStore, pg_dsn: str) -> None:
    rid = pg_store.ensure_resource("run", "role")
    pg_store.mutate(Permit(rid, 0), "run.old", payload={"r": 1}, now=LONG_AGO)
    name = f"pgl_prune_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
        grant(conn, pg_store.schema, name, "client")
    try:
        dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=name)
        with PostgresStore(dsn, schema=pg_store.schema, max_size=1, auto_migrate=False) as client:
            with pytest.raises(PermissionDeniedError, match="prune_chunk"):
                prune(client, 0)
            gc = f"SELECT * FROM \"{pg_store.schema}\".gc_payloads_chunk('\\x', 1)"
            with client.connection() as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(gc)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{name}"')
            conn.execute(f'DROP ROLE "{name}"')
    assert len(left(pg_dsn, pg_store.schema)) == 1
    assert payloads(pg_dsn, pg_store.schema) == {sha({"r": 1})}


# --------------------------------------------------------------------------- CLI


def _cli(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_prune_chunk(pg_store: PostgresStore, pg_dsn: str) -> None:
    rid = pg_store.ensure_resource("run", "cli")
    for n in range(5):
        pg_store.mutate(Permit(rid, n), "run.old", payload={"c": n}, now=LONG_AGO)
    _count_deleting_transactions(pg_dsn, pg_store.schema)
    for bad in ("0", "100001", "x"):
        out = _cli(pg_dsn, pg_store.schema, "prune", "--older-than", "1d", "--chunk", bad)
        assert out.returncode == 2 and "--chunk" in out.stderr, out
        assert len(left(pg_dsn, pg_store.schema)) == 5  # nothing deleted
    out = _cli(pg_dsn, pg_store.schema, "prune", "--older-than", "1d", "--chunk", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"deleted": 5, "payloads_deleted": 5}
    got = rows(pg_dsn, pg_store.schema, "SELECT n FROM @s.delete_xacts ORDER BY xid")
    assert [n for (n,) in got] == [2, 2, 1]


# --------------------------------------------------------------------------- failure midway


def test_a_prune_that_fails_midway_keeps_its_chunks_and_the_next_one_finishes(
    pg_dsn: str, schema: str
) -> None:
    with PostgresStore(pg_dsn, schema=schema, max_size=2, lock_timeout=0.3) as store:
        enable_test_clock(pg_dsn, schema)
        rid = store.ensure_resource("run", "fail")
        for n in range(6):
            store.mutate(Permit(rid, n), "run.old", payload={"f": n}, now=LONG_AGO)
        with psycopg.connect(pg_dsn) as blocker:
            # The payload step needs row locks on payloads; the event chunks do not.
            blocker.execute(f'LOCK TABLE "{schema}".payloads IN EXCLUSIVE MODE')
            with pytest.raises(PgleaseError, match=r"prune failed: .*lock timeout") as caught:
                prune(store, DAY, chunk=2)
            blocker.rollback()
        assert isinstance(caught.value, DatabaseError) and caught.value.sqlstate == "55P03"
        # The event chunks committed: the log is a shorter prefix, the horizon at its end.
        assert left(pg_dsn, schema) == []
        assert queued(pg_dsn, schema) == {sha({"f": n}) for n in range(6)}
        with Watcher(store, after="start") as w:
            assert w.get(0.2) is None
        # The next prune collects what the failed one queued.
        result = prune(store, DAY, chunk=2)
        assert (result.events, result.payloads) == (0, 6)
        assert payloads(pg_dsn, schema) == set() and queued(pg_dsn, schema) == set()
