"""Watchers tell: errors that cannot heal reach the consumer at once, transient
ones are retried (nothing lost or repeated) until a retry window passes, and
`health` shows it. Real PostgreSQL, real login roles; the retry window runs on
a `FakeClock`, so no test waits for it or depends on the host's speed."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from pglease import AsyncPostgresStore, Owner, PostgresStore, WatchFailedError
from pglease.clock import FakeClock
from pglease.migrations import grant, revoke
from pglease.types import Event
from pglease.watch import AsyncWatcher, Watcher, WatchHealth
from pglease.watch.hub import Hub

A = Owner("host", "a")
#: Bound on every wait below; generous, since a busy host may be slow.
DEADLINE = 60.0


def admin(dsn: str, text: str, args: list[Any] | None = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(text, args)


@pytest.fixture
def reader(pg_dsn: str, schema: str, pg_store: PostgresStore) -> Iterator[tuple[str, str]]:
    """A LOGIN role granted pglease's reader role on the test schema: (name, dsn)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
        if not (row and row[0]):
            pytest.skip("the test server's user cannot create roles")
        name = f"pgl_watch_{uuid.uuid4().hex[:8]}"
        conn.execute(f"CREATE ROLE {name} LOGIN")
        grant(conn, schema, name, "reader")
    try:
        yield name, conninfo.make_conninfo(pg_dsn, user=name)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"ALTER ROLE {name} CONNECTION LIMIT -1")
            # Hub threads of closed watchers may still be closing their connections.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [name],
            )
            conn.execute(f"DROP OWNED BY {name}")
            conn.execute(f"DROP ROLE {name}")


def cycle(store: PostgresStore, rid: str) -> None:
    claim = store.claim(rid, A, 5)
    assert claim is not None
    store.release(claim)


def log_of(store: PostgresStore) -> list[Event]:
    out: list[Event] = []
    while page := store.events_after(out[-1].cursor if out else None, 10_000):
        out += page
    return out


def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def hub_of(w: Watcher | AsyncWatcher) -> Hub:
    assert w._hub is not None
    return w._hub


def drain_until_failed(w: Watcher) -> WatchFailedError:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        try:
            w.get(timeout=0.5)
        except WatchFailedError as exc:
            return exc
    raise AssertionError("the watcher never failed")


# --------------------------------------------------------------------------- cannot heal


@pytest.mark.parametrize("mode", ["listen", "poll"])
def test_revoked_reader_gets_watch_failed_error(
    pg_store: PostgresStore, schema: str, pg_dsn: str, reader: tuple[str, str], mode: str
) -> None:
    name, dsn = reader
    rid = pg_store.ensure_resource("run", f"revoked-{mode}")
    # A frozen clock: the retry window can never pass, so the error must be
    # raised because it cannot heal, not because time ran out.
    clock = FakeClock()
    with (
        PostgresStore(dsn, schema=schema, max_size=2) as store,
        Watcher(store, mode=mode, interval=0.2, clock=clock) as w,
    ):
        cycle(pg_store, rid)
        got = [w.get(DEADLINE), w.get(DEADLINE)]
        assert [e.revision for e in got if e is not None] == [1, 2]
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            revoke(conn, schema, name)
        cycle(pg_store, rid)  # committed after the revoke: this role may not read it
        error = drain_until_failed(w)
        assert isinstance(error.__cause__, psycopg.errors.InsufficientPrivilege)
        assert "42501" in str(error) and "privilege" in str(error)
        # It keeps failing, whichever way the consumer asks.
        with pytest.raises(WatchFailedError):
            w.get(0)
        with pytest.raises(WatchFailedError):
            w.get_batch(0)
        with pytest.raises(WatchFailedError):
            next(iter(w))
        health = w.health
        assert health.failed and health.failed_error is error
        assert health.last_error is not None and "42501" in health.last_error
        assert not health.healthy
        # The revoke was "now" on the fake clock, well inside the window.
        assert hub_of(w).trouble.failing_since == clock.monotonic()


@pytest.mark.parametrize("mode", ["listen", "poll"])
async def test_async_revoked_reader_gets_watch_failed_error(
    pg_store: PostgresStore, schema: str, pg_dsn: str, reader: tuple[str, str], mode: str
) -> None:
    name, dsn = reader
    rid = pg_store.ensure_resource("run", f"arevoked-{mode}")
    async with (
        AsyncPostgresStore(dsn, schema=schema, max_size=2) as store,
        AsyncWatcher(store, mode=mode, interval=0.2, clock=FakeClock()) as w,
    ):
        cycle(pg_store, rid)
        assert len(await w.get_batch(DEADLINE)) >= 1
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            revoke(conn, schema, name)
        cycle(pg_store, rid)
        deadline = time.monotonic() + DEADLINE
        with pytest.raises(WatchFailedError) as info:
            while time.monotonic() < deadline:
                await w.get(0.5)
        assert isinstance(info.value.__cause__, psycopg.errors.InsufficientPrivilege)
        with pytest.raises(WatchFailedError):
            await w.get_batch(0)
        with pytest.raises(WatchFailedError):
            await anext(aiter(w))
        assert w.health.failed


def test_catch_up_read_without_privileges_fails_at_once(
    pg_store: PostgresStore, schema: str, pg_dsn: str, reader: tuple[str, str]
) -> None:
    # The watcher's own reads (resuming from a cursor) follow the same rule.
    name, dsn = reader
    rid = pg_store.ensure_resource("run", "catchup")
    cycle(pg_store, rid)
    with PostgresStore(dsn, schema=schema, max_size=2) as store:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            revoke(conn, schema, name)
        with Watcher(store, after="start", clock=FakeClock()) as w:
            error = drain_until_failed(w)
            assert isinstance(error.__cause__, psycopg.errors.InsufficientPrivilege)
            assert w.health.failed


def test_a_new_watcher_after_a_failure_gets_a_new_hub(
    pg_store: PostgresStore, schema: str, pg_dsn: str, reader: tuple[str, str]
) -> None:
    name, dsn = reader
    rid = pg_store.ensure_resource("run", "regrant")
    with PostgresStore(dsn, schema=schema, max_size=2) as store:
        with Watcher(store, interval=0.2) as w:
            failed_hub = hub_of(w)
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                revoke(conn, schema, name)
            cycle(pg_store, rid)
            drain_until_failed(w)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            grant(conn, schema, name, "reader")
        with Watcher(store, after="start", interval=0.2) as again:
            assert hub_of(again) is not failed_hub
            got = [again.get(DEADLINE), again.get(DEADLINE)]
            assert [e.revision for e in got if e is not None] == [1, 2]


# --------------------------------------------------------------------------- transient


@pytest.mark.parametrize("mode", ["listen", "poll"])
def test_terminated_backend_heals_by_reconnect(
    pg_store: PostgresStore,
    schema: str,
    pg_dsn: str,
    reader: tuple[str, str],
    mode: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    name, dsn = reader
    rid = pg_store.ensure_resource("run", f"heal-{mode}")
    got: list[Event] = []
    with (
        PostgresStore(dsn, schema=schema, max_size=2) as store,
        Watcher(store, after="start", mode=mode, interval=0.05) as w,
        caplog.at_level(logging.WARNING, logger="pglease.watch"),
    ):
        hub = hub_of(w)
        cycle(pg_store, rid)
        for _ in range(3):
            until(lambda: hub.backend_pid is not None, "the hub to connect")
            connects = hub.connects
            # Found the way an operator would: the reader role's backends.
            admin(
                pg_dsn,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE usename = %s AND pid = %s",
                [name, hub.backend_pid or 0],
            )
            cycle(pg_store, rid)  # written while the hub is away
            until(lambda c=connects: hub.connects > c, "a reconnect")
            got += w.get_batch(0.01)
        expected = log_of(pg_store)
        while len(got) < len(expected):
            batch = w.get_batch(DEADLINE)
            assert batch, f"stalled at {len(got)} of {len(expected)}"
            got += batch
        assert got == expected  # nothing lost, nothing repeated
        assert w.get(0.2) is None
        health = w.health
        assert health.reconnects >= 3
        assert health.last_error is not None and health.last_error_at is not None
        assert health.healthy and health.failing_since is None
        assert health.lag_seconds == 0.0 and health.last_read_at is not None
    assert any("retrying" in r.getMessage() for r in caplog.records)


def test_persistent_connection_failure_raises_after_the_retry_window(
    pg_store: PostgresStore, schema: str, pg_dsn: str, reader: tuple[str, str]
) -> None:
    name, dsn = reader
    rid = pg_store.ensure_resource("run", "persistent")
    clock = FakeClock()
    with (
        PostgresStore(dsn, schema=schema, max_size=2) as store,
        Watcher(store, interval=0.2, retry_window=5, clock=clock) as w,
    ):
        hub = hub_of(w)
        cycle(pg_store, rid)
        assert w.get(DEADLINE) is not None and w.get(DEADLINE) is not None
        # The role may no longer connect (SQLSTATE 53300, "too many
        # connections"): transient by its class, so it is retried.
        admin(pg_dsn, f"ALTER ROLE {name} CONNECTION LIMIT 0")
        assert hub.backend_pid is not None
        admin(pg_dsn, "SELECT pg_terminate_backend(%s)", [hub.backend_pid])
        until(lambda: hub.trouble.attempts >= 2, "failed reconnects")
        # Inside the window (the fake clock stands still): no error yet.
        assert w.get(0.3) is None
        health = w.health
        assert not health.failed and not health.healthy
        assert health.failing_since is not None and health.last_error is not None
        clock.advance(4.0)
        assert w.get(0.3) is None
        assert w.health.lag_seconds >= 4.0
        clock.advance(2.0)  # past the 5 s window
        error = drain_until_failed(w)
        assert isinstance(error.__cause__, psycopg.OperationalError)
        assert "kept failing" in str(error) and "retry window 5 s" in str(error)
        health = w.health
        assert health.failed and health.failed_error is error


def test_health_counts_events_not_handed_out(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "lag")
    with Watcher(pg_store) as w:
        fresh = w.health
        assert isinstance(fresh, WatchHealth)
        assert fresh.healthy and fresh.last_error is None and fresh.reconnects == 0
        # Events can also come by the watcher's own catch-up read, which
        # bypasses the queue (the lag is a lower bound while events flow): run
        # cycles until one is seen queued, taking each cycle's events if not.
        revisions: list[int] = []
        queued = 0
        for _ in range(20):
            cycle(pg_store, rid)
            end = time.monotonic() + 2.0
            while time.monotonic() < end and (queued := w.health.lag_events) == 0:
                time.sleep(0.01)
            if queued:
                break
            for _ in range(2):
                event = w.get(DEADLINE)
                assert event is not None
                revisions.append(event.revision)
        assert 0 < queued <= 2
        for _ in range(2):  # the cycle whose events were seen queued
            event = w.get(DEADLINE)
            assert event is not None
            revisions.append(event.revision)
        assert revisions == list(range(1, len(revisions) + 1))
        assert w.health.lag_events == 0


def test_the_stores_pass_retry_window_clock_and_tuning_through(
    pg_store: PostgresStore, tmp_path: Path
) -> None:
    from pglease import SqliteStore, ValidationError

    with pytest.raises(ValidationError):
        pg_store.watch(retry_window=-1)
    clock = FakeClock()
    with pg_store.watch(after="start", retry_window=5, clock=clock) as watcher:
        assert watcher.health.healthy
    with SqliteStore(str(tmp_path / "s.db")) as sqlite_store:
        with pytest.raises(ValidationError):
            sqlite_store.watch(retry_window=float("nan"))
        with sqlite_store.watch(after="start", retry_window=5, clock=clock) as watcher:
            assert watcher.health.healthy
