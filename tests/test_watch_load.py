"""The hub under write load: spaced reads and UNLISTEN while busy, LISTEN again
when the load drops, without losing or repeating an event (real PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from pglease import Owner, PostgresStore
from pglease.clock import FakeClock
from pglease.cursors import START
from pglease.driver.listen_ops import ListenRequest, PageOp
from pglease.types import Event
from pglease.watch import HubTuning, Watcher
from pglease.watch._core import END, PAGE, channel_name

#: Thresholds a handful of events crosses: the "under load" branch without
#: needing a host fast enough for thousands of events per second.
TINY = HubTuning(light_rate=1.0, full_rate=2.0, unlisten_rate=2.0)
DEADLINE = 60.0


def until(check: Callable[[], bool], what: str, w: Watcher, got: list[Event]) -> None:
    """Collect events from `w` into `got` until `check()` holds (bounded)."""
    deadline = time.monotonic() + DEADLINE
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        got += w.get_batch(0.02)


def cycle(store: PostgresStore, rid: str, owner: Owner) -> None:
    claim = store.claim(rid, owner, 5)
    assert claim is not None
    store.release(claim)


def test_hub_stops_listening_under_load_and_listens_again(pg_store: PostgresStore) -> None:
    # The rate is measured on a fake clock that stands still: reads an
    # instant apart read as a burst, so a few events are "load". Moving the
    # clock on by hand makes the load drop. interval=30: a NOTIFY or the
    # spaced polling, never the fallback poll, must deliver everything below.
    clock = FakeClock()
    rid = pg_store.ensure_resource("run", "load")
    owner = Owner("host", "w")
    got: list[Event] = []
    with Watcher(pg_store, interval=30, clock=clock, tuning=TINY) as w:
        hub = w._hub
        assert hub is not None
        until(lambda: hub.listening, "the hub to listen", w, got)
        # Every read adds at least a quarter of its events to the rate (see
        # the smoothing in Hub._session), so a bounded number of writes
        # always crosses 2 events/s however slow the host is.
        for _ in range(200):
            cycle(pg_store, rid, owner)
            got += w.get_batch(0.01)
            if hub.unlistens:
                break
        assert hub.unlistens == 1 and not hub.listening
        # Not listening: the spaced polling finds what is written now.
        for _ in range(3):
            cycle(pg_store, rid, owner)
        until(lambda: len(got) == len(pg_store.events(rid)), "polled events", w, got)
        assert not hub.listening
        # The load drops: a quiet stretch on the hub's clock; it LISTENs again.
        clock.advance(1000)
        until(lambda: hub.listening, "the hub to listen again", w, got)
        # A single write arrives by NOTIFY, long before the 30 s fallback poll.
        cycle(pg_store, rid, owner)
        until(lambda: len(got) == len(pg_store.events(rid)), "the late events", w, got)
        assert w.get(0.2) is None
        assert hub.unlistens == 1 and hub.listening
    assert got == pg_store.events(rid)  # nothing lost, nothing repeated


def test_idle_poll_mode_reads_at_its_interval(pg_store: PostgresStore) -> None:
    with Watcher(pg_store, mode="poll", interval=0.05) as w:
        hub = w._hub
        assert hub is not None
        until(lambda: hub.reads > 0, "the first read", w, [])
        before, started = hub.reads, time.monotonic()
        time.sleep(1.0)
        reads, elapsed = hub.reads - before, time.monotonic() - started
        # Never more often than the interval (polling at the 1 ms re-poll would
        # be hundreds); a slow host only makes fewer reads.
        assert reads <= elapsed / 0.05 + 5
        # And it does keep polling.
        until(lambda: hub.reads > before + reads, "another poll", w, [])


def test_held_back_reads_repoll_at_the_tuned_delays(pg_store: PostgresStore, pg_dsn: str) -> None:
    # An open transaction with an xid below a committed one holds every read
    # back (its xid is the snapshot's xmin, below xmax), so the hub re-polls at
    # its re-poll delays, here tuned to 0.2-0.4 s.
    tuned = HubTuning(min_repoll=0.2, max_repoll=0.4)
    with psycopg.connect(pg_dsn) as open_tx:
        open_tx.execute("SELECT pg_current_xact_id()")
        with psycopg.connect(pg_dsn, autocommit=True) as later:
            later.execute("SELECT pg_current_xact_id()")  # a later xid, committed
        with Watcher(pg_store, interval=30, tuning=tuned) as w:
            hub = w._hub
            assert hub is not None
            until(lambda: hub.reads > 0, "the first read", w, [])
            before, started = hub.reads, time.monotonic()
            time.sleep(1.0)
            reads, elapsed = hub.reads - before, time.monotonic() - started
            # Never sooner than 0.2 s apart: the default 1 ms re-poll would be hundreds.
            assert reads <= elapsed / 0.2 + 2
            # And re-polling goes on, long before the 30 s interval would read.
            started = time.monotonic()
            until(lambda: hub.reads > before + reads, "a re-poll", w, [])
            assert time.monotonic() - started < 15.0
        open_tx.rollback()


def test_notify_received_with_a_read_wakes_the_hub(pg_store: PostgresStore, pg_dsn: str) -> None:
    # A NOTIFY that reaches the hub's connection before or during its read is
    # parsed by libpq along with the read's result and kept in libpq's own
    # buffer, not the socket: waiting on the socket alone would sleep through
    # it until the fallback poll. The hub's listener must take it out and not wait.
    listener = pg_store.log_reader().listener(
        ListenRequest(pg_dsn, pg_store.schema, listen=True, pooler=False)
    )
    listener.open()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, '')", [channel_name(pg_store.schema)])
        time.sleep(0.2)  # the notification is now waiting in our socket
        listener.read_log(PageOp(START, END, PAGE))
        started = time.monotonic()
        assert listener.wait(30.0)
        # Woken by the buffered NOTIFY, not the 30 s timeout (a bound, not a speed claim).
        assert time.monotonic() - started < 15.0
        # Consumed: the next wait sleeps until its timeout.
        started = time.monotonic()
        assert not listener.wait(0.3)
        assert time.monotonic() - started >= 0.25
    finally:
        listener.close()


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
