"""A watcher knows when it has heard nothing (issue 31 item 7).

The watcher's store reaches PostgreSQL through a fault-injecting proxy
(tests/_stall_proxy.py) that stops forwarding bytes while every socket stays
open: a stalled path. The events are written straight to the server, so they
keep committing during the stall. Within about `stall_timeout` the watcher's
`health` must turn unhealthy with a `last_error` that names the silence; when
the path heals (resumed, or every connection dropped) the consumer gets every
event committed meanwhile exactly once, in order; a stall that lasts
`retry_window` is `WatchFailedError`. Listen and poll modes, sync and asyncio.

Bounds are generous (a busy 2-core machine): they tell "noticed" from "never
noticed", not fast from slow. Before `stall_timeout` a watcher here stayed
healthy and silent for the whole stall.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pglease import (
    AsyncPostgresStore,
    DatabaseUnavailableError,
    Owner,
    PostgresStore,
    SqliteStore,
    ValidationError,
    WatchFailedError,
)
from pglease.cursors import START
from pglease.driver.listen_ops import ListenRequest, LogReadError, PageOp
from pglease.postgres._listen import PgChangeListener
from pglease.types import Event
from pglease.watch import AsyncWatcher, Watcher, WatchHealth
from pglease.watch._core import END, PAGE

from ._stall_proxy import StallProxy

A = Owner("host", "a")
#: The watchers' stall timeout: small, so that the tests are quick.
STALL = 0.5
#: How long a stall may take to show in health (a liveness read every
#: STALL, answered or not within STALL more, and room for a busy machine).
NOTICE_WITHIN = 20.0
#: Bound on every other wait.
DEADLINE = 60.0
#: Listen mode: a fallback poll far longer than the test, so that only the
#: liveness read (at least every stall_timeout) can notice the stall.
LISTEN_INTERVAL = 600.0
#: Events committed while the path is stalled (two per cycle).
CYCLES = 4
SILENCE = "no answer from the server"


def _interval(mode: str) -> float | None:
    return LISTEN_INTERVAL if mode == "listen" else None


def cycle(store: PostgresStore, rid: str) -> None:
    claim = store.claim(rid, A, 5)
    assert claim is not None
    store.release(claim)


def log_after(store: PostgresStore, cursor: str) -> list[Event]:
    out: list[Event] = []
    while page := store.events_after(out[-1].cursor if out else cursor, 10_000):
        out += page
    return out


def until(check: Callable[[], bool], what: str, within: float = DEADLINE) -> float:
    """Wait for `check`; return how long it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - started


async def until_async(check: Callable[[], bool], what: str, within: float = DEADLINE) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def take(watcher: Watcher, n: int) -> list[Event]:
    got: list[Event] = []
    deadline = time.monotonic() + DEADLINE
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {len(got)} of {n} events"
        event = watcher.get(timeout=0.5)
        if event is not None:
            got.append(event)
    return got


async def take_async(watcher: AsyncWatcher, n: int) -> list[Event]:
    got: list[Event] = []
    deadline = time.monotonic() + DEADLINE
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {len(got)} of {n} events"
        event = await watcher.get(timeout=0.5)
        if event is not None:
            got.append(event)
    return got


def assert_silent(health: WatchHealth) -> None:
    """`health` says the stream is failing, and why: it hears nothing."""
    assert not health.healthy, health
    assert health.failing_since is not None, health
    assert health.last_error is not None and SILENCE in health.last_error, health
    assert "DatabaseUnavailableError" in health.last_error, health


def heal(proxy: StallProxy, how: str) -> None:
    if how == "reset":
        proxy.reset()  # every connection dropped; new ones flow
    proxy.resume()


# ------------------------------------------------------------------ the watchers


@pytest.mark.parametrize(("mode", "how"), [("listen", "resume"), ("poll", "resume"),
                                           ("listen", "reset"), ("poll", "reset")])  # fmt: skip
def test_sync_watcher_notices_a_stall_and_catches_up_gap_free(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str, mode: str, how: str
) -> None:
    rid = pg_store.ensure_resource("job", "stall")
    with (
        PostgresStore(stall_proxy.dsn, schema=schema, max_size=2) as store,
        store.watch(
            mode=mode, interval=_interval(mode), stall_timeout=STALL, retry_window=600
        ) as watcher,
    ):
        cycle(pg_store, rid)
        before = take(watcher, 2)
        assert watcher.health.healthy
        stall_proxy.pause()
        try:
            for _ in range(CYCLES):
                cycle(pg_store, rid)
            until(lambda: not watcher.health.healthy, "health to show the stall", NOTICE_WITHIN)
            assert_silent(watcher.health)
            # Nothing reaches the consumer while the path is stalled.
            assert watcher.get(timeout=0.2) is None
        finally:
            heal(stall_proxy, how)
        committed = log_after(pg_store, before[-1].cursor)
        assert len(committed) == 2 * CYCLES
        got = take(watcher, len(committed))
        assert [e.id for e in got] == [e.id for e in committed]
        until(lambda: watcher.health.healthy, "health to recover")
        health = watcher.health
        assert health.reconnects >= 1
        if how == "resume":  # a reset also drops a reconnect in progress: its error is last
            assert health.last_error is not None and SILENCE in health.last_error
        # Exactly once: nothing more arrives, and the next event is the next one.
        assert watcher.get(timeout=0.3) is None
        cycle(pg_store, rid)
        after = take(watcher, 2)
        assert [e.id for e in after] == [e.id for e in log_after(pg_store, got[-1].cursor)]


@pytest.mark.parametrize(("mode", "how"), [("listen", "resume"), ("poll", "reset")])
async def test_async_watcher_notices_a_stall_and_catches_up_gap_free(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str, mode: str, how: str
) -> None:
    rid = pg_store.ensure_resource("job", "stall")
    async with (
        AsyncPostgresStore(stall_proxy.dsn, schema=schema, max_size=2) as store,
        store.watch(
            mode=mode, interval=_interval(mode), stall_timeout=STALL, retry_window=600
        ) as watcher,
    ):
        await asyncio.to_thread(cycle, pg_store, rid)
        before = await take_async(watcher, 2)
        assert watcher.health.healthy
        stall_proxy.pause()
        try:
            for _ in range(CYCLES):
                await asyncio.to_thread(cycle, pg_store, rid)
            await until_async(
                lambda: not watcher.health.healthy, "health to show the stall", NOTICE_WITHIN
            )
            assert_silent(watcher.health)
            assert await watcher.get(timeout=0.2) is None
        finally:
            heal(stall_proxy, how)
        committed = log_after(pg_store, before[-1].cursor)
        assert len(committed) == 2 * CYCLES
        got = await take_async(watcher, len(committed))
        assert [e.id for e in got] == [e.id for e in committed]
        await until_async(lambda: watcher.health.healthy, "health to recover")
        assert await watcher.get(timeout=0.3) is None


def _failed_sync(watcher: Watcher) -> WatchFailedError:
    deadline = time.monotonic() + DEADLINE
    while True:
        assert time.monotonic() < deadline, "the stall never reached the consumer"
        try:
            watcher.get(timeout=0.5)
        except WatchFailedError as exc:
            return exc


async def _failed_async(watcher: AsyncWatcher) -> WatchFailedError:
    deadline = time.monotonic() + DEADLINE
    while True:
        assert time.monotonic() < deadline, "the stall never reached the consumer"
        try:
            await watcher.get(timeout=0.5)
        except WatchFailedError as exc:
            return exc


#: Short, so that the stall outlasts it soon.
RETRY_WINDOW = 2.0


@pytest.mark.parametrize("mode", ["listen", "poll"])
def test_sync_a_stall_longer_than_the_retry_window_is_watch_failed(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str, mode: str
) -> None:
    with PostgresStore(stall_proxy.dsn, schema=schema, max_size=2) as store:
        watcher = store.watch(
            mode=mode, interval=_interval(mode), stall_timeout=STALL, retry_window=RETRY_WINDOW
        )
        try:
            rid = pg_store.ensure_resource("job", "stall")
            cycle(pg_store, rid)
            before = take(watcher, 2)
            stall_proxy.pause()
            started = time.monotonic()
            for _ in range(CYCLES):
                cycle(pg_store, rid)
            error = _failed_sync(watcher)
            assert time.monotonic() - started >= RETRY_WINDOW
            assert SILENCE in str(error)
            assert isinstance(error.__cause__, DatabaseUnavailableError)
            assert watcher.health.failed and watcher.health.failed_error is error
            with pytest.raises(WatchFailedError):  # it keeps failing
                watcher.get(timeout=0.1)
        finally:
            stall_proxy.resume()
            watcher.close()
        # Resumed from its cursor once the path heals: what the stall held back
        # arrives exactly once, in order (the new watcher's own catch-up reads).
        committed = log_after(pg_store, before[-1].cursor)
        assert len(committed) == 2 * CYCLES
        with store.watch(after=watcher.cursor, mode=mode, stall_timeout=STALL) as resumed:
            got = take(resumed, len(committed))
            assert [e.id for e in got] == [e.id for e in committed]
            assert resumed.get(timeout=0.3) is None


@pytest.mark.parametrize("mode", ["listen", "poll"])
async def test_async_a_stall_longer_than_the_retry_window_is_watch_failed(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str, mode: str
) -> None:
    async with AsyncPostgresStore(stall_proxy.dsn, schema=schema, max_size=2) as store:
        watcher = store.watch(
            mode=mode, interval=_interval(mode), stall_timeout=STALL, retry_window=RETRY_WINDOW
        )
        try:
            await watcher.start()  # "now" is now, before the first event
            rid = pg_store.ensure_resource("job", "stall")
            await asyncio.to_thread(cycle, pg_store, rid)
            before = await take_async(watcher, 2)
            stall_proxy.pause()
            started = time.monotonic()
            for _ in range(CYCLES):
                await asyncio.to_thread(cycle, pg_store, rid)
            error = await _failed_async(watcher)
            assert time.monotonic() - started >= RETRY_WINDOW
            assert SILENCE in str(error)
            assert isinstance(error.__cause__, DatabaseUnavailableError)
            assert watcher.health.failed
        finally:
            stall_proxy.resume()
            await watcher.aclose()
        committed = log_after(pg_store, before[-1].cursor)
        assert len(committed) == 2 * CYCLES
        async with store.watch(after=watcher.cursor, mode=mode, stall_timeout=STALL) as resumed:
            got = await take_async(resumed, len(committed))
            assert [e.id for e in got] == [e.id for e in committed]
            assert await resumed.get(timeout=0.3) is None


# ------------------------------------------------- the readers, one round trip each


def test_a_stalled_catch_up_read_and_start_fail_naming_the_silence(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str
) -> None:
    # Two stores: the connection a deadline closed is replaced by the pool with
    # a new one, whose connect would hear nothing either.
    with (
        PostgresStore(stall_proxy.dsn, schema=schema, max_size=1) as store,
        PostgresStore(stall_proxy.dsn, schema=schema, max_size=1) as other,
    ):
        reader, starter = store.log_reader(), other.log_reader()
        reader.read_log(PageOp(START, END, PAGE, STALL))  # the path works
        starter.start(None, STALL)
        stall_proxy.pause()
        try:
            started = time.monotonic()
            with pytest.raises(LogReadError) as caught:
                reader.read_log(PageOp(START, END, PAGE, STALL))
            assert time.monotonic() - started < NOTICE_WITHIN
            assert not caught.value.permanent
            assert isinstance(caught.value.__cause__, DatabaseUnavailableError)
            assert SILENCE in str(caught.value.__cause__)
            with pytest.raises(DatabaseUnavailableError, match=SILENCE):
                starter.start(None, STALL)
        finally:
            stall_proxy.resume()
        # The pools replace the connections the deadline closed.
        reader.read_log(PageOp(START, END, PAGE, STALL))
        starter.start(None, STALL)


async def test_a_stalled_async_catch_up_read_and_start_fail_naming_the_silence(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str
) -> None:
    async with (
        AsyncPostgresStore(stall_proxy.dsn, schema=schema, max_size=1) as store,
        AsyncPostgresStore(stall_proxy.dsn, schema=schema, max_size=1) as other,
    ):
        reader, starter = store.log_reader(), other.log_reader()
        await reader.read_log(PageOp(START, END, PAGE, STALL))
        await starter.start(None, STALL)
        stall_proxy.pause()
        try:
            with pytest.raises(LogReadError) as caught:
                await reader.read_log(PageOp(START, END, PAGE, STALL))
            assert isinstance(caught.value.__cause__, DatabaseUnavailableError)
            assert SILENCE in str(caught.value.__cause__)
            with pytest.raises(DatabaseUnavailableError, match=SILENCE):
                await starter.start(None, STALL)
        finally:
            stall_proxy.resume()
        await reader.read_log(PageOp(START, END, PAGE, STALL))
        await starter.start(None, STALL)


def test_the_listener_bounds_its_reads_and_its_connect(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str
) -> None:
    request = ListenRequest(stall_proxy.dsn, schema, listen=True, pooler=False,
                            stall_timeout=STALL)  # fmt: skip
    listener = PgChangeListener(request)
    listener.open()
    try:
        tip = listener.frontier()
        stall_proxy.pause()
        with pytest.raises(LogReadError) as caught:
            listener.read_log(PageOp(tip, END, PAGE))
        assert isinstance(caught.value.__cause__, DatabaseUnavailableError)
        assert f"for {STALL:g} s on the watch connection" in str(caught.value.__cause__)
    finally:
        listener.close()
    again = PgChangeListener(request)
    started = time.monotonic()
    try:
        with pytest.raises(LogReadError) as caught:
            again.open()  # the connect itself hears nothing
        # libpq's connect_timeout is whole seconds, at least 2.
        assert time.monotonic() - started >= 2 - 0.1
        assert isinstance(caught.value.__cause__, DatabaseUnavailableError)
        assert "for 2 s on the watch connection while connecting" in str(caught.value.__cause__)
        assert again.session_id() is None
    finally:
        stall_proxy.resume()
        again.close()


# --------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -1, 3600.5, math.nan, math.inf, True, "5", None])
def test_stall_timeout_is_checked(
    pg_store: PostgresStore, tmp_path: object, bad: object
) -> None:
    with pytest.raises(ValidationError, match="stall_timeout"):
        pg_store.watch(stall_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="stall_timeout"):
        Watcher(pg_store, stall_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="stall_timeout"):
        AsyncWatcher(pg_store, stall_timeout=bad)  # type: ignore[arg-type]
    with SqliteStore(f"{tmp_path}/w.db") as lite, pytest.raises(ValidationError, match="stall"):
        lite.watch(stall_timeout=bad)  # type: ignore[arg-type]


def test_stall_timeout_is_kept_and_accepted_on_sqlite(
    pg_store: PostgresStore, tmp_path: object
) -> None:
    with pg_store.watch(stall_timeout=3600) as watcher:
        assert watcher.stall_timeout == 3600.0
    with pg_store.watch() as watcher:
        assert watcher.stall_timeout == 5.0
    with SqliteStore(f"{tmp_path}/w.db") as lite, lite.watch(stall_timeout=0.5) as watcher:
        assert watcher.stall_timeout == 0.5
        assert watcher.get(timeout=0.05) is None



# ------------------------------------------------------------------ a forked child


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_hears_silence_too(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str
) -> None:
    """The deadline's watchdog thread does not survive a fork: a child that
    inherited a started one must get its own, or its deadlines never fire."""
    request = ListenRequest(stall_proxy.dsn, schema, listen=False, pooler=False,
                            stall_timeout=STALL)  # fmt: skip
    warm = PgChangeListener(request)  # starts the watchdog thread in this process
    warm.open()
    warm.read_log(PageOp(warm.frontier(), END, PAGE))
    warm.close()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        status = 1
        try:
            listener = PgChangeListener(request)
            listener.open()
            tip = listener.frontier()
            os.write(ready_w, b"r")
            try:
                listener.read_log(PageOp(tip, END, PAGE))
            except LogReadError as exc:
                status = 0 if SILENCE in str(exc.__cause__) else 2
        finally:
            os._exit(status)
    try:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"r"
        stall_proxy.pause()
        deadline = time.monotonic() + NOTICE_WITHIN
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the child's read never ended"
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(done[1]) == 0
        pid = 0
    finally:
        stall_proxy.resume()
        os.close(ready_r)
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_cli_watch_exits_when_the_path_stays_silent_past_retry_window(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str
) -> None:
    """`pglease watch --stall-timeout --retry-window`: a watch whose path goes
    silent exits with an error naming the silence (before the flags it waited
    for the default 30 s window; a silent path without a stall timeout, forever)."""
    rid = pg_store.ensure_resource("job", "cli-stall")
    watch = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--dsn", stall_proxy.dsn, "--schema", schema,
         "watch", "--after", "start", "--stall-timeout", f"{STALL}s",
         "--retry-window", f"{RETRY_WINDOW}s"],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        cycle(pg_store, rid)
        first = watch.stdout.readline()  # the watch runs: it printed lease.claimed
        assert "lease.claimed" in first, first
        stall_proxy.pause()
        started = time.monotonic()
        code = watch.wait(timeout=DEADLINE)
        assert time.monotonic() - started >= RETRY_WINDOW - 0.5  # not before the window
        assert watch.stderr is not None
        err = watch.stderr.read()
        assert code == 1, err
        assert SILENCE in err and "pglease: error:" in err, err
    finally:
        stall_proxy.resume()
        if watch.poll() is None:
            watch.kill()
            watch.wait(timeout=30)


@pytest.mark.parametrize(
    ("flag", "value", "wording"),
    [
        ("--stall-timeout", "0s", "--stall-timeout must be a number of seconds in (0, 3600]"),
        ("--stall-timeout", "2h", "--stall-timeout must be a number of seconds in (0, 3600]"),
        ("--retry-window", "0s", "--retry-window must be a number of seconds in (0, 86400]"),
        ("--stall-timeout", "soon", "--stall-timeout"),
    ],
)
def test_cli_watch_refuses_bad_bounds(flag: str, value: str, wording: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", "host=/nonexistent dbname=x",
         "watch", flag, value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert wording in result.stderr, result.stderr
