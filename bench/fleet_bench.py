"""Fleet benchmarks: heartbeat cost for 10,000 leases, takeover latency after a real
SIGKILL of the holder process, hot-key contention (fair and unfair).

    .venv/bin/python bench/fleet_bench.py [--leases 10000] [--waiters 16] [--seconds 5]
        [--rounds 10] [--ttl 1.0] [--baseline REV] [--only heartbeat,takeover,hotkey]

Hot key runs in child processes, one per configuration, against the same
server: the current code, and with ``--baseline REV`` the package as of git
revision REV (extracted with ``git archive``), alternating, so before and after
are measured in the same run on the same machine state.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# A child measuring a baseline imports the package from the extracted tree.
sys.path.insert(0, os.environ.get("PGLEASE_BENCH_CODE", str(ROOT)))
sys.path.insert(0, str(HERE))

from _server import throwaway_server  # noqa: E402

from pglease import AcquireTimeoutError, Owner, PostgresStore  # noqa: E402
from pglease.runtime import Keeper, Timing, acquire, hold  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of sorted `values`."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]


# --------------------------------------------------------------------------- heartbeat


def heartbeat_cost(store: PostgresStore, n: int) -> None:
    owner = Owner("host", "bench")
    rids = [store.ensure_resource("hb", f"k{i}") for i in range(n)]
    with Keeper(store) as keeper:
        timing = Timing.of(30.0, interval=10.0)
        for rid in rids:
            claim = store.claim(rid, owner, 30.0)
            assert claim is not None
            lease = keeper.add(claim, timing, time.monotonic())
            lease.next_due = 0.0  # renew all at once, now
        durations = []
        for _ in range(5):
            with keeper._cond:  # force a beat of every lease
                for lease in keeper._core.leases.values():
                    lease.next_due = 0.0
                keeper._cond.notify_all()
            beats = keeper.stats.beats
            while keeper.stats.beats == beats:
                time.sleep(0.01)
            durations.append(keeper.stats.last_beat_seconds)
        print(f"heartbeat: {keeper.stats.last_beat_size} leases per beat, one round trip;"
              f" beat duration median {statistics.median(durations) * 1000:.1f} ms,"
              f" max {max(durations) * 1000:.1f} ms", flush=True)  # fmt: skip


# --------------------------------------------------------------------------- takeover


def holder_main(dsn: str, schema: str, key: str, ttl: float) -> None:
    """Child process: hold (type "tk", key) with the keeper until SIGKILLed."""
    store = PostgresStore(dsn, schema=schema, max_size=2, auto_migrate=False)
    with hold(store, "tk", key, Owner("host", f"holder-{os.getpid()}"), ttl, timeout=60) as lease:
        print(json.dumps({"generation": lease.generation}), flush=True)
        while True:
            time.sleep(1)


def takeover(dsn: str, schema: str, ttl: float, rounds: int) -> None:
    """A holder process keeps its lease with `hold()`; a waiter (a thread here) is
    blocked in `acquire`; the holder is SIGKILLed at a random point of its renew
    cycle. Latency = waiter's claim (`leases.acquired_at`) minus the holder's last
    successful renewal (`leases.heartbeat_at`, or its claim time if it never
    renewed), both by the database clock."""
    rnd = random.Random(7)
    lat: list[float] = []
    after_expiry: list[float] = []
    renewals: list[int] = []
    with PostgresStore(dsn, schema=schema, max_size=4) as store:
        for r in range(rounds):
            key = f"k{r}-{uuid.uuid4().hex[:6]}"
            rid = store.ensure_resource("tk", key)
            proc = subprocess.Popen(
                [sys.executable, __file__, "--role", "holder", "--dsn", dsn, "--schema", schema,
                 "--key", key, "--ttl", repr(ttl)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                assert proc.stdout is not None
                held = json.loads(proc.stdout.readline())
                got: list[Any] = []

                def wait_for(k: str = key, out: list[Any] = got) -> None:
                    nxt = Owner("host", "next")
                    out.append(acquire(store, "tk", k, nxt, ttl, timeout=ttl * 10))

                waiter = threading.Thread(target=wait_for)
                waiter.start()
                # Let the keeper renew a few times, then kill at a random phase.
                time.sleep(ttl * (1 + rnd.random()))
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            # The holder is dead; a renewal it had in flight has reached the
            # server by now (a 20 ms socket hop at most on loopback), and the
            # lease still has most of a ttl to run: read its last heartbeat.
            time.sleep(min(0.05, ttl / 10))
            with store.connection() as conn:
                row = conn.execute(
                    "SELECT generation, heartbeat_at, acquired_at, expires_at"
                    f' FROM "{schema}".leases WHERE resource_id = %s', [rid],
                ).fetchone()  # fmt: skip
            assert row is not None
            if row[0] != held["generation"]:
                print(f"  round {r}: the waiter claimed before the heartbeat was read; skipped")
                waiter.join(ttl * 10)
                continue
            last_beat, claimed_first, expires = row[1], row[2], row[3]
            renewals.append(round((last_beat - claimed_first).total_seconds() / (ttl / 3)))
            waiter.join(ttl * 10)
            assert got, "the waiter did not claim"
            with store.connection() as conn:
                row = conn.execute(
                    f'SELECT generation, acquired_at FROM "{schema}".leases WHERE resource_id = %s',
                    [rid],
                ).fetchone()  # fmt: skip
            assert row is not None and row[0] == held["generation"] + 1
            lat.append((row[1] - last_beat).total_seconds())
            after_expiry.append((row[1] - expires).total_seconds())
    lat.sort()
    after_expiry.sort()
    target = ttl + 0.05
    print(
        f"takeover after SIGKILL of a hold() process (ttl {ttl:g} s, {len(lat)} rounds,"
        f" ~{statistics.median(renewals):.0f} renewals before the kill):"
        f" last renewal -> waiter's claim p50 {_pct(lat, 0.5) * 1000:.1f} ms,"
        f" p99 {_pct(lat, 0.99) * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms;"
        f" max / (ttl + 50 ms) = {lat[-1] / target:.3f}"
        f" (claim after the database expiry: p50 {_pct(after_expiry, 0.5) * 1000:.1f} ms,"
        f" max {after_expiry[-1] * 1000:.1f} ms)",
        flush=True,
    )


# --------------------------------------------------------------------------- hot key


def hot_key_main(dsn: str, schema: str, waiters: int, seconds: float, fair: bool) -> None:
    """Child process: `waiters` threads loop acquire -> release on one key; print JSON."""
    waits: list[float] = []
    timeouts = 0
    lock = threading.Lock()
    with PostgresStore(dsn, schema=schema, max_size=waiters + 4) as store:
        store.ensure_resource("hot", "k")
        # Warm-up (connections, prepared statements, the watch hub) outside the clock.
        store.release(acquire(store, "hot", "k", Owner("host", "warm"), 5.0, timeout=30, fair=fair))
        barrier = threading.Barrier(waiters + 1)
        stop = [0.0]

        def run(i: int) -> None:
            nonlocal timeouts
            owner = Owner("host", f"w{i}")
            barrier.wait()
            while time.monotonic() < stop[0]:
                t0 = time.monotonic()
                try:
                    claim = acquire(store, "hot", "k", owner, 5.0, timeout=30, fair=fair)
                except AcquireTimeoutError:
                    with lock:
                        timeouts += 1
                    continue
                with lock:
                    waits.append(time.monotonic() - t0)
                store.release(claim)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(waiters)]
        for t in threads:
            t.start()
        stop[0] = time.monotonic() + seconds
        started = time.monotonic()
        barrier.wait()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
    waits.sort()
    print(json.dumps({
        "rate": len(waits) / elapsed, "p50": _pct(waits, 0.5), "p99": _pct(waits, 0.99),
        "max": waits[-1] if waits else float("nan"), "n": len(waits), "timeouts": timeouts,
    }))  # fmt: skip


def _extract(rev: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "pglease", "sql"],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def hot_key(dsn: str, waiters: int, seconds: float, baseline: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        codes: list[tuple[str, str]] = []
        if baseline:
            _extract(baseline, Path(tmp))
            codes.append((f"before ({baseline})", tmp))
        codes.append(("after (working tree)", str(ROOT)))
        for fair in (False, True):
            for label, code in codes:
                schema = f"hot_{uuid.uuid4().hex[:8]}"
                out = subprocess.run(
                    [sys.executable, __file__, "--role", "hotkey", "--dsn", dsn, "--schema",
                     schema, "--waiters", str(waiters), "--seconds", repr(seconds)]
                    + (["--fair"] if fair else []),
                    env={**os.environ, "PGLEASE_BENCH_CODE": code},
                    check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                r = json.loads(out.strip().splitlines()[-1])
                print(f"hot key, {waiters} waiters, {'fair' if fair else 'unfair'}, {label}:"
                      f" {r['rate']:.0f} acquisitions/s, wait p50 {r['p50'] * 1000:.1f} ms,"
                      f" p99 {r['p99'] * 1000:.1f} ms, max {r['max'] * 1000:.1f} ms,"
                      f" {r['timeouts']} timeouts (30 s)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--leases", type=int, default=10_000)
    p.add_argument("--waiters", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--ttl", type=float, default=1.0, help="takeover ttl")
    p.add_argument("--baseline", help="git revision to measure the hot key against")
    p.add_argument("--only", default="heartbeat,takeover,hotkey")
    # Child roles.
    p.add_argument("--role", choices=["holder", "hotkey"])
    p.add_argument("--dsn")
    p.add_argument("--schema")
    p.add_argument("--key")
    p.add_argument("--fair", action="store_true")
    args = p.parse_args()
    if args.role == "holder":
        holder_main(args.dsn, args.schema, args.key, args.ttl)
        return
    if args.role == "hotkey":
        hot_key_main(args.dsn, args.schema, args.waiters, args.seconds, args.fair)
        return
    only = set(args.only.split(","))
    with throwaway_server() as dsn:
        if "heartbeat" in only:
            with PostgresStore(dsn, schema="hb") as store:
                heartbeat_cost(store, args.leases)
        if "takeover" in only:
            takeover(dsn, "tk", args.ttl, args.rounds)
        if "hotkey" in only:
            hot_key(dsn, args.waiters, args.seconds, args.baseline)


if __name__ == "__main__":
    main()
