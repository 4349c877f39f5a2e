"""SQLite watchers tell too: a deleted or replaced file, or one that is not a
store, raises `WatchFailedError` at once instead of polling the old, unlinked
file for ever; `health` has the same shape as PostgreSQL watchers'."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from pglease import AsyncSqliteStore, Permit, SqliteStore, WatchFailedError
from pglease.clock import FakeClock
from pglease.sqlite.watch import AsyncSqliteWatcher, SqliteWatcher, _cannot_heal

DEADLINE = 60.0


def remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def test_deleted_file_fails_at_once(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    with SqliteStore(path) as store:
        rid = store.ensure_resource("run", "a")
        # A frozen clock: only "cannot heal" can raise, never the window.
        with SqliteWatcher(store, interval=0.01, clock=FakeClock()) as w:
            store.mutate(Permit(rid, 0), "run.one")
            assert w.get(DEADLINE) is not None
            remove(path)
            with pytest.raises(WatchFailedError, match="deleted") as info:
                w.get(DEADLINE)
            assert isinstance(info.value.__cause__, FileNotFoundError)
            with pytest.raises(WatchFailedError):
                next(iter(w))
            health = w.health
            assert health.failed and health.failed_error is info.value
            assert health.last_error is not None and "deleted" in health.last_error


def test_replaced_file_fails_at_once(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    other = tmp_path / "other.sqlite"
    with SqliteStore(path) as store, SqliteStore(other) as spare:
        spare.ensure_resource("run", "b")
        with SqliteWatcher(store, interval=0.01, clock=FakeClock()) as w:
            assert w.get(0.05) is None
            os.replace(other, path)  # a restore from a backup, say
            with pytest.raises(WatchFailedError, match="replaced"):
                w.get(DEADLINE)


async def test_async_deleted_file_fails_at_once(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    async with (
        AsyncSqliteStore(path) as store,
        AsyncSqliteWatcher(store, interval=0.01, clock=FakeClock()) as w,
    ):
        assert await w.get(0.05) is None
        remove(path)
        with pytest.raises(WatchFailedError, match="deleted"):
            await w.get(DEADLINE)
        with pytest.raises(WatchFailedError):
            await w.get_batch(0)
        assert w.health.failed


def test_which_sqlite_errors_cannot_heal(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a database, not at all" * 100)
    with closing(sqlite3.connect(garbage)) as conn, pytest.raises(sqlite3.DatabaseError) as bad:
        conn.execute("SELECT * FROM events")
    assert _cannot_heal(bad.value)
    with (
        closing(sqlite3.connect(tmp_path / "empty.sqlite")) as conn,
        pytest.raises(sqlite3.OperationalError) as no_table,
    ):
        conn.execute("SELECT * FROM events")
    assert _cannot_heal(no_table.value)
    assert not _cannot_heal(sqlite3.OperationalError("database is locked"))
