"""Failure honesty of the SQLite store: no raw sqlite3 error from its public API.

Real files, real failures: the write lock held by another process past
busy_timeout, files overwritten with junk, a database that fills up. Sync and
asyncio.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pglease import (
    DatabaseUnavailableError,
    LockTimeoutError,
    Owner,
    Permit,
    PgleaseError,
    SqliteCorruptError,
    SqliteFileError,
    StoreBusyError,
    StoreClosedError,
)
from pglease.sqlite import AsyncSqliteStore, SqliteStore

ME = Owner("host", "me")

# Holds the file's write lock (BEGIN IMMEDIATE) until a line arrives on stdin.
_LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
conn.close()
"""


@contextmanager
def write_lock_held(path: Path) -> Iterator[None]:
    """Another process holds `path`'s write lock for the duration of the block."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOCKER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(30)


def corrupt_pages_after_the_first(path: Path) -> None:
    """Overwrite every page but the header page with 0xFF: an invalid page type
    that SQLite reports as SQLITE_CORRUPT when it reads any table."""
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    page = 65536 if page == 1 else page
    assert len(data) > page, "the file should have more than one page"
    data[page:] = b"\xff" * (len(data) - page)
    path.write_bytes(bytes(data))


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except BaseException as exc:
        return exc


def assert_typed(outcome: object) -> None:
    """A value, or a PgleaseError; never a raw sqlite3 error."""
    assert not isinstance(outcome, sqlite3.Error), repr(outcome)
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, PgleaseError), repr(outcome)


# --- the write lock held past busy_timeout ------------------------------------------------


def test_a_file_locked_past_busy_timeout_raises_store_busy(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    with SqliteStore(path, busy_timeout=0.2) as store:
        rid = store.ensure_resource("run", "busy")
        store.mutate(Permit(rid, 0), "run.started", payload={"n": 1})
        writes: list[Callable[[], object]] = [
            lambda: store.ensure_resource("run", "new"),
            lambda: store.claim(rid, ME, 30),
            lambda: store.mutate(Permit(rid, 1), "run.step", payload={"n": 2}),
            lambda: store.mutate(Permit(rid, 1), "run.step", lambda c: c.execute("SELECT 1")),
        ]
        with write_lock_held(path):
            # WAL: readers are not blocked by the writer.
            assert store.get(rid).revision == 1
            for write in writes:
                error = _outcome(write)
                assert isinstance(error, StoreBusyError), repr(error)
                # One except clause for both backends' lock waits, and for file trouble.
                assert isinstance(error, LockTimeoutError)
                assert isinstance(error, SqliteFileError)
                assert isinstance(error, DatabaseUnavailableError)
                assert isinstance(error.__cause__, sqlite3.OperationalError)
                assert str(path) in str(error) and "busy_timeout=0.2 s" in str(error)
        # Nothing was changed, and the store works once the lock is gone.
        assert store.get(rid).revision == 1
        assert [e.type for e in store.events(rid)] == ["run.started"]
        assert store.claim(rid, ME, 30) is not None


async def test_async_file_locked_past_busy_timeout_raises_store_busy(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    async with AsyncSqliteStore(path, busy_timeout=0.2) as store:
        rid = await store.ensure_resource("run", "busy")

        async def apply(conn: sqlite3.Connection) -> None:
            conn.execute("SELECT 1")

        with write_lock_held(path):
            with pytest.raises(StoreBusyError):
                await store.claim(rid, ME, 30)
            with pytest.raises(StoreBusyError):
                await store.mutate(Permit(rid, 0), "run.step", apply)
        assert (await store.get(rid)).revision == 0


def test_opening_a_file_locked_for_migration_raises_store_busy(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    sqlite3.connect(path).close()  # an empty file: the store must migrate it
    with write_lock_held(path), pytest.raises(StoreBusyError):
        SqliteStore(path, busy_timeout=0.2)
    with SqliteStore(path) as store:
        assert store.list_resources() == []


# --- corrupt files -------------------------------------------------------------------------


def test_a_junk_file_is_refused_on_open(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    path.write_bytes(b"not a database, just junk " * 200)
    with pytest.raises(SqliteCorruptError) as caught:
        SqliteStore(path)
    assert isinstance(caught.value, SqliteFileError)
    assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)
    assert str(path) in str(caught.value) and "SQLITE_NOTADB" in str(caught.value)


async def test_async_junk_file_is_refused_on_open(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    path.write_bytes(b"\x00junk" * 500)
    with pytest.raises(SqliteCorruptError):
        await AsyncSqliteStore.open(path)


def _store_with_data(path: Path) -> str:
    with SqliteStore(path) as store:
        rid = store.ensure_resource("run", "c")
        store.mutate(Permit(rid, 0), "run.started", payload={"n": 1})
    # The last connection closed checkpointed the WAL into the main file.
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    return rid


def test_a_file_corrupted_after_creation_fails_typed_on_open_and_on_read(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    rid = _store_with_data(path)
    corrupt_pages_after_the_first(path)
    # Migrating reads the migrations table: refused on open.
    with pytest.raises(SqliteCorruptError):
        SqliteStore(path)
    # Without migrating, the header page is readable: open works, reads are refused.
    with SqliteStore(path, auto_migrate=False) as store:
        calls: list[Callable[[], object]] = [
            lambda: store.get(rid),
            lambda: store.list_resources(),
            lambda: store.events(rid),
            lambda: store.events_after(),
            lambda: store.ensure_resource("run", "c"),
            lambda: store.claim(rid, ME, 30),
            lambda: store.mutate(Permit(rid, 1), "run.step"),
        ]
        for call in calls:
            error = _outcome(call)
            assert isinstance(error, SqliteCorruptError), repr(error)
            assert isinstance(error.__cause__, sqlite3.DatabaseError)


async def test_async_corrupted_file_fails_typed_on_read(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    rid = _store_with_data(path)
    corrupt_pages_after_the_first(path)
    async with AsyncSqliteStore(path, auto_migrate=False) as store:
        with pytest.raises(SqliteCorruptError):
            await store.get(rid)
        with pytest.raises(SqliteCorruptError):
            await store.events_after()


# --- a full database, the caller's own SQL, a closed store -----------------------------------


def test_a_full_database_fails_typed_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    with SqliteStore(path) as store:
        rid = store.ensure_resource("run", "full")
        # Cap the (only) pooled connection's file at its current size: SQLITE_FULL,
        # the error a full disk gives, without filling a disk.
        with store.connection() as conn:
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(SqliteFileError, match="SQLITE_FULL") as caught:
            store.mutate(Permit(rid, 0), "run.big", payload={"blob": "x" * 200_000})
        assert not isinstance(caught.value, SqliteCorruptError | StoreBusyError)
        assert store.get(rid).revision == 0 and store.events(rid) == []

        # The caller's own SQL filling the file is a file problem too.
        def big(conn: sqlite3.Connection) -> None:
            conn.execute("CREATE TABLE IF NOT EXISTS side (v TEXT)")
            conn.execute("INSERT INTO side VALUES (?)", ("y" * 200_000,))

        with pytest.raises(SqliteFileError, match="SQLITE_FULL"):
            store.mutate(Permit(rid, 0), "run.big", big)
        assert store.get(rid).revision == 0


def test_the_callers_own_sql_errors_in_apply_reach_it_unchanged(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "store.db") as store:
        rid = store.ensure_resource("run", "own")
        with store.connection() as conn:
            conn.execute("CREATE TABLE side (v TEXT PRIMARY KEY)")
            conn.execute("INSERT INTO side VALUES ('taken')")

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO side VALUES ('taken')")

        with pytest.raises(sqlite3.IntegrityError) as caught:
            store.mutate(Permit(rid, 0), "run.x", apply)
        assert caught.value.__context__ is None  # not wrapped on the way out
        with pytest.raises(sqlite3.OperationalError, match="syntax"):
            store.mutate(Permit(rid, 0), "run.x", lambda c: c.execute("SELEC 1"))
        assert store.get(rid).revision == 0
        # Borrowed connections are the caller's: their SQL errors are sqlite3's.
        with pytest.raises(sqlite3.OperationalError), store.connection() as conn:
            conn.execute("SELECT * FROM no_such_table")


async def test_closed_stores_raise_store_closed(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "store.db")
    store.close()
    with pytest.raises(StoreClosedError):
        store.get("run-" + "0" * 40)
    astore = AsyncSqliteStore(tmp_path / "store.db")
    with pytest.raises(StoreClosedError, match="not open"):
        await astore.get("run-" + "0" * 40)


def test_missing_tables_are_a_file_error(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    with SqliteStore(path) as store:
        rid = store.ensure_resource("run", "gone")
        with store.connection() as conn:
            conn.execute("DROP TABLE events")
        outcomes: list[Any] = [
            _outcome(lambda: store.events(rid)),
            _outcome(lambda: store.mutate(Permit(rid, 0), "run.x")),
        ]
    for outcome in outcomes:
        assert isinstance(outcome, SqliteFileError), repr(outcome)
        assert "no such table" in str(outcome)
