"""Through PgBouncer (transaction pooling, ``pooler=True``) next to direct connections.

One run, one server (a throwaway embedded PostgreSQL), one PgBouncer in front
of it; cells interleaved (round-robin, order rotated each round) so drift in
the machine's load hits both sides alike:

- ``claim``: claim+release cycles/s, N threads sharing one sync
  `PostgresStore` (pool of N), random keys out of RESOURCES (a refused claim
  still counts as a cycle, as in bench/claim_release.py);
- ``watch``: commit-to-delivery latency of one sync `Watcher` in this process
  while a writer thread does claim/release cycles (5 ms apart): from the
  moment the writer's call returned (its commit was acknowledged) to the
  moment the watcher yielded the event. Cells: poll through the bouncer, poll
  direct, LISTEN direct (LISTEN cannot work behind a transaction pooler).

Run ``python bench/pgbouncer_bench.py --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import machine_info, throwaway_server

from pglease import Owner, PostgresStore
from pglease.watch import WatchClosedError, Watcher

RESOURCES = 1000
OWNER = Owner("bench", "client")
BOUNCER_USER = "pglease_ci"


# --------------------------------------------------------------------------- pgbouncer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_as(host: str) -> str:
    """pgbouncer refuses root: run it as the owner of the server's socket
    directory (the embedded server's data dir is 0700), else BOUNCER_USER."""
    with contextlib.suppress(OSError):
        uid = os.stat(host).st_uid
        if uid != 0:
            return pwd.getpwuid(uid).pw_name
    if subprocess.run(["id", "-u", BOUNCER_USER], capture_output=True).returncode:
        subprocess.run(["useradd", "--system", "--no-create-home", BOUNCER_USER], check=True)
    return BOUNCER_USER


@contextlib.contextmanager
def pgbouncer(dsn: str, pool_size: int) -> Iterator[str]:
    """A PgBouncer in transaction pooling mode in front of `dsn`; yields its DSN."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    params = conninfo_to_dict(dsn)
    user = str(params.get("user") or "postgres")
    dbname = str(params.get("dbname") or "postgres")
    host = str(params.get("host") or "/tmp")
    port = str(params.get("port") or "5432")
    work = Path(tempfile.mkdtemp(prefix="pglease-bouncer-bench-"))
    listen = _free_port()
    (work / "users.txt").write_text(f'"{user}" ""\n')
    (work / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {listen}\n"
        f"unix_socket_dir = {work}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {pool_size}\nmax_client_conn = 200\n"
        f"auth_type = trust\nauth_file = {work / 'users.txt'}\n"
        "ignore_startup_parameters = extra_float_digits\n"
        f"logfile = {work / 'pgbouncer.log'}\npidfile = {work / 'pgbouncer.pid'}\n"
    )
    command = [binary, str(work / "pgbouncer.ini")]
    if os.getuid() == 0:
        owner = _run_as(host)
        for path in (work, *work.iterdir()):
            shutil.chown(path, owner)
        command = ["runuser", "-u", owner, "--", *command]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bouncer = f"postgresql://{user}@127.0.0.1:{listen}/{dbname}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with psycopg.connect(bouncer, connect_timeout=2, prepare_threshold=None) as c:
                    c.execute("SELECT 1")
                break
            except psycopg.Error:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = work / "pgbouncer.log"
                    raise SystemExit(
                        "pgbouncer did not start: "
                        + (log.read_text()[-600:] if log.exists() else "")
                    ) from None
                time.sleep(0.1)
        yield bouncer
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- cells


def claim_rate(dsn: str, pooler: bool, schema: str, threads: int, seconds: float) -> float:
    """claim+release cycles/s of `threads` threads sharing one store."""
    with PostgresStore(
        dsn, schema=schema, pooler=pooler, min_size=threads, max_size=threads,
        auto_migrate=False,
    ) as store:  # fmt: skip
        ids = [r.id for r in store.list_resources("bench")]
        counts = [0] * threads
        start = threading.Barrier(threads + 1)
        stop = threading.Event()

        def run(i: int) -> None:
            rng = random.Random(i)
            start.wait()
            n = 0
            while not stop.is_set():
                claim = store.claim(rng.choice(ids), OWNER, 30)
                if claim is not None:
                    store.release(claim)
                n += 1
            counts[i] = n

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for t in workers:
            t.join()
        return sum(counts) / (time.perf_counter() - t0)


def watch_latency(dsn: str, pooler: bool, schema: str, mode: str, seconds: float) -> list[float]:
    """Commit-to-delivery latencies (ms) of one watcher while a writer cycles."""
    clock = time.perf_counter
    with PostgresStore(dsn, schema=schema, pooler=pooler, max_size=2, auto_migrate=False) as s:
        ids = [r.id for r in s.list_resources("watch")]
        watcher = Watcher(s, types="watch", mode=mode)
        seen: dict[tuple[str, int], float] = {}

        def consume() -> None:
            with contextlib.suppress(WatchClosedError):
                for event in watcher:
                    seen[(event.resource_id, event.revision)] = clock()

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        time.sleep(0.3)  # let the hub connect and settle before writing
        acked: dict[tuple[str, int], float] = {}
        rng = random.Random(7)
        end = clock() + seconds
        while clock() < end:
            claim = s.claim(rng.choice(ids), OWNER, 30)
            if claim is None:
                continue
            acked[(claim.resource_id, claim.revision)] = clock()
            rev = s.release(claim)
            acked[(claim.resource_id, rev)] = clock()
            time.sleep(0.005)
        time.sleep(0.5)  # the last deliveries
        watcher.close()
        reader.join(5)
    return [(seen[k] - t) * 1000 for k, t in acked.items() if k in seen]


def _q(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100)[p - 1] if len(values) > 1 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default="1,4,8")
    args = parser.parse_args(argv)
    thread_counts = [int(x) for x in args.threads.split(",")]
    info = machine_info()
    print("machine: " + "; ".join(f"{k}={v}" for k, v in info.items()))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    with throwaway_server() as direct, pgbouncer(direct, max(thread_counts) + 2) as bouncer:
        schema = "pgbouncer_bench"
        with PostgresStore(direct, schema=schema, max_size=1) as setup:
            for i in range(RESOURCES):
                setup.ensure_resource("bench", f"k{i}")
            for i in range(50):
                setup.ensure_resource("watch", f"w{i}")
            with setup.connection() as conn:
                version = conn.execute("SHOW server_version").fetchone()
        print(f"server: PostgreSQL {version[0] if version else '?'}; pgbouncer transaction mode")
        sides = {"direct": (direct, False), "pgbouncer": (bouncer, True)}

        rates: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for n in thread_counts:
                for side in order:
                    dsn, pooler = sides[side]
                    rate = claim_rate(dsn, pooler, schema, n, args.seconds)
                    rates.setdefault((side, n), []).append(rate)

        cells = [("poll", "pgbouncer"), ("poll", "direct"), ("listen", "direct")]
        lat: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = cells[r % len(cells) :] + cells[: r % len(cells)]
            for mode, side in order:
                dsn, pooler = sides[side]
                got = watch_latency(dsn, pooler, schema, mode, args.seconds)
                lat.setdefault((mode, side), []).extend(got)

    print(f"\nclaim+release cycles/s (median of {args.rounds} rounds x {args.seconds:g} s)")
    print(f"{'threads':>7} {'direct':>9} {'pgbouncer':>10} {'ratio':>6}")
    for n in thread_counts:
        d = statistics.median(rates[("direct", n)])
        b = statistics.median(rates[("pgbouncer", n)])
        print(f"{n:>7} {d:>9.0f} {b:>10.0f} {b / d:>6.2f}")

    print(f"\nwatch commit-to-delivery, ms ({args.rounds} rounds x {args.seconds:g} s pooled)")
    print(f"{'watcher':<18} {'events':>6} {'p50':>7} {'p99':>7}")
    for mode, side in cells:
        values = lat[(mode, side)]
        print(
            f"{mode + ' ' + side:<18} {len(values):>6}"
            f" {_q(values, 50):>7.2f} {_q(values, 99):>7.2f}"
        )
    base = lat[("poll", "direct")]
    viab = lat[("poll", "pgbouncer")]
    print(
        f"ratio poll pgbouncer/direct: p50 {_q(viab, 50) / _q(base, 50):.2f},"
        f" p99 {_q(viab, 99) / _q(base, 99):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
