"""The hub under write load: spaced reads and UNLISTEN while busy, LISTEN again
when the load drops, without losing or repeating an event (real PostgreSQL)."""

from __future__ import annotations

import threading
import time

import psycopg

from pglease import Owner, PostgresStore
from pglease.cursors import START
from pglease.types import Event
from pglease.watch import Watcher
from pglease.watch._core import channel_name
from pglease.watch.hub import Hub


def hammer(store: PostgresStore, rids: list[str], stop: threading.Event, done: list[int]) -> None:
    owner = Owner("host", threading.current_thread().name)
    n = 0
    while not stop.is_set():
        claim = store.claim(rids[n % len(rids)], owner, 5)
        if claim is not None:
            store.release(claim)
        n += 1
    done.append(n)


def test_hub_stops_listening_under_load_and_listens_again(pg_store: PostgresStore) -> None:
    # interval=30: a NOTIFY (or the spaced polling), never the fallback poll,
    # must deliver everything below.
    rids = [pg_store.ensure_resource("run", f"load{i}") for i in range(12)]
    with Watcher(pg_store, interval=30) as w:
        hub = w._hub
        assert hub is not None
        got: list[Event] = []
        done: list[int] = []
        stop = threading.Event()
        writers = [
            threading.Thread(target=hammer, args=(pg_store, rids[i::4], stop, done), name=f"w{i}")
            for i in range(4)
        ]
        for t in writers:
            t.start()
        # Write for a second past the hub's switch to polling (at most 15 s).
        started = time.monotonic()
        switched = None
        while time.monotonic() - started < 15:
            got += w.get_batch(0.05)
            if switched is None and hub.unlistens:
                switched = time.monotonic()
            if switched is not None and time.monotonic() - switched > 1:
                break
        stop.set()
        for t in writers:
            t.join()
        log: list[Event] = []
        while page := pg_store.events_after(log[-1].cursor if log else None, 10_000):
            log += page
        while len(got) < len(log):
            batch = w.get_batch(5)
            assert batch, f"stalled at {len(got)} of {len(log)} events"
            got += batch
        assert got == log
        assert hub.unlistens >= 1, f"never stopped listening ({len(log)} events in 15 s)"
        # Load gone: back to LISTEN; a single write arrives by NOTIFY, long
        # before the 30 s fallback poll.
        time.sleep(0.3)
        claim = pg_store.claim(rids[0], Owner("host", "late"), 5)
        assert claim is not None
        late = w.get(5)
        assert late is not None and late.revision == claim.revision
        assert w.get(0.2) is None


def test_idle_poll_mode_reads_at_its_interval(pg_store: PostgresStore) -> None:
    with Watcher(pg_store, mode="poll", interval=0.05) as w:
        hub = w._hub
        assert hub is not None
        time.sleep(0.3)
        before = hub.reads
        time.sleep(1.0)
        # About 20 reads in a second; polling at the 1 ms re-poll would be hundreds.
        assert 5 <= hub.reads - before <= 40


def test_notify_received_with_a_read_wakes_the_hub(pg_store: PostgresStore, pg_dsn: str) -> None:
    # A NOTIFY that reaches the hub's connection before or during its read is
    # parsed by libpq along with the read's result and kept in libpq's own
    # buffer, not the socket: waiting on the socket alone would sleep through
    # it until the fallback poll. The hub must take it out and not wait.
    hub = Hub(pg_dsn, pg_store.schema, "listen", 30.0, ("test", pg_store.schema))
    conn = hub._open()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, '')", [channel_name(pg_store.schema)])
        time.sleep(0.2)  # the notification is now waiting in our socket
        hub._read(conn, START)
        started = time.monotonic()
        hub._wait(conn, 3.0, True)
        assert time.monotonic() - started < 0.5
        # Consumed: the next wait sleeps until its timeout.
        started = time.monotonic()
        hub._wait(conn, 0.3, True)
        assert time.monotonic() - started >= 0.25
    finally:
        conn.close()


def test_the_watch_read_is_never_jit_compiled(pg_store: PostgresStore, pg_dsn: str) -> None:
    # Its generic plan is costed for millions of rows (the LIMIT is a
    # parameter), so a server with LLVM compiled every read: ~200 ms each on
    # PostgreSQL 15, where the read itself takes 2 ms (sql/0009). The setting
    # is the function's own, so it wins over whatever the session sets.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT proconfig FROM pg_proc WHERE oid = %s::regprocedure",
            [f'"{pg_store.schema}".watch_read(xid8, bigint, xid8, bigint, integer)'],
        ).fetchone()
        assert row is not None
        assert "jit=off" in row[0] and "plan_cache_mode=force_generic_plan" in row[0]
        # A session that would JIT anything still reads (and gets its page).
        conn.execute("SET jit = on")
        conn.execute("SET jit_above_cost = 0")
        rows = conn.execute(
            f'SELECT * FROM "{pg_store.schema}".watch_read(%s::text::xid8, %s,'
            " '18446744073709551615'::text::xid8, 9223372036854775807, 10)",
            [str(START.xid), START.event_id],
        ).fetchall()
        assert len(rows) == 1 and rows[0][5] is None  # the empty log: one row, no event
