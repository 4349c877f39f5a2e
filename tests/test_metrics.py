"""Prometheus metrics (`pglease.metrics`): real claims, holds, acquires, watchers,
reaper and prune runs against the test PostgreSQL, scraped over real HTTP.

Metrics are per process and cumulative, and other tests in the same process
may have moved them: every assertion compares a scrape after the action with
one before it. Time-based values are driven by a `FakeClock` where pglease
reads one (keeper lateness, acquire waits), so their exact values are known.
"""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pglease import (
    AcquireTimeoutError,
    AsyncPostgresStore,
    LeaseLostError,
    Owner,
    PostgresStore,
    SqliteStore,
    metrics,
)
from pglease.clock import FakeClock
from pglease.errors import MetricsError, PgleaseError, ValidationError
from pglease.runtime import Keeper, Timing, acquire, hold, hold_async
from pglease.watch import prune, reap_once

A = Owner("host", "a")
B = Owner("host", "b")
TTL = 30.0  # interval 10 s, margin 3 s
TIMING = Timing.of(TTL)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[metrics.MetricsServer]:
    with metrics.serve(0) as server:
        yield server


def scrape(url: str) -> Samples:
    """One scrape over HTTP, parsed by prometheus_client's own text parser."""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} is not exposed"
    return samples[key]


class Delta:
    """What changed between a scrape taken at creation and one taken by `__call__`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = scrape(url)
        self.after: Samples = self.before

    def __call__(self) -> Delta:
        self.after = scrape(self.url)
        return self

    def of(self, name: str, **labels: str) -> float:
        return value(self.after, name, **labels) - value(self.before, name, **labels)


def _eventually(check: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


# --------------------------------------------------------------------------- store API


def test_claims_renewals_and_releases_by_outcome(
    pg_store: PostgresStore, endpoint: metrics.MetricsServer
) -> None:
    delta = Delta(endpoint.url)
    rid = pg_store.ensure_resource("run", "m1")
    claim = pg_store.claim(rid, A, 30)
    assert claim is not None
    assert pg_store.claim(rid, B, 30) is None  # held by A
    claim = pg_store.renew(claim, 30)
    assert pg_store.release(claim) > 0
    with pytest.raises(LeaseLostError):
        pg_store.renew(claim, 30)  # released: no longer current
    with pytest.raises(LeaseLostError):
        pg_store.release(claim)
    with pytest.raises(ValidationError):
        pg_store.claim(rid, A, -1)  # bad input: refused before anything, not counted
    delta()
    assert delta.of("pglease_claims_total", outcome="claimed") == 1
    assert delta.of("pglease_claims_total", outcome="held") == 1
    assert delta.of("pglease_claims_total", outcome="error") == 0
    assert delta.of("pglease_renewals_total", source="store", outcome="renewed") == 1
    assert delta.of("pglease_renewals_total", source="store", outcome="lost") == 1
    assert delta.of("pglease_releases_total", outcome="released") == 1
    assert delta.of("pglease_releases_total", outcome="lost") == 1


async def test_asyncio_store_and_hold_async(
    apg_store: AsyncPostgresStore, endpoint: metrics.MetricsServer
) -> None:
    delta = Delta(endpoint.url)
    rid = await apg_store.ensure_resource("run", "async")
    claim = await apg_store.claim(rid, A, 30)
    assert claim is not None
    assert await apg_store.claim(rid, B, 30) is None
    claim = await apg_store.renew(claim, 30)
    await apg_store.release(claim)
    with pytest.raises(LeaseLostError):
        await apg_store.release(claim)
    async with hold_async(apg_store, "run", "async", A, TTL):
        assert value(scrape(endpoint.url), "pglease_leases_held") >= 1
    delta()
    assert delta.of("pglease_claims_total", outcome="claimed") == 2  # the claim, the hold
    assert delta.of("pglease_claims_total", outcome="held") == 1
    assert delta.of("pglease_renewals_total", source="store", outcome="renewed") == 1
    assert delta.of("pglease_releases_total", outcome="released") == 2
    assert delta.of("pglease_releases_total", outcome="lost") == 1
    assert delta.of("pglease_acquire_wait_seconds_count", outcome="acquired") == 1


def test_sqlite_store_counts_too(tmp_path: Path, endpoint: metrics.MetricsServer) -> None:
    delta = Delta(endpoint.url)
    with SqliteStore(str(tmp_path / "leases.sqlite")) as store:
        rid = store.ensure_resource("run", "lite")
        claim = store.claim(rid, A, 30)
        assert claim is not None
        assert store.claim(rid, B, 30) is None
        claim = store.renew(claim, 30)
        store.release(claim)
        with pytest.raises(LeaseLostError):
            store.renew(claim, 30)
        with pytest.raises(ValidationError):
            store.claim(rid, A, 0)
    delta()
    assert delta.of("pglease_claims_total", outcome="claimed") == 1
    assert delta.of("pglease_claims_total", outcome="held") == 1
    assert delta.of("pglease_claims_total", outcome="error") == 0
    assert delta.of("pglease_renewals_total", source="store", outcome="renewed") == 1
    assert delta.of("pglease_renewals_total", source="store", outcome="lost") == 1
    assert delta.of("pglease_releases_total", outcome="released") == 1


def test_a_claim_on_a_locked_row_counts_as_busy(
    pg_dsn: str, schema: str, endpoint: metrics.MetricsServer
) -> None:
    with PostgresStore(pg_dsn, schema=schema, lock_timeout=0.2) as store:
        rid = store.ensure_resource("run", "locked")
        with psycopg.connect(pg_dsn) as blocker:
            blocker.execute(
                f'SELECT 1 FROM "{schema}".leases WHERE resource_id = %s FOR UPDATE', [rid]
            )
            delta = Delta(endpoint.url)
            with pytest.raises(PgleaseError, match="lock_timeout"):
                store.claim(rid, A, 30)
            blocker.rollback()
    assert delta().of("pglease_claims_total", outcome="busy") == 1


# --------------------------------------------------------------------------- keeper


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def keeper(pg_store: PostgresStore, clock: FakeClock) -> Iterator[Keeper]:
    with Keeper(pg_store, clock=clock) as k:
        yield k


def test_heartbeats_lateness_and_leases_held(
    pg_store: PostgresStore, clock: FakeClock, keeper: Keeper, endpoint: metrics.MetricsServer
) -> None:
    delta = Delta(endpoint.url)
    held_before = value(delta.before, "pglease_leases_held")
    with hold(pg_store, "run", "beat", A, TTL, keeper=keeper) as lease:
        assert value(scrape(endpoint.url), "pglease_leases_held") == held_before + 1
        # Due 10 s after the claim; the clock jumps to 12 s: the beat is 2 s late.
        clock.advance(TIMING.interval + 2)
        _eventually(lambda: lease.renewals == 1)
        delta()
    assert delta.of("pglease_heartbeat_duration_seconds_count") == 1
    assert delta.of("pglease_heartbeat_duration_seconds_sum") > 0
    assert delta.of("pglease_heartbeat_lateness_seconds_count") == 1
    assert delta.of("pglease_heartbeat_lateness_seconds_sum") == pytest.approx(2.0)
    assert delta.of("pglease_heartbeat_lateness_seconds_bucket", le="1.0") == 0
    assert delta.of("pglease_heartbeat_lateness_seconds_bucket", le="2.5") == 1
    assert delta.of("pglease_renewals_total", source="keeper", outcome="renewed") == 1
    assert delta.of("pglease_heartbeat_errors_total") == 0
    # Released on exit: no longer held.
    assert value(scrape(endpoint.url), "pglease_leases_held") == held_before


def test_a_failed_heartbeat_is_counted(
    pg_store: PostgresStore, clock: FakeClock, keeper: Keeper, endpoint: metrics.MetricsServer
) -> None:
    with hold(pg_store, "run", "cut", A, TTL, keeper=keeper) as lease:
        delta = Delta(endpoint.url)
        # End the keeper's server process: its next beat fails, the retry reconnects.
        with psycopg.connect(pg_store.dsn, autocommit=True) as conn:
            ended = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s",
                [f"pglease-keeper-{pg_store.schema}"],
            ).fetchone()
        assert ended == (1,)
        clock.advance(TIMING.interval)
        _eventually(lambda: keeper.stats.errors >= 1)

        def retried() -> bool:
            clock.advance(0.1)  # retries are due moments later on the clock
            return lease.renewals >= 1

        # Under load the first retry can fail too (the server is still ending
        # the backend); each failure is counted, and the next retry is due.
        _eventually(retried)
        delta()
    assert keeper.stats.errors >= 1
    assert delta.of("pglease_heartbeat_errors_total") == keeper.stats.errors
    beats = lease.renewals  # 1, or 2 had a regular beat come due meanwhile
    assert delta.of("pglease_heartbeat_duration_seconds_count") == beats
    assert delta.of("pglease_renewals_total", source="keeper", outcome="renewed") == beats
    assert delta.of("pglease_leases_lost_total", cause="trust_window") == 0


def test_losses_are_counted_by_cause(
    pg_store: PostgresStore, clock: FakeClock, keeper: Keeper, endpoint: metrics.MetricsServer
) -> None:
    delta = Delta(endpoint.url)
    # Taken away in the database: the next beat reports it not current.
    with (
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(pg_store, "run", "gone", A, TTL, keeper=keeper) as lease,
    ):
        pg_store.release(lease.claim)
        clock.advance(TIMING.interval)
        assert lease.lost.wait(60)
    # No beat before the trust window closes (one jump past it): lost locally.
    with (
        pytest.raises(LeaseLostError, match="left after the loss"),
        hold(pg_store, "run", "stalled", A, TTL, keeper=keeper) as lease,
    ):
        clock.advance(TTL - TIMING.margin)
        assert lease.lost.wait(60)
    delta()
    assert delta.of("pglease_leases_lost_total", cause="not_current") == 1
    assert delta.of("pglease_leases_lost_total", cause="trust_window") == 1
    assert delta.of("pglease_leases_lost_total", cause="expired") == 0
    assert delta.of("pglease_renewals_total", source="keeper", outcome="lost") == 1


# --------------------------------------------------------------------------- acquire


def test_acquire_waits_by_outcome(
    pg_store: PostgresStore, clock: FakeClock, endpoint: metrics.MetricsServer
) -> None:
    rid = pg_store.ensure_resource("run", "wait")
    claim = pg_store.claim(rid, A, 600)
    assert claim is not None
    delta = Delta(endpoint.url)
    errors: queue.Queue[BaseException | None] = queue.Queue()

    def waiter() -> None:
        try:
            acquire(pg_store, "run", "wait", B, 30, timeout=5, clock=clock)
            errors.put(None)
        except BaseException as exc:
            errors.put(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    # Held for 600 s: the waiter's first attempt finds it held, then waits.
    _eventually(lambda: value(scrape(endpoint.url), "pglease_claims_total", outcome="held")
                > value(delta.before, "pglease_claims_total", outcome="held"))  # fmt: skip
    clock.advance(6)
    thread.join(60)
    assert isinstance(errors.get(timeout=1), AcquireTimeoutError)
    pg_store.release(claim)
    won = acquire(pg_store, "run", "wait", B, 30, timeout=5, clock=clock)
    pg_store.release(won)
    delta()
    assert delta.of("pglease_acquire_wait_seconds_count", outcome="timeout") == 1
    assert delta.of("pglease_acquire_wait_seconds_sum", outcome="timeout") == pytest.approx(6.0)
    assert delta.of("pglease_acquire_wait_seconds_count", outcome="acquired") == 1
    # The fake clock stood still while the second acquire won at once.
    assert delta.of("pglease_acquire_wait_seconds_sum", outcome="acquired") == 0
    assert delta.of("pglease_claims_total", outcome="claimed") == 1


# --------------------------------------------------------------------------- watch


def test_watch_reads_lag_and_reconnects(
    pg_store: PostgresStore, endpoint: metrics.MetricsServer
) -> None:
    delta = Delta(endpoint.url)
    rid = pg_store.ensure_resource("run", "watched")
    with pg_store.watch(after="now", resources=rid) as watcher:
        hub = watcher._hub
        assert hub is not None
        # Once the hub has read, later events reach the watcher through it (an
        # event before that comes from the watcher's own catch-up read).
        _eventually(lambda: hub.reads >= 1)
        claim = pg_store.claim(rid, A, 30)
        assert claim is not None
        event = watcher.get(timeout=60)
        assert event is not None and event.type == "lease.claimed"
        assert hub.backend_pid is not None
        # Kill the hub's server process: it reconnects and catches up.
        with psycopg.connect(pg_store.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", [hub.backend_pid])
        pg_store.release(claim)
        event = watcher.get(timeout=60)
        assert event is not None and event.type == "lease.released"
        delta()
    assert delta.of("pglease_watch_reads_total", mode="listen") >= 2
    assert delta.of("pglease_watch_events_total", mode="listen") >= 2
    assert delta.of("pglease_watch_reconnects_total", mode="listen") == 1
    assert delta.of("pglease_watch_lag_seconds_count") >= 2
    # Two events read within the minute the test took, on one machine.
    assert delta.of("pglease_watch_lag_seconds_bucket", le="+Inf") >= 2
    assert delta.of("pglease_watch_reads_total", mode="poll") == 0


# --------------------------------------------------------------------------- reaper, prune


def test_reaper_and_prune_work(pg_store: PostgresStore, endpoint: metrics.MetricsServer) -> None:
    rid = pg_store.ensure_resource("run", "expired")
    past = datetime.now(UTC) - timedelta(hours=1)
    assert pg_store.claim(rid, A, 1, now=past) is not None  # ran out an hour ago
    delta = Delta(endpoint.url)
    assert reap_once(pg_store) == 1
    assert reap_once(pg_store) == 0
    deleted = prune(pg_store, 0)
    assert deleted.events > 0
    delta()
    assert delta.of("pglease_reaper_passes_total") == 2
    assert delta.of("pglease_reaped_leases_total") == 1
    assert delta.of("pglease_prunes_total") == 1
    assert delta.of("pglease_pruned_events_total") == deleted.events
    assert delta.of("pglease_pruned_payloads_total") == deleted.payloads


# --------------------------------------------------------------------------- the endpoint


def test_labels_never_carry_keys_or_owners(
    pg_store: PostgresStore, endpoint: metrics.MetricsServer
) -> None:
    rid = pg_store.ensure_resource("run", "secret-key-42")
    claim = pg_store.claim(rid, Owner("host", "owner-77"), 30)
    assert claim is not None
    pg_store.release(claim)
    with urllib.request.urlopen(endpoint.url, timeout=30) as response:
        text = response.read().decode()
    assert "secret-key-42" not in text and "owner-77" not in text and rid not in text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert {n for n in names if n.startswith("pglease_")} >= {
        "pglease_claims_total",
        "pglease_leases_held",
        "pglease_watch_lag_seconds_bucket",
    }


def test_serve_errors_and_stop() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            metrics.serve(port)
    for bad in (-1, 65536, True, "9464"):
        with pytest.raises(ValidationError, match="metrics port"):
            metrics.serve(bad)  # type: ignore[arg-type]
    with pytest.raises(MetricsError, match="already enabled on another registry"):
        metrics.enable(CollectorRegistry())
    assert metrics.enable() is metrics.enable()  # idempotent
    server = metrics.serve(0)
    scrape(server.url)
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=10)


# --------------------------------------------------------------------------- CLI, processes


def _line(stream: IO[str], timeout: float = 60.0) -> str:
    """The next line of a child's pipe, or fail after `timeout` (never hang)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    return lines.get(timeout=timeout)


def _cli(dsn: str, schema: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pglease", "--dsn", dsn, "--schema", schema, *args]


def test_hold_cli_serves_its_metrics(pg_store: PostgresStore) -> None:
    """`pglease hold --metrics-port 0` in its own process: the lease it holds,
    its claim and its keeper's renewals are scraped from its endpoint."""
    script = "import sys; print('up', flush=True); sys.stdin.read()"
    command = _cli(pg_store.dsn, pg_store.schema, "hold", "job", "m", "--owner", "host:cli",
                   "--ttl", "6", "--metrics-port", "0", "--",
                   sys.executable, "-c", script)  # fmt: skip
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None and proc.stdin is not None
        announced = _line(proc.stderr)
        assert announced.startswith("pglease: metrics at http://127.0.0.1:"), announced
        url = announced.split(" at ", 1)[1].strip()
        assert _line(proc.stdout).strip() == "up"
        samples = scrape(url)
        assert value(samples, "pglease_leases_held") == 1
        assert value(samples, "pglease_claims_total", outcome="claimed") == 1
        # ttl 6 s: the keeper renews every 2 s.
        _eventually(
            lambda: (
                value(scrape(url), "pglease_renewals_total", source="keeper", outcome="renewed")
                >= 1
            )
        )
        proc.stdin.close()  # the command ends; the runner releases and exits
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=10)
    assert not pg_store.get(pg_store.ensure_resource("job", "m")).lease.held


def test_cli_metrics_port_errors(pg_store: PostgresStore) -> None:
    bad = subprocess.run(
        _cli(pg_store.dsn, pg_store.schema, "reap", "--once", "--metrics-port", "70000"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "65535" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = subprocess.run(
            _cli(pg_store.dsn, pg_store.schema, "watch", "--metrics-port", port),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert busy.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in busy.stderr
    assert "Traceback" not in busy.stderr


# Block prometheus_client in a child, as if the extra were not installed.
_BLOCKED = "import sys; sys.modules['prometheus_client'] = None; "


def test_missing_extra_is_named(pg_store: PostgresStore) -> None:
    code = _BLOCKED + "import pglease.metrics"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode != 0
    assert "MetricsUnavailableError" in child.stderr
    assert "pip install 'pglease[metrics]'" in child.stderr
    # The CLI says so in one line, exits 1 and does nothing (the reap never ran).
    rid = pg_store.ensure_resource("run", "not-reaped")
    past = datetime.now(UTC) - timedelta(hours=1)
    assert pg_store.claim(rid, A, 1, now=past) is not None
    code = _BLOCKED + "from pglease.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["--dsn", pg_store.dsn, "--schema", pg_store.schema, "reap", "--once",
            "--metrics-port", "0"]  # fmt: skip
    cli = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 1, cli.stderr
    assert "pip install 'pglease[metrics]'" in cli.stderr and "Traceback" not in cli.stderr
    assert [e.type for e in pg_store.events(rid)] == ["lease.claimed"]


def test_no_metrics_no_prometheus_import(pg_store: PostgresStore) -> None:
    """Without `enable`, pglease never imports prometheus_client, and runs
    unchanged when it is missing."""
    code = (
        "import sys; from pglease import Owner, PostgresStore; "
        "s = PostgresStore(sys.argv[1], schema=sys.argv[2]); "
        "rid = s.ensure_resource('run', 'plain'); "
        "c = s.claim(rid, Owner('host', 'x'), 30); s.release(c); "
        "w = s.watch(after='start', resources=rid); e = w.get(timeout=60); w.close(); "
        "s.close(); print(e.type, 'prometheus_client' in sys.modules)"
    )
    # Blocked, the key is present (as None): the import would fail, and none ran.
    for prefix, imported in (("", "False"), (_BLOCKED, "True")):
        child = subprocess.run(
            [sys.executable, "-c", prefix + code, pg_store.dsn, pg_store.schema],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr
        assert child.stdout.split() == ["lease.claimed", imported]
