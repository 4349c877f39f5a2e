"""Watching a SQLite store by polling: same cursor semantics as PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pglease import (
    AsyncSqliteStore,
    InvalidCursorError,
    InvalidResourceTypeError,
    Owner,
    Permit,
    SqliteStore,
    ValidationError,
    WatchClosedError,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    with SqliteStore(tmp_path / "state.sqlite") as s:
        yield s


def test_now_start_and_resume_from_cursor(store: SqliteStore) -> None:
    rid = store.ensure_resource("run", "a")
    store.mutate(Permit(rid, 0), "run.old")
    with store.watch() as now_watcher, store.watch(after="start") as from_start:
        assert now_watcher.get(timeout=0.2) is None  # "now" skips what was there
        store.mutate(Permit(rid, 1), "run.new")
        assert now_watcher.get(timeout=5).type == "run.new"  # type: ignore[union-attr]
        first = from_start.get(timeout=5)
        assert first is not None and first.type == "run.old"
        saved = first.cursor
    with store.watch(after=saved) as resumed:
        event = resumed.get(timeout=5)
        assert event is not None and event.type == "run.new" and event.revision == 2
        assert resumed.get(timeout=0.2) is None
        assert resumed.cursor == event.cursor


def test_filters(store: SqliteStore) -> None:
    run = store.ensure_resource("run", "a")
    session = store.ensure_resource("session", "s")
    with store.watch(after="start", types="session", event_types=["lease.claimed"]) as w:
        store.mutate(Permit(run, 0), "run.x")
        assert store.claim(session, Owner("host", "h"), 5) is not None
        event = w.get(timeout=5)
        assert event is not None and (event.resource_id, event.type) == (session, "lease.claimed")
        assert w.get(timeout=0.2) is None


def test_bad_arguments_and_closed_watcher(store: SqliteStore) -> None:
    with pytest.raises(InvalidCursorError):
        store.watch(after="not-a-cursor")
    with pytest.raises(InvalidResourceTypeError):
        store.watch(types="Bad")
    with pytest.raises(ValidationError):
        store.watch(interval=0)
    watcher = store.watch()
    watcher.close()
    with pytest.raises(WatchClosedError):
        watcher.get(timeout=0)


def test_events_from_another_process_arrive_in_order(store: SqliteStore, tmp_path: Path) -> None:
    rid = store.ensure_resource("run", "shared")
    script = textwrap.dedent(f"""
        from pglease import Permit, SqliteStore
        with SqliteStore({str(tmp_path / "state.sqlite")!r}) as s:
            for rev in range(50):
                s.mutate(Permit({rid!r}, rev), "run.step", payload={{"n": rev}})
    """)
    with store.watch(after="start", interval=0.01) as watcher:
        writer = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, timeout=60, capture_output=True, text=True
        )
        assert writer.returncode == 0, writer.stderr
        got = []
        while len(got) < 50 and (batch := watcher.get_batch(timeout=5)):
            got.extend(batch)
    assert [e.revision for e in got] == list(range(1, 51))
    assert [e.payload["n"] for e in got] == list(range(50))


async def test_async_twin(tmp_path: Path) -> None:
    async with AsyncSqliteStore(tmp_path / "a.sqlite") as astore:
        rid = await astore.ensure_resource("run", "a")
        async with astore.watch(after="now") as watcher:
            await astore.mutate(Permit(rid, 0), "run.step")
            event = await watcher.get(timeout=5)
            assert event is not None and event.type == "run.step"
            await astore.mutate(Permit(rid, 1), "run.more")
            async for event in watcher:
                assert event.type == "run.more"
                break
