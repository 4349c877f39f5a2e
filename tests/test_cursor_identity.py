"""Cursors carry identity: a cursor that is not a position in this store's log is refused.

Ahead of the log (forged, another server, a newer copy) -> `CursorAheadError`;
from another history (another schema, a restored backup, events lost in a
failover) -> `HistoryDivergedError`; never a silent skip or re-delivery. v1
cursors, normal resumes and resumes after a prune keep working.
"""

from __future__ import annotations

import shutil
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    CursorAheadError,
    CursorExpiredError,
    ForeignCursorError,
    HistoryDivergedError,
    Owner,
    Permit,
    PostgresStore,
    WatchError,
)
from pglease.cursors import encode_cursor, parse_cursor
from pglease.roles import grant
from pglease.sqlite import AsyncSqliteStore, SqliteStore
from pglease.types import Event
from pglease.watch import AsyncWatcher, Watcher, prune

from .backends import Backend
from .test_trust import Roles, roles  # noqa: F401  (the fixture)

A = Owner("host", "a")


def _write(store: Any, rid: str, n: int, what: str = "run.step") -> list[int]:
    """`n` unleased writes on `rid`; returns the new revisions."""
    revisions = []
    for _ in range(n):
        current = store.get(rid).revision
        revisions.append(store.mutate(Permit(rid, current), what).revision)
    return revisions


def _watch(backend: Backend, after: str, n: int, timeout: float = 5.0) -> list[Event]:
    """Open a watcher on any backend from `after` and take up to `n` events."""
    if not backend.is_async:
        with backend.store.watch(after=after) as w:
            out: list[Event] = []
            while len(out) < n and (event := w.get(timeout)) is not None:
                out.append(event)
            return out

    async def run() -> list[Event]:
        w = backend.store._store.watch(after=after)
        try:
            await w.start()
            out: list[Event] = []
            while len(out) < n and (event := await w.get(timeout)) is not None:
                out.append(event)
            return out
        finally:
            await w.aclose()

    return backend._loop.run(run())  # type: ignore[attr-defined,no-any-return]


def _ahead(cursor: str) -> str:
    """The same cursor moved far beyond the log's end (xid on PostgreSQL, id on SQLite)."""
    c = parse_cursor(cursor)
    xid, event_id = c.position
    if xid == 0:
        return encode_cursor(c.position._replace(event_id=event_id + 1000), c.check)
    return encode_cursor(c.position._replace(xid=xid + 10**9), c.check)


def _v1(cursor: str) -> str:
    return encode_cursor(parse_cursor(cursor).position)


# --- every backend -------------------------------------------------------------------------


def test_cursor_ahead_of_the_log_is_refused(backend: Backend) -> None:
    s = backend.store
    rid = s.ensure_resource("run", "ahead")
    _write(s, rid, 3)
    last = s.events_after()[-1]
    for forged in (_ahead(last.cursor), _v1(_ahead(last.cursor))):
        with pytest.raises(CursorAheadError) as refused:
            s.events_after(forged)
        # Names the cursor and the log's end, and says what to do.
        assert forged in str(refused.value) and "resync" in str(refused.value)
        assert isinstance(refused.value, ForeignCursorError | WatchError)
        with pytest.raises(CursorAheadError):
            _watch(backend, forged, 1, timeout=0.2)
    # The genuine cursor still resumes.
    _write(s, rid, 1)
    assert [e.revision for e in s.events_after(last.cursor)] == [4]
    assert [e.revision for e in _watch(backend, last.cursor, 1)] == [4]


def test_v2_cursors_resume_normally(backend: Backend) -> None:
    s = backend.store
    rid = s.ensure_resource("run", "pages")
    _write(s, rid, 7)
    seen: list[Event] = []
    cursor = None
    # The log reads only below the oldest running transaction (a concurrent
    # autoanalyze, say, holds it back for a moment): page on until all 7 are
    # readable, bounded.
    deadline = time.monotonic() + 30
    while len(seen) < 7 and time.monotonic() < deadline:
        page = s.events_after(cursor, limit=3)
        if not page:
            time.sleep(0.05)
            continue
        seen.extend(page)
        cursor = page[-1].cursor
    assert s.events_after(cursor, limit=3) == []
    assert [e.revision for e in seen] == list(range(1, 8))
    assert all(parse_cursor(e.cursor).check is not None for e in seen)
    assert [e.revision for e in _watch(backend, seen[2].cursor, 4)] == [4, 5, 6, 7]
    # "start" and None are unchanged.
    assert s.events_after("start") == s.events_after(None) == seen


def test_v1_cursors_are_still_accepted(backend: Backend) -> None:
    s = backend.store
    rid = s.ensure_resource("run", "v1")
    _write(s, rid, 4)
    events = s.events_after()
    old = _v1(events[1].cursor)  # what pglease produced before v2
    assert parse_cursor(old).check is None
    assert [e.revision for e in s.events_after(old)] == [3, 4]
    assert [e.revision for e in _watch(backend, old, 2)] == [3, 4]


def test_a_changed_event_under_the_cursor_is_divergence(backend: Backend) -> None:
    """The event at the cursor's position now has other content (the same revision
    written again after a restore, at the same position): refused, not re-delivered."""
    s = backend.store
    rid = s.ensure_resource("run", "changed")
    _write(s, rid, 3)
    cursor = s.events_after()[-1].cursor
    event_id = parse_cursor(cursor).position.event_id
    if backend.name.startswith("sqlite"):
        db = sqlite3.connect(backend.path, isolation_level=None)  # type: ignore[attr-defined]
        db.execute("UPDATE events SET created_at = created_at + 1 WHERE id = ?", (event_id,))
        db.close()
    else:
        with psycopg.connect(backend.dsn, autocommit=True) as conn:  # type: ignore[attr-defined]
            conn.execute(
                f'UPDATE "{backend.schema}".events'  # type: ignore[attr-defined]
                " SET created_at = created_at + interval '1 microsecond' WHERE id = %s",
                [event_id],
            )
    with pytest.raises(HistoryDivergedError) as refused:
        s.events_after(cursor)
    assert "another event" in str(refused.value)
    with pytest.raises(HistoryDivergedError):
        _watch(backend, cursor, 1, timeout=0.2)
    # v1 cursors carry no check: only "not ahead" applies to them (documented).
    assert s.events_after(_v1(cursor)) == []


# --- PostgreSQL: another schema, lost events, prune --------------------------------------


@pytest.fixture
def other_schema(pg_dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _same_steps(store: PostgresStore) -> str:
    rid = store.ensure_resource("run", "same")
    claim = store.claim(rid, A, 30)
    assert claim is not None
    store.release(claim)
    _write(store, rid, 2)
    return rid


def test_cursor_from_another_log_is_refused(
    pg_store: PostgresStore, pg_dsn: str, other_schema: str
) -> None:
    """Schema B built by the same steps (same resource ids and revisions) is still
    another history: a cursor of A is refused there, by events_after and watchers."""
    _same_steps(pg_store)
    with PostgresStore(pg_dsn, schema=other_schema, max_size=2) as other:
        _same_steps(other)
        a_events, b_events = pg_store.events_after(), other.events_after()
        assert [(e.resource_id, e.revision) for e in a_events] == [
            (e.resource_id, e.revision) for e in b_events
        ]
        cursor = a_events[1].cursor
        with pytest.raises(HistoryDivergedError) as refused:
            other.events_after(cursor)
        assert "missing" in str(refused.value)
        with pytest.raises(HistoryDivergedError):
            Watcher(other, after=cursor)
        # An idle watcher's cursor (a position between events) is checked too.
        with Watcher(pg_store, after="start") as w:
            assert len([w.get(5) for _ in a_events]) == len(a_events)
            assert w.get(0.1) is None
            idle = w.cursor
        assert parse_cursor(idle).check == parse_cursor(a_events[-1].cursor).check
        with pytest.raises(HistoryDivergedError):
            other.events_after(idle)
        with pytest.raises(HistoryDivergedError):
            Watcher(other, after=idle)
        assert pg_store.events_after(idle) == []


def test_lost_events_are_divergence_not_a_silent_skip(pg_store: PostgresStore, pg_dsn: str) -> None:
    """An asynchronous failover that lost the last events, then new writes on the new
    primary: a watcher resuming from a lost event is refused, not resumed silently."""
    rid = pg_store.ensure_resource("run", "failover")
    _write(pg_store, rid, 3)
    events = pg_store.events_after()
    seen = events[-1].cursor  # the watcher got revision 3 ...
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # ... which the new primary lacks
        conn.execute(f'DELETE FROM "{pg_store.schema}".events WHERE id = %s', [events[-1].id])
    _write(pg_store, rid, 2, "run.other")
    with pytest.raises(HistoryDivergedError):
        pg_store.events_after(seen)
    with pytest.raises(HistoryDivergedError):
        Watcher(pg_store, after=seen, mode="poll")
    # The survivors' cursors still resume: what follows them is this server's log.
    assert [e.type for e in pg_store.events_after(events[1].cursor)] == ["run.other"] * 2


def test_a_refused_watcher_never_joins_the_shared_hub(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "hub")
    _write(pg_store, rid, 1)
    forged = _ahead(pg_store.events_after()[-1].cursor)
    with Watcher(pg_store, after="now") as good:
        with pytest.raises(CursorAheadError):
            Watcher(pg_store, after=forged)
        _write(pg_store, rid, 1)
        got = good.get(5)
        assert got is not None and got.revision == 2
        assert parse_cursor(good.cursor).check is not None


def test_resume_after_prune_follows_the_horizon_rules(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "pruned")
    _write(pg_store, rid, 3)
    old = pg_store.events_after()
    with Watcher(pg_store, after="start") as w:
        assert [w.get(5) for _ in old] == old
        idle = w.cursor  # anchored on revision 3, about to be pruned
    assert prune(pg_store, 0) == 3
    _write(pg_store, rid, 1)
    # At the horizon (the last pruned event) or past it: nothing was lost.
    for cursor in (old[-1].cursor, idle):
        assert [e.revision for e in pg_store.events_after(cursor)] == [4]
        with Watcher(pg_store, after=cursor) as w:
            got = w.get(5)
            assert got is not None and got.revision == 4
    # Below it: expired, by events_after too now, never a silent skip.
    with pytest.raises(CursorExpiredError):
        pg_store.events_after(old[0].cursor)
    with Watcher(pg_store, after=old[0].cursor) as stale, pytest.raises(CursorExpiredError):
        stale.get(5)


def test_reader_and_client_roles_can_check_cursors(
    pg_store: PostgresStore,
    roles: Roles,  # noqa: F811
    pg_dsn: str,
    schema: str,
) -> None:
    """The check reads only tables both roles may SELECT."""
    rid = pg_store.ensure_resource("run", "roles")
    _write(pg_store, rid, 2)
    first = pg_store.events_after()[0].cursor
    for kind in ("reader", "client"):
        name, dsn = roles.make(kind)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            grant(conn, schema, name, kind)
        with PostgresStore(dsn, schema=schema, max_size=2) as limited:
            assert [e.revision for e in limited.events_after(first)] == [2]
            with pytest.raises(CursorAheadError):
                limited.events_after(_ahead(first))
            with limited.watch(after=first) as w:
                got = w.get(5)
                assert got is not None and got.revision == 2
            with limited.watch(after="now") as w:
                assert parse_cursor(w.cursor).check is not None
            with pytest.raises(CursorAheadError):
                limited.watch(after=_ahead(first))


async def test_async_watcher_checks_its_cursor(apg_store: AsyncPostgresStore) -> None:
    rid = await apg_store.ensure_resource("run", "async")
    for revision in range(2):
        await apg_store.mutate(Permit(rid, revision), "run.step")
    events = await apg_store.events_after()
    with pytest.raises(CursorAheadError):
        async with AsyncWatcher(apg_store, after=_ahead(events[0].cursor)):
            pass
    async with AsyncWatcher(apg_store, after=events[0].cursor) as w:
        got = await w.get(5)
        assert got is not None and got.revision == 2


# --- SQLite: the file replaced by an older copy ------------------------------------------


def _backup(path: Path, to: Path) -> None:
    src, dst = sqlite3.connect(path), sqlite3.connect(to)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def _restore(backup: Path, path: Path) -> None:
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    shutil.copyfile(backup, path)


def test_sqlite_file_restored_from_an_older_copy(tmp_path: Path) -> None:
    path, backup = tmp_path / "leases.db", tmp_path / "backup.db"
    with SqliteStore(path) as store:
        rid = store.ensure_resource("run", "restored")
        _write(store, rid, 2)
        _backup(path, backup)
        _write(store, rid, 2)
        events = store.events_after()
        with store.watch(after="now") as w:
            now_cursor = w.cursor
    seen = events[-1].cursor
    assert now_cursor == seen  # "now" names the last event, with its check
    _restore(backup, path)
    with SqliteStore(path) as store:
        # The older copy ends before the cursor.
        with pytest.raises(CursorAheadError):
            store.events_after(seen)
        with pytest.raises(CursorAheadError):
            store.watch(after=seen)
        # The application goes on writing: the same ids and revisions, other events.
        _write(store, rid, 2, "run.rewritten")
        with pytest.raises(HistoryDivergedError):
            store.events_after(seen)
        with pytest.raises(HistoryDivergedError):
            store.watch(after=seen)
        # A cursor from before the backup is this file's history: it resumes.
        assert [e.type for e in store.events_after(events[1].cursor)] == ["run.rewritten"] * 2


async def test_async_sqlite_watcher_checks_its_cursor(tmp_path: Path) -> None:
    path, backup = tmp_path / "leases.db", tmp_path / "backup.db"
    async with AsyncSqliteStore(path) as store:
        rid = await store.ensure_resource("run", "restored")
        await store.mutate(Permit(rid, 0), "run.step")
        _backup(path, backup)
        await store.mutate(Permit(rid, 1), "run.step")
        seen = (await store.events_after())[-1].cursor
    _restore(backup, path)
    async with AsyncSqliteStore(path) as store:
        await store.mutate(Permit(rid, 1), "run.rewritten")
        with pytest.raises(HistoryDivergedError):
            async with store.watch(after=seen):
                pass
        first = (await store.events_after())[0].cursor
        async with store.watch(after=first) as w:
            got = await w.get(5)
            assert got is not None and got.type == "run.rewritten"
