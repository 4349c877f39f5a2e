"""`pglease top`: the model from real events and listings under a FakeClock, and
the live view as a person sees it, in a real terminal (tmux)."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo
from rich.console import Console

from pglease import Event, Owner, PostgresStore
from pglease.cli.top import _quietly, _recheck, warnings_to
from pglease.clock import FakeClock
from pglease.listing import iter_resources
from pglease.migrations import grant
from pglease.postgres.runtime import heartbeat_args
from pglease.top import FREED_LINGER, RECHECK_INTERVAL, WARNING_SHOWN, TopModel
from pglease.watch import Watcher, WatchHealth

A = Owner("host", "a")
B = Owner("host", "b")


def text_of(model: TopModel, height: int | None = None) -> str:
    out = io.StringIO()
    Console(file=out, width=160, color_system=None, force_terminal=False).print(
        model.render(height)
    )
    return out.getvalue()


def lease_lines(frame: str) -> list[str]:
    """The lines of the lease table, in screen order (after its header line)."""
    lines = frame.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("RESOURCE"))
    end = lines.index("recent events")
    return [line for line in lines[start + 1 : end] if line.strip()]


def db_now(store: PostgresStore) -> datetime:
    with store.connection() as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def model_at(store: PostgresStore, at: datetime, clock: FakeClock) -> TopModel:
    """A model whose database clock reads `at` now, on a host clock that is years
    off (FakeClock's wall time is in 2023): only the offset can make it right."""
    model = TopModel(schema=store.schema, clock=clock)
    model.set_db_clock(at, clock.time(), clock.time())
    return model


def next_events(watcher: Watcher, n: int) -> list[Event]:
    got: list[Event] = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += watcher.get_batch(timeout=1.0)
    assert len(got) == n, got
    return got


def test_listing_sorted_by_expiry_with_time_left_by_the_database_clock(
    pg_store: PostgresStore,
) -> None:
    t0 = db_now(pg_store)
    for key, ttl in (("slow", 30), ("fast", 10), ("mid", 20)):
        rid = pg_store.ensure_resource("run", key)
        assert pg_store.claim(rid, A, ttl, now=t0) is not None
    free = pg_store.ensure_resource("run", "free")
    claim = pg_store.claim(free, B, 30, now=t0)
    assert claim is not None
    pg_store.release(claim, now=t0)
    clock = FakeClock()
    model = model_at(pg_store, t0, clock)
    model.load(item.state for item in iter_resources(pg_store, pg_store.schema, held=True))
    assert sorted(r.key for r in model.rows.values()) == ["fast", "mid", "slow"]
    assert [model.time_left(r) for r in sorted(model.rows.values(), key=lambda r: r.key)] == [
        10.0,
        20.0,
        30.0,
    ]
    lines = lease_lines(text_of(model))
    assert [line.split()[0] for line in lines] == ["run/fast", "run/mid", "run/slow"]
    assert lines[0].split()[1:4] == ["host:a", "1", "10.0s"]
    assert "held" in lines[0] and "█" * 20 in lines[0]  # a full bar: all of its ttl left
    clock.advance(5)
    lines = lease_lines(text_of(model))
    assert lines[0].split()[3] == "5.0s"
    assert "█" * 10 + "·" * 10 in lines[0]  # half its ttl left
    assert lines[2].split()[3] == "25.0s"
    header = text_of(model).splitlines()[0]
    assert "3 held" in header and f"schema {pg_store.schema}" in header


def test_the_offset_is_measured_against_the_host_clock() -> None:
    clock = FakeClock()
    model = TopModel(clock=clock)
    at = datetime(2030, 1, 1, tzinfo=UTC)
    # Sent at 100.0, answered at 100.4 (host seconds): the database read its
    # clock at 100.2 by the host's reckoning, give or take 0.2 s.
    model.set_db_clock(at, clock.time() + 100.0, clock.time() + 100.4)
    assert model.offset_error == pytest.approx(0.2)
    clock.advance(100.2)
    assert abs((model.db_now() - at).total_seconds()) < 1e-3


def test_events_update_holder_generation_and_mark_releases(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "one")
    other = pg_store.ensure_resource("job", "two")
    first = pg_store.claim(rid, A, 30)
    assert first is not None
    clock = FakeClock()
    with pg_store.watch(after="now") as watcher:
        # Committed after the watcher started and before the listing: the listing
        # shows it, and its event must not be applied twice.
        second = pg_store.claim(other, A, 30)
        assert second is not None
        model = model_at(pg_store, db_now(pg_store), clock)
        model.load(item.state for item in iter_resources(pg_store, pg_store.schema, held=True))
        pg_store.release(first)
        taken = pg_store.claim(rid, B, 60)
        assert taken is not None
        pg_store.release(second)
        events = next_events(watcher, 4)
        assert [e.type for e in events] == [
            "lease.claimed",
            "lease.released",
            "lease.claimed",
            "lease.released",
        ]
        for event in events:
            model.apply(event)
    assert model.events_seen == 4
    one, two = model.rows[rid], model.rows[other]
    assert (one.state, one.holder, one.generation, one.revision) == ("held", B, 2, taken.revision)
    # Claimed after the clock was read (a frozen FakeClock since): at least its ttl left.
    assert 60 <= (model.time_left(one) or 0) <= 90
    assert (two.state, two.holder, two.generation) == ("released", A, 1)
    frame = text_of(model)
    lines = lease_lines(frame)
    assert lines[0].split()[:3] == ["job/one", "host:b", "2"] and "held" in lines[0]
    assert lines[1].split()[:3] == ["job/two", "host:a", "1"] and "released" in lines[1]
    assert "1 held" in frame.splitlines()[0]
    assert frame.count("lease.released") == 2 and frame.count("lease.claimed") == 2
    # The rate counts every event seen within the window.
    assert model.rate() == pytest.approx(4.0)
    clock.advance(FREED_LINGER)
    assert [line.split()[0] for line in lease_lines(text_of(model))] == ["job/one"]
    clock.advance(11)
    assert model.rate() == 0.0


def test_lag_is_judged_by_the_database_clock(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "lag")
    clock = FakeClock()
    with pg_store.watch(after="now") as watcher:
        assert pg_store.claim(rid, A, 30) is not None
        [event] = next_events(watcher, 1)
    model = model_at(pg_store, event.created_at, clock)
    clock.advance(0.25)
    model.apply(event)
    assert model.lag == pytest.approx(0.25)
    assert "lag 250 ms" in text_of(model).splitlines()[0]


def test_a_lease_past_its_expiry_is_reread_once_a_second(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    t0 = db_now(pg_store)
    beaten = pg_store.ensure_resource("run", "kept")
    lapsed = pg_store.ensure_resource("run", "lapsed")
    kept_claim = pg_store.claim(beaten, A, 30, now=t0)
    lapsed_claim = pg_store.claim(lapsed, B, 40, now=t0)
    assert kept_claim is not None and lapsed_claim is not None
    clock = FakeClock()
    model = model_at(pg_store, t0, clock)
    model.load(item.state for item in iter_resources(pg_store, schema, held=True))
    assert model.due_rechecks() == []
    # A heartbeat (the keeper's own SQL) extends `kept` and writes no event.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [(status,)] = conn.execute(
            f'SELECT status FROM "{schema}".heartbeat(%s::text[], %s::bigint[], %s::bytea[],'
            " %s::text[], %s::text[], %s::float8[])",
            heartbeat_args([kept_claim], [120.0]),
        ).fetchall()
    assert status == "renewed"
    clock.advance(31)
    assert model.due_rechecks() == [beaten]
    assert model.due_rechecks() == []  # not again within RECHECK_INTERVAL
    model.apply_state(pg_store.get(beaten))
    kept = model.rows[beaten]
    assert kept.state == "held" and (model.time_left(kept) or 0) > 60
    clock.advance(10)  # `lapsed` ran out; judged by the test clock at that instant
    assert model.due_rechecks() == [lapsed]
    model.apply_state(pg_store.get(lapsed, now=t0 + timedelta(seconds=41)))
    assert model.rows[lapsed].state == "expired"
    line = next(x for x in lease_lines(text_of(model)) if x.startswith("run/lapsed"))
    assert line.split()[1:4] == ["host:b", "1", "-"] and "expired" in line
    clock.advance(RECHECK_INTERVAL + FREED_LINGER)
    assert model.due_rechecks() == []
    assert "run/lapsed" not in text_of(model) and lapsed not in model.rows


def test_a_reread_ahead_of_the_events_waits_for_them(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "raced")
    claim = pg_store.claim(rid, A, 30)
    assert claim is not None
    clock = FakeClock()
    with pg_store.watch(after="now") as watcher:
        model = model_at(pg_store, db_now(pg_store), clock)
        model.load(item.state for item in iter_resources(pg_store, pg_store.schema, held=True))
        pg_store.release(claim)
        # Read before the watcher's event is applied: not held, at a later revision.
        model.apply_state(pg_store.get(rid))
        assert model.rows[rid].state == "held"  # not guessed "expired": events will tell
        [event] = next_events(watcher, 1)
    model.apply(event)
    assert (model.rows[rid].state, model.rows[rid].revision) == ("released", event.revision)


def test_a_failed_reread_is_shown_until_one_succeeds(pg_dsn: str, schema: str) -> None:
    store = PostgresStore(pg_dsn, schema=schema)
    rid = store.ensure_resource("run", "unread")
    assert store.claim(rid, A, 30) is not None
    clock = FakeClock()
    model = model_at(store, db_now(store), clock)
    model.load(item.state for item in iter_resources(store, schema, held=True))
    clock.advance(31)
    store.close()
    _quietly(model, lambda: _recheck(store, model))  # the store is gone: StoreClosedError
    assert model.read_error is not None and "closed" in model.read_error
    assert text_of(model).splitlines()[1].startswith("re-read failed: ")
    _quietly(model, lambda: _recheck(store, model))  # nothing due (within a second)
    assert model.read_error is not None
    with PostgresStore(pg_dsn, schema=schema) as again:
        clock.advance(RECHECK_INTERVAL)
        _quietly(model, lambda: _recheck(again, model))
    assert model.read_error is None and model.rows[rid].state == "held"


def test_the_status_line_tells_failing_reads_and_logged_warnings() -> None:
    clock = FakeClock()
    model = TopModel(clock=clock)
    assert text_of(model).splitlines()[1] == ""  # no status line
    since = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    model.set_health(
        WatchHealth(
            failed=False, failed_error=None, last_error="OperationalError: server gone",
            last_error_at=since, failing_since=since, lag_events=3, lag_seconds=2.0,
            reconnects=1, last_read_at=since,
        )
    )  # fmt: skip
    frame = text_of(model).splitlines()
    assert "3 queued" in frame[0]
    assert frame[1].startswith(f"watcher failing since {since.isoformat()} (retrying")
    assert frame[1].endswith("OperationalError: server gone")
    model.set_health(dataclasses.replace(model.health, failing_since=None, last_error=None))
    # A warning logged while the view runs goes to the status line, not stderr.
    with warnings_to(model):
        logging.getLogger("pglease.watch").warning("reconnected after %d s", 4)
    logging.getLogger("pglease.watch").warning("after the view: not shown")
    line = text_of(model).splitlines()[1]
    assert line.startswith("warning at ") and line.endswith("pglease.watch: reconnected after 4 s")
    clock.advance(WARNING_SHOWN)
    assert text_of(model).splitlines()[1] == ""


def test_the_frame_fits_the_terminal_height(pg_store: PostgresStore) -> None:
    t0 = db_now(pg_store)
    for i in range(30):
        rid = pg_store.ensure_resource("run", f"k{i:02d}")
        assert pg_store.claim(rid, A, 100 - i, now=t0) is not None
    model = model_at(pg_store, t0, FakeClock())
    listed = iter_resources(pg_store, pg_store.schema, held=True, page_size=7)
    model.load(item.state for item in listed)
    frame = text_of(model, height=20)
    assert len(frame.splitlines()) <= 20
    lines = lease_lines(frame)
    shown = [line.split()[0] for line in lines if line.startswith("run/")]
    # The soonest to expire come first: k29 has the shortest ttl.
    assert shown == [f"run/k{i:02d}" for i in range(29, 29 - len(shown), -1)]
    assert f"{30 - len(shown)} more held" in frame
    assert f"30 held ({len(shown)} shown)" in frame.splitlines()[0]
    assert len(lease_lines(text_of(model))) == 30


# -- the command --------------------------------------------------------------------


def cli(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "160"},
    )


def test_once_prints_one_frame(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    for key, ttl in (("late", 60), ("soon", 20)):
        rid = pg_store.ensure_resource("run", key)
        assert pg_store.claim(rid, A, ttl) is not None
    other = pg_store.ensure_resource("job", "x")
    assert pg_store.claim(other, B, 5) is not None
    out = cli(pg_dsn, schema, "top", "--once")
    assert out.returncode == 0, out.stderr
    lines = lease_lines(out.stdout)
    assert [line.split()[0] for line in lines] == ["job/x", "run/soon", "run/late"]
    out = cli(pg_dsn, schema, "top", "--once", "--type", "run")
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in lease_lines(out.stdout)] == ["run/soon", "run/late"]


def test_errors_are_one_line_and_reading_never_migrates(pg_dsn: str) -> None:
    missing = f"t_missing_{uuid.uuid4().hex[:8]}"
    out = cli(pg_dsn, missing, "top", "--once")
    assert out.returncode == 2  # a schema with no pglease tables: the exit-code table
    assert out.stderr.startswith("pglease: error:") and missing in out.stderr
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    with psycopg.connect(pg_dsn) as conn:
        assert (
            conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [missing]).fetchone()
            is None
        )
    gone = "postgresql://nobody:secret@127.0.0.1:9/none?connect_timeout=5"
    out = cli(gone, "pglease", "top", "--once")
    assert out.returncode == 1
    assert out.stderr.startswith("pglease: error:") and "127.0.0.1" in out.stderr
    assert len(out.stderr.splitlines()) == 1 and "secret" not in out.stderr
    out = cli(pg_dsn, missing, "top", "--fps", "0")
    assert out.returncode == 2 and "--fps" in out.stderr
    out = cli(pg_dsn, "pglease", "top", "--once", "--type", "Not A Type")
    assert out.returncode == 2 and "resource type 'Not A Type'" in out.stderr
    # Usage before anything connects: no terminal for the live view, or --json.
    out = cli(gone, "pglease", "top")
    assert out.returncode == 2 and "stdout is not one: --once" in out.stderr
    out = cli(gone, "pglease", "top", "--once", "--json")
    assert out.returncode == 2 and "no JSON output" in out.stderr


def test_a_role_without_grants_gets_a_permission_error(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [(can,)] = conn.execute(
            "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
        ).fetchall()
        if not can:
            pytest.skip("the test server's user cannot create roles")
        name = f"pgl_top_{uuid.uuid4().hex[:8]}"
        conn.execute(f"CREATE ROLE {name} LOGIN")
    try:
        out = cli(conninfo.make_conninfo(pg_dsn, user=name), schema, "top", "--once")
        assert out.returncode == 1, out
        assert out.stderr.startswith("pglease: error:") and "permission denied" in out.stderr
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
        # A reader may watch and read: that is all top needs.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            grant(conn, schema, name, "reader")
        rid = pg_store.ensure_resource("run", "seen")
        assert pg_store.claim(rid, A, 60) is not None
        out = cli(conninfo.make_conninfo(pg_dsn, user=name), schema, "top", "--once")
        assert out.returncode == 0, out.stderr
        assert lease_lines(out.stdout)[0].split()[:3] == ["run/seen", "host:a", "1"]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {name}")
            conn.execute(f"DROP ROLE {name}")


# -- a real terminal ----------------------------------------------------------------


class Tmux:
    """One tmux server of our own (its own socket), so nothing else is touched."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-S", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return done.stdout

    def pane(self) -> str:
        return self("capture-pane", "-p", "-t", "top")

    def wait_for(self, what: str, ok: Callable[[str], bool], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.pane()
            if ok(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"waited {timeout:g}s for {what}; the pane shows:\n{screen}")


@pytest.fixture
def tmux(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (.ci/run installs it on Debian)")
    # A short path: a unix socket's path is limited to about 100 bytes.
    socket = Path(tmp_path_factory.mktemp("tmux", numbered=True)) / "s"
    t = Tmux(socket)
    try:
        yield t
    finally:
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], capture_output=True, timeout=30)


def start_top(tmux: Tmux, pg_dsn: str, schema: str, *extra: str) -> None:
    command = shlex.join(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, "top", *extra]
    )
    # The exit status is printed on the pane once the view has left its screen;
    # the trap keeps the shell alive through a Ctrl-C meant for the view.
    tmux(
        "new-session", "-d", "-s", "top", "-x", "160", "-y", "40",
        f'trap : INT; {command}; echo "exit=$?"; sleep 600',
    )  # fmt: skip
    tmux.wait_for("the header", lambda s: "pglease top" in s and "q quits" in s)


def row_of(screen: str, resource: str) -> list[str] | None:
    for line in screen.splitlines():
        if line.startswith(resource + " "):
            return line.split()
    return None


def test_top_in_a_terminal_follows_claims_and_releases(
    tmux: Tmux, pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    start_top(tmux, pg_dsn, schema)
    alpha = pg_store.ensure_resource("run", "alpha")
    claim = pg_store.claim(alpha, Owner("host", "tmux-a"), 60)
    assert claim is not None
    screen = tmux.wait_for(
        "run/alpha held by host:tmux-a, generation 1",
        lambda s: (row_of(s, "run/alpha") or [])[1:3] == ["host:tmux-a", "1"],
    )
    assert "held" in (row_of(screen, "run/alpha") or [])
    assert "lease.claimed" in screen
    beta = pg_store.ensure_resource("run", "beta")
    assert pg_store.claim(beta, Owner("host", "tmux-b"), 20) is not None

    def beta_first(s: str) -> bool:
        order = [line.split()[0] for line in s.splitlines() if line.startswith("run/")]
        return order == ["run/beta", "run/alpha"]

    tmux.wait_for("run/beta (sooner to expire) above run/alpha", beta_first)
    pg_store.release(claim)
    screen = tmux.wait_for(
        "run/alpha marked released",
        lambda s: "released" in (row_of(s, "run/alpha") or []),
    )
    assert "1 held" in screen and "lease.released" in screen
    again = pg_store.claim(alpha, Owner("host", "tmux-c"), 60)
    assert again is not None
    tmux.wait_for(
        "run/alpha held by host:tmux-c, generation 2",
        lambda s: (row_of(s, "run/alpha") or [])[1:3] == ["host:tmux-c", "2"],
    )
    tmux("send-keys", "-t", "top", "q")
    screen = tmux.wait_for("the exit status after q", lambda s: "exit=" in s)
    assert "exit=0" in screen and "Traceback" not in screen


def test_a_heartbeat_kept_lease_stays_held_on_screen(
    tmux: Tmux, pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    start_top(tmux, pg_dsn, schema)
    seen: list[str] = []

    def left(s: str) -> float | None:
        seen.append(s)
        row = row_of(s, "run/beating")
        if row is None or row[3] == "-":
            return None
        return float(row[3].rstrip("s"))

    # Heartbeats write no event: only the view's re-read at the known expiry
    # can tell that the keeper extended the lease.
    with pg_store.hold("run", "beating", Owner("host", "keeper"), ttl=3, timeout=0) as lease:
        tmux.wait_for("run/beating held", lambda s: left(s) is not None)
        low = 10.0

        def extended(s: str) -> bool:
            nonlocal low
            now = left(s)
            if now is None:
                return False
            low = min(low, now)
            return now > low + 0.5  # its time left went up again

        tmux.wait_for("the lease extended on screen", extended)
        lease.check()
    rows = [row_of(s, "run/beating") for s in seen]
    first = next(i for i, r in enumerate(rows) if r is not None)
    # From its first frame on, every frame showed it held by the keeper.
    assert all(r is not None and r[1:3] == ["host:keeper", "1"] for r in rows[first:])
    assert all("held" in r and "expired" not in r for r in rows[first:] if r is not None)


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_ctrl_c_and_sigterm_leave_the_view_cleanly(
    how: str, tmux: Tmux, pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("run", "kept")
    assert pg_store.claim(rid, A, 60) is not None
    start_top(tmux, pg_dsn, schema, "--type", "run", "--fps", "2")
    tmux.wait_for("run/kept", lambda s: (row_of(s, "run/kept") or [])[1:3] == ["host:a", "1"])
    if how == "Ctrl-C":
        tmux("send-keys", "-t", "top", "C-c")
    else:
        shell = tmux("display-message", "-p", "-t", "top", "#{pane_pid}").strip()
        [child] = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
        os.kill(int(child), signal.SIGTERM)
    screen = tmux.wait_for(f"the exit status after {how}", lambda s: "exit=" in s)
    assert "exit=0" in screen and "Traceback" not in screen
    assert "run/kept" not in screen  # the view's screen is gone: the terminal is restored


def test_top_in_a_terminal_ends_with_one_error_line(
    tmux: Tmux, pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    start_top(tmux, pg_dsn, schema)
    # The schema disappears under the view: its watcher cannot heal that.
    drop_schema(pg_dsn, schema)
    screen = tmux.wait_for("the exit status", lambda s: "exit=" in s)
    assert "exit=1" in screen and "Traceback" not in screen
    errors = [line for line in screen.splitlines() if line.startswith("pglease: error:")]
    assert len(errors) == 1, screen


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for attempt in range(5):
            try:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
                return
            except psycopg.errors.DeadlockDetected:
                if attempt == 4:
                    raise
                time.sleep(0.1)
