"""Watching a SQLite store by polling: same cursor semantics as PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pglease import Permit, SqliteStore

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    with SqliteStore(tmp_path / "state.sqlite") as s:
        yield s


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


@pytest.mark.parametrize("max_pending", [1, 5, 1000, 1001])
def test_the_queue_holds_at_most_max_pending_events(tmp_path: Path, max_pending: int) -> None:
    # SQLite's side of the bound (delivery itself is in tests/conformance/test_watch.py).
    with SqliteStore(tmp_path / "state.sqlite") as store:
        rid = store.ensure_resource("run", "bound")
        for rev in range(1200):
            store.mutate(Permit(rid, rev), "run.step")
        with store.watch(after="start", max_pending=max_pending) as w:
            got = [w.get(60)]
            # Read at most `max_pending` (and a page) at a time, the first handed out.
            assert w.health.lag_events <= min(max_pending, 1000) - 1
            assert w.overflows == (1 if max_pending <= 1000 else 0)
            while len(got) < 1200 and (batch := w.get_batch(60)):
                got += batch
                assert w.health.lag_events <= max_pending
        assert [e.revision for e in got if e is not None] == list(range(1, 1201))
        assert w.overflows == (1 if max_pending <= 1000 else 0)
