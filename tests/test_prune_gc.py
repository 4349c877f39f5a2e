"""Prune deletes the payloads no remaining event references (sql/0007), and a
writer storing or reusing a payload at that moment never loses it.

Real PostgreSQL; the races are produced with real concurrent connections and
explicit transactions, and each test checks that the writer that was caught in
the middle committed its event with its payload.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pglease import AsyncPostgresStore, Permit, PostgresStore
from pglease.payloads import canonical_payload
from pglease.types import MutationResult
from pglease.watch import prune, prune_async
from pglease.watch.prune import PruneResult
from tests._lock_helpers import lock_waiters, wait_until

LONG_AGO = datetime.now(UTC) - timedelta(days=2)
DAY = 86400.0


def sha(payload: Any) -> bytes:
    return canonical_payload(payload).sha256


def body(payload: Any) -> str:
    return canonical_payload(payload).text


def stored(dsn: str, schema: str) -> set[bytes]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f'SELECT sha256 FROM "{schema}".payloads').fetchall()
    return {bytes(r[0]) for r in rows}


def old_event(store: PostgresStore, rid: str, payload: Any) -> None:
    """An unleased write dated two days ago (`now=` sets the event's created_at)."""
    revision = store.get(rid).revision
    store.mutate(Permit(rid, revision), "run.old", payload=payload, now=LONG_AGO)


class Background:
    """Run a store call in a thread; keep its result or its exception."""

    def __init__(self, call: Callable[[], MutationResult]) -> None:
        self.result: MutationResult | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,))
        self._thread.start()

    def _run(self, call: Callable[[], MutationResult]) -> None:
        try:
            self.result = call()
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self) -> MutationResult:
        self._thread.join(15)
        assert not self._thread.is_alive(), "writer still blocked"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


# --------------------------------------------------------------------------- collection


def test_prune_deletes_only_unreferenced_payloads(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("run", "gc1")
    shared, alone = {"kind": "shared"}, {"kind": "alone"}
    old_event(pg_store, rid, shared)
    old_event(pg_store, rid, alone)
    old_event(pg_store, rid, None)
    revision = pg_store.get(rid).revision
    pg_store.mutate(Permit(rid, revision), "run.new", payload=shared)  # recent: kept
    assert stored(pg_dsn, schema) == {sha(shared), sha(alone)}

    result = prune(pg_store, DAY)
    assert isinstance(result, PruneResult)
    assert (result.events, result.payloads) == (3, 1)
    assert result == 3 and int(result) == 3  # still the event count, as before
    assert repr(result) == "PruneResult(events=3, payloads=1)"
    # `shared` is still referenced by the recent event and readable through it.
    assert stored(pg_dsn, schema) == {sha(shared)}
    [kept] = pg_store.events(rid)
    assert kept.payload == shared

    assert prune(pg_store, DAY).payloads == 0  # nothing more to do
    result = prune(pg_store, 0)
    assert (result.events, result.payloads) == (1, 1)
    assert stored(pg_dsn, schema) == set()


def test_prune_collects_payloads_left_by_earlier_prunes(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    # prune_events before 0007 deleted events but left their payloads; 0014
    # queues such orphans once, and they are collected even when no event is
    # old enough to go now (tests/test_prune_chunks.py replays 0014 itself).
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".payloads (sha256, body) VALUES (%s, %s)',
            [sha({"orphan": 1}), body({"orphan": 1})],
        )
        conn.execute(
            f'INSERT INTO "{schema}".payload_gc_queue (sha256) VALUES (%s)', [sha({"orphan": 1})]
        )
    result = prune(pg_store, DAY)
    assert (result.events, result.payloads) == (0, 1)
    assert stored(pg_dsn, schema) == set()


def test_prune_events_keeps_its_signature_and_collects_too(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    # The 0002 function, for existing callers: returns the event count only.
    rid = pg_store.ensure_resource("run", "gc2")
    old_event(pg_store, rid, {"x": 1})
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            f'SELECT "{schema}".prune_events(make_interval(secs => %s))', [DAY]
        ).fetchone()
    assert row == (1,)
    assert stored(pg_dsn, schema) == set()


async def test_prune_async_reports_payloads(
    apg_store: AsyncPostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = await apg_store.ensure_resource("run", "gc3")
    await apg_store.mutate(Permit(rid, 0), "run.a", payload={"a": 1})
    await apg_store.mutate(Permit(rid, 1), "run.b", payload={"b": 1})
    result = await prune_async(apg_store, 0)
    assert (result.events, result.payloads) == (2, 2)
    assert stored(pg_dsn, schema) == set()


def test_payload_conflict_is_still_refused(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    from pglease import PayloadConflictError

    rid = pg_store.ensure_resource("run", "gc4")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".payloads (sha256, body) VALUES (%s, %s)',
            [sha({"p": 1}), '{"p":2}'],
        )
    with pytest.raises(PayloadConflictError):
        pg_store.mutate(Permit(rid, 0), "run.a", payload={"p": 1})
    assert pg_store.events(rid) == []


# --------------------------------------------------------------------------- races


def test_the_race_is_real_without_the_writer_lock(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """Why mutate_begin locks a reused payload: replaying 0001's unlocked
    statements by hand, a prune between them deletes the payload and the
    writer's event fails its foreign key."""
    rid = pg_store.ensure_resource("run", "race0")
    payload = {"reused": True}
    old_event(pg_store, rid, payload)
    text, digest = body(payload), sha(payload)
    with psycopg.connect(pg_dsn) as writer:
        cur = writer.execute(
            f'INSERT INTO "{schema}".payloads (sha256, body) VALUES (%s, %s)'
            " ON CONFLICT DO NOTHING",
            [digest, text],
        )
        assert cur.rowcount == 0  # already stored: no lock taken
        assert prune(pg_store, DAY).payloads == 1  # the old event and its payload go
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            writer.execute(
                f'INSERT INTO "{schema}".events (resource_id, revision, type, payload_sha256)'
                " VALUES (%s, 99, 'run.lost', %s)",
                [rid, digest],
            )
        writer.rollback()


def test_writer_between_payload_and_event_keeps_its_payload(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """Writer first: mutate_begin has locked the reused payload and is held
    (by a third transaction holding an uncommitted event of the same
    revision: its insert waits on the unique index) before it inserts its
    event. Prune deletes the old event but must leave the payload alone."""
    rid = pg_store.ensure_resource("run", "race1")
    payload = {"reused": 1}
    old_event(pg_store, rid, payload)
    with psycopg.connect(pg_dsn) as gate:
        gate.execute(
            f'INSERT INTO "{schema}".events (resource_id, revision, type)'
            " VALUES (%s, 2, 'gate.hold')",
            [rid],
        )
        writer = Background(lambda: pg_store.mutate(Permit(rid, 1), "run.new", payload=payload))
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".mutate_begin') == 1)
        # The writer is inside mutate_begin, past its payload step, waiting in _bump.
        started = time.monotonic()
        result = prune(pg_store, DAY)
        assert time.monotonic() - started < 5  # prune did not wait for the writer
        assert (result.events, result.payloads) == (1, 0)
        assert sha(payload) in stored(pg_dsn, schema)
        gate.rollback()
    done = writer.join()
    assert done.revision == 2
    [event] = pg_store.events(rid)
    assert (event.type, event.payload) == ("run.new", payload)
    # Once that event is pruned too, the payload goes.
    assert prune(pg_store, 0).payloads == 1
    assert stored(pg_dsn, schema) == set()


def test_writer_open_transaction_keeps_its_payload(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """Writer first, with its whole transaction still open (event inserted,
    not committed): prune skips the payload and never waits."""
    rid = pg_store.ensure_resource("run", "race2")
    payload = {"reused": 2}
    old_event(pg_store, rid, payload)
    with psycopg.connect(pg_dsn) as writer:
        writer.execute(
            f'SELECT * FROM "{schema}".mutate_begin(%s, 1, %s, NULL, NULL, NULL, NULL,'
            " 'host', 'w', %s, NULL)",
            [rid, "run.new", body(payload)],
        )
        result = prune(pg_store, DAY)
        assert (result.events, result.payloads) == (1, 0)
        writer.commit()
    [event] = pg_store.events(rid)
    assert (event.type, event.payload) == ("run.new", payload)


def test_writer_after_prune_locked_the_payload_stores_it_again(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """Prune first, between its two steps: it holds the orphan FOR UPDATE (what
    _gc_payloads' first statement does) and has not deleted it yet. The
    writer's insert finds the row, its locking read waits; when prune deletes
    and commits, the read finds nothing and the writer stores the payload again."""
    rid = pg_store.ensure_resource("run", "race3")
    payload = {"reused": 3}
    digest = sha(payload)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".payloads (sha256, body) VALUES (%s, %s)',
            [digest, body(payload)],
        )
    with psycopg.connect(pg_dsn) as pruner:
        pruner.execute(
            f'SELECT 1 FROM "{schema}".payloads WHERE sha256 = %s FOR UPDATE SKIP LOCKED',
            [digest],
        )
        writer = Background(lambda: pg_store.mutate(Permit(rid, 0), "run.new", payload=payload))
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".mutate_begin') == 1)
        pruner.execute(f'DELETE FROM "{schema}".payloads WHERE sha256 = %s', [digest])
        pruner.commit()
    assert writer.join().revision == 1
    [event] = pg_store.events(rid)
    assert event.payload == payload and event.payload_sha256 == digest
    assert stored(pg_dsn, schema) == {digest}


def test_writer_behind_an_uncommitted_prune_stores_the_payload_again(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """Prune first, whole: prune_log has deleted the payload but not committed.
    The writer's insert waits for that delete, then stores the payload anew."""
    rid = pg_store.ensure_resource("run", "race4")
    payload = {"reused": 4}
    old_event(pg_store, rid, payload)
    with psycopg.connect(pg_dsn) as pruner:
        row = pruner.execute(
            f'SELECT events, payloads FROM "{schema}".prune_log(make_interval(secs => %s))',
            [DAY],
        ).fetchone()
        assert row == (1, 1)
        writer = Background(lambda: pg_store.mutate(Permit(rid, 1), "run.new", payload=payload))
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".mutate_begin') == 1)
        pruner.commit()
    assert writer.join().revision == 2
    [event] = pg_store.events(rid)
    assert (event.type, event.payload) == ("run.new", payload)
    assert stored(pg_dsn, schema) == {sha(payload)}


# --------------------------------------------------------------------------- CLI


def _cli(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_prune_reports_payloads(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    rid = pg_store.ensure_resource("run", "cli")
    old_event(pg_store, rid, {"n": 1})
    old_event(pg_store, rid, {"n": 2})
    old_event(pg_store, rid, None)
    out = _cli(pg_dsn, schema, "prune", "--older-than", "1d")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deleted 3 events and 2 unreferenced payloads"
    pg_store.mutate(Permit(rid, 3), "run.x", payload={"n": 3}, now=LONG_AGO)
    out = _cli(pg_dsn, schema, "prune", "--older-than", "1d", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"deleted": 1, "payloads_deleted": 1}
    out = _cli(pg_dsn, schema, "--json", "prune", "--older-than", "1d")
    assert json.loads(out.stdout) == {"deleted": 0, "payloads_deleted": 0}
    out = _cli(pg_dsn, schema, "prune", "--older-than", "1d")
    assert out.stdout.strip() == "deleted 0 events"
