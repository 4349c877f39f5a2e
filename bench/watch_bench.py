"""Watchers: what they cost the writers, and how fast they deliver.

Throughput: ``pgbench -c 8 -j 8 -M prepared`` runs the store's own claim +
release SQL on random resources while a separate process holds 0, 1, 10 or
100 watchers (sync `Watcher` threads, or `AsyncWatcher` tasks on one loop; one
hub, one LISTEN connection) that consume every event. Each configuration runs
right before or after a fresh 0-watcher run (alternating), and the figure is
the median over rounds of those paired ratios: the shared test host's speed
drifts too much for ratios of separate medians. For context the same pgbench
also runs with `_bump` swapped for a variant that never notifies and one that
notifies on every operation (0 watchers), and optionally (``--nice``) with
the watcher process at a low CPU priority, which separates what the database
pays for watchers from the CPU the Python consumers need on a 2-core host.

``--isolate`` models the production layout, where watchers run on other
hosts than the database: the server's processes and pgbench are pinned to
every CPU but the last, the watcher process to the last one (Linux CPU
affinity; a local server only). The watcher process's own CPU then no longer
competes with the database, and the ratio is what watchers cost the writers
through the database: the hub's reads, its LISTEN and the writers' NOTIFYs.
The hub's server process stays on the database's CPUs, as it would.

Besides throughput, every run records CPU time per event: the server's (its
postmaster, live processes and exited backends, from /proc; a local server
only), pgbench's, and the watcher process's. Their paired ratios, "CPU cost
ratios", are what the throughput ratio would be on a host whose CPUs are the
only bottleneck: the database side alone (server + pgbench: watchers on other
hosts) and everything on one host. CPU time does not accrue while the VM is
descheduled, so these ratios are far steadier than tps on a shared host.

Latency: a writer process does claim + release cycles (a few hundred events/s)
while 1 or 100 watchers in another process receive them. "p50/p99" is the
watcher's receive time minus the moment the writer's call returned (the
commit was acknowledged); "from send" counts from just before the writer sent
the statement, so it also includes the writer's own round trip and commit.
CLOCK_MONOTONIC is system-wide, so the two processes' clocks agree.

Run ``python bench/watch_bench.py`` (a throwaway embedded server) or
``--dsn ...``; ``--help`` for options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _server import find_pgbench, machine_info, throwaway_server

from pglease import AsyncPostgresStore, Owner, PostgresStore
from pglease.postgres._queries import Queries
from pglease.watch import AsyncWatcher, WatchClosedError, Watcher

PGBENCH_ID_BASE = 10**18
#: The resource id of pgbench's random number :rid (TYPE-<40 hex digits>, as the SQL checks).
#: A token hash the SQL accepts (32 bytes, as a sha256 is).
PGBENCH_TOKEN = "\\x" + hashlib.sha256(b"pgbench").hexdigest()
PGBENCH_RID = "'pgbench-' || lpad(:rid::text, 40, '0')"
#: (watchers, kind) of the latency runs.
LATENCY_CONFIGS = (
    (1, "sync"),
    (100, "sync"),
    (100, "sync-batch"),
    (1, "async"),
    (100, "async"),
    (100, "async-batch"),
)
#: Throughput runs: one event in LAG_SAMPLE (or the oldest of each
#: batch) records how long after its creation (the writer's in-transaction
#: clock_timestamp(), same host clock) it arrived: latency under saturation.
LAG_SAMPLE = 64
SCHEMA = "watch_bench"


#: A throughput configuration: (_bump variant, watchers, nice, kind).
class Run(NamedTuple):
    """One pgbench run: tps, and CPU microseconds per event (None: remote server)."""

    tps: float
    db_us: float | None
    watcher_us: float


Config = tuple[str, int, int, str]


# ----------------------------------------------------------------------------- setup


def setup(dsn: str, schema: str, resources: int) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    with PostgresStore(dsn, schema=schema, max_size=2) as store:
        ids = [store.ensure_resource("run", f"k{i}") for i in range(resources)]
        with store.connection() as conn:
            # pgbench can only draw numbers: give it resources whose ids are a
            # number padded to the 40 digits of a resource id (see PGBENCH_RID).
            conn.execute(
                f'INSERT INTO "{schema}".resources (id, type, key)'
                " SELECT 'pgbench-' || lpad((%s::bigint + g)::text, 40, '0'), 'pgbench', g::text"
                " FROM generate_series(0, %s) g",
                [PGBENCH_ID_BASE, resources - 1],
            )
            conn.execute(
                f'INSERT INTO "{schema}".leases (resource_id)'
                f" SELECT id FROM \"{schema}\".resources WHERE type = 'pgbench'"
            )
    return ids


def bump_variants(dsn: str, schema: str) -> dict[str, str]:
    """The installed `_bump` and two variants for context: never / always notify."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_get_functiondef(%s::regproc)", [f'"{schema}"._bump']
        ).fetchone()
    assert row is not None
    src = str(row[0])
    cond = re.search(r"IF (NOT v_marked\s+OR pg_try_advisory_xact_lock\(.*?) THEN", src, re.S)
    assert cond, "unexpected _bump text"
    return {
        "coalesced": src,
        "no_notify": src.replace(cond[1], "false", 1),
        "notify_every_op": src.replace(cond[1], "true", 1),
    }


def set_bump(dsn: str, definition: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(definition)


def pgbench_script(schema: str, resources: int) -> str:
    q = Queries(schema)

    def fill(text: bytes, args: list[str]) -> str:
        parts = text.decode().split("%s")
        assert len(parts) == len(args) + 1
        return "".join(p + a for p, a in zip(parts, [*args, ""], strict=True))

    claim = fill(q.claim, [PGBENCH_RID, "'host'", "'bench'", ":tok", "30", "NULL", "NULL"])
    release = fill(
        q.release, [PGBENCH_RID, "'host'", "'bench'", ":generation", ":tok", "NULL", "NULL"]
    )
    lo, hi = PGBENCH_ID_BASE, PGBENCH_ID_BASE + resources - 1
    return f"\\set rid random({lo}, {hi})\n{claim} \\gset\n\\if :claimed\n{release}\n\\endif\n"


def run_pgbench(
    dsn: str, script: str, clients: int, seconds: int, cpus: set[int] | None = None
) -> tuple[float, float]:
    """(tps, CPU seconds pgbench used)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
        f.write(script)
        f.flush()
        cmd = [
            find_pgbench(), "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
            "-T", str(seconds), "-D", f"tok={PGBENCH_TOKEN}", "-f", f.name, dsn,
        ]  # fmt: skip
        pin = None if cpus is None else lambda: os.sched_setaffinity(0, cpus)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, preexec_fn=pin)
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise SystemExit(f"pgbench failed:\n{proc.stdout}\n{proc.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return float(m[1]), after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def split_cpus() -> tuple[set[int], set[int]]:
    """(the database's CPUs, the watcher process's CPU) for ``--isolate``."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--isolate needs at least 2 CPUs")
    return set(cpus[:-1]), {cpus[-1]}


def pin_server(dsn: str, cpus: set[int]) -> int:
    """Pin the server's postmaster and every process it has started to `cpus`
    (backends forked later inherit the postmaster's affinity); return how many
    processes were pinned."""
    postmaster = postmaster_pid(dsn)
    if postmaster is None:
        raise SystemExit("--isolate needs a local server (its processes under /proc)")
    pinned = 0
    for pid, _ in _server_processes(postmaster):
        try:
            os.sched_setaffinity(pid, cpus)
            pinned += 1
        except OSError:
            continue  # gone meanwhile
    if not pinned:
        raise SystemExit("--isolate: could not pin the server's processes")
    return pinned


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (field 3 on)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def postmaster_pid(dsn: str) -> int | None:
    """The local server's postmaster, or None (remote server: no CPU figures)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        backend = conn.info.backend_pid
        try:
            return int(_stat(backend)[1])
        except OSError:
            return None


def _server_processes(postmaster: int) -> Iterator[tuple[int, list[str]]]:
    """(pid, /proc stat fields) of the postmaster and each process it started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            fields = _stat(pid)
        except OSError:
            continue  # gone meanwhile
        if pid == postmaster or int(fields[1]) == postmaster:
            yield pid, fields


def server_cpu_seconds(postmaster: int) -> float:
    """CPU the server has used: the postmaster with its exited children (each
    backend's time joins the postmaster's cutime/cstime when it is reaped)
    and its live processes."""
    ticks = 0
    for pid, fields in _server_processes(postmaster):
        if pid == postmaster:
            ticks += sum(int(f) for f in fields[11:15])
        else:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def event_count(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".events').fetchone()
    assert row is not None
    return int(row[0])


# ----------------------------------------------------------------------------- child roles


def watchers_main(
    dsn: str,
    schema: str,
    count: int,
    out: str,
    mode: str,
    nice: int,
    flavour: str,
    record: bool,
    cpus: set[int] | None,
) -> None:
    """Hold `count` watchers until stdin closes; dump what they got and the CPU used.

    With `record` every watcher keeps (resource, revision, receive time) per
    event, for the latency figures. Without it (throughput runs) a watcher does
    what a minimal real consumer does: counts events and keeps the last cursor,
    so that the CPU measured is the library's, not the benchmark's bookkeeping.
    """
    if nice:
        os.nice(nice)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    received: list[list[tuple[str, int, float]]] = [[] for _ in range(count)]
    counts = [0] * count
    lags: list[list[float]] = [[] for _ in range(count)]
    batches = flavour.endswith("batch")
    args = (dsn, schema, count, mode, received, counts, lags, batches, record)
    if flavour.startswith("async"):
        cpu, reads, server = asyncio.run(_async_watchers(*args))
    else:
        cpu, reads, server = _sync_watchers(*args)
    result = received if record else counts
    lag_ms = [x * 1000 for per_watcher in lags for x in per_watcher]
    Path(out).write_text(
        json.dumps(
            {"received": result, "cpu": cpu, "reads": reads, "server": server, "lag_ms": lag_ms}
        )
    )


def _backend_cpu_seconds(hub: Any) -> float | None:
    """CPU time of the hub connection's server process (local servers only)."""
    conn = hub._conn
    if conn is None:
        return None
    try:
        fields = _stat(conn.info.backend_pid)
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure_until_stdin_closes(hub: Any) -> tuple[float, float, float | None]:
    """(CPU cores used, hub reads per second, CPU cores of the hub's server
    process) between "ready" and stdin closing."""
    print("ready", flush=True)
    cpu0, wall0, reads0 = time.process_time(), time.monotonic(), hub.reads
    server0 = _backend_cpu_seconds(hub)
    sys.stdin.read()
    wall = time.monotonic() - wall0
    server1 = _backend_cpu_seconds(hub)
    server = None if server0 is None or server1 is None else (server1 - server0) / wall
    return (time.process_time() - cpu0) / wall, (hub.reads - reads0) / wall, server


def _sync_watchers(
    dsn: str,
    schema: str,
    count: int,
    mode: str,
    received: list[list[tuple[str, int, float]]],
    counts: list[int],
    lags: list[list[float]],
    batches: bool,
    record: bool,
) -> tuple[float, float, float | None]:
    clock = time.perf_counter
    cursors = [""] * count  # where each consumer would resume
    store = PostgresStore(dsn, schema=schema, max_size=4, auto_migrate=False)
    watchers = [Watcher(store, mode=mode) for _ in range(count)]

    def consume(i: int) -> None:
        sink = received[i]
        lag = lags[i]
        w = watchers[i]
        n = 0
        last = ""
        if batches:
            with contextlib.suppress(WatchClosedError):
                while batch := w.get_batch():
                    if record:
                        now = clock()
                        sink.extend((e.resource_id, e.revision, now) for e in batch)
                    else:
                        lag.append(time.time() - batch[0].created_at.timestamp())
                    n += len(batch)
                    last = batch[-1].cursor
        elif record:
            for event in w:
                sink.append((event.resource_id, event.revision, clock()))
        else:
            for event in w:
                n += 1
                last = event.cursor
                if not n % LAG_SAMPLE:
                    lag.append(time.time() - event.created_at.timestamp())
        counts[i] = n or len(sink)
        cursors[i] = last

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    measured = _measure_until_stdin_closes(watchers[0]._hub)
    for w in watchers:
        w.close()
    for t in threads:
        t.join(5)
    return measured


async def _async_watchers(
    dsn: str,
    schema: str,
    count: int,
    mode: str,
    received: list[list[tuple[str, int, float]]],
    counts: list[int],
    lags: list[list[float]],
    batches: bool,
    record: bool,
) -> tuple[float, float, float | None]:
    clock = time.perf_counter
    cursors = [""] * count  # where each consumer would resume
    async with AsyncPostgresStore(dsn, schema=schema, max_size=4, auto_migrate=False) as store:
        watchers = [await AsyncWatcher(store, mode=mode).start() for _ in range(count)]

        async def consume(i: int) -> None:
            sink = received[i]
            lag = lags[i]
            w = watchers[i]
            n = 0
            last = ""
            if batches:
                with contextlib.suppress(WatchClosedError):
                    while batch := await w.get_batch():
                        if record:
                            now = clock()
                            sink.extend((e.resource_id, e.revision, now) for e in batch)
                        else:
                            lag.append(time.time() - batch[0].created_at.timestamp())
                        n += len(batch)
                        last = batch[-1].cursor
            elif record:
                async for event in w:
                    sink.append((event.resource_id, event.revision, clock()))
            else:
                async for event in w:
                    n += 1
                    last = event.cursor
                    if not n % LAG_SAMPLE:
                        lag.append(time.time() - event.created_at.timestamp())
            counts[i] = n or len(sink)
            cursors[i] = last

        tasks = [asyncio.create_task(consume(i)) for i in range(count)]
        await asyncio.sleep(0.5)
        measured = await asyncio.to_thread(_measure_until_stdin_closes, watchers[0]._hub)
        for w in watchers:
            await w.aclose()
        await asyncio.wait(tasks, timeout=5)
    return measured


def writer_main(dsn: str, schema: str, seconds: float, out: str) -> None:
    """claim + release cycles; record when each event's statement was sent and acked."""
    store = PostgresStore(dsn, schema=schema, max_size=2, auto_migrate=False)
    ids = [r.id for r in store.list_resources("run")]
    owner = Owner("host", "writer")
    sent: dict[str, tuple[float, float]] = {}
    rng = random.Random(1)
    clock = time.perf_counter
    end = clock() + seconds
    while clock() < end:
        rid = rng.choice(ids)
        t0 = clock()
        claim = store.claim(rid, owner, 30)
        t1 = clock()
        if claim is None:
            continue
        sent[f"{rid} {claim.revision}"] = (t0, t1)
        t0 = clock()
        rev = store.release(claim)
        sent[f"{rid} {rev}"] = (t0, clock())
        time.sleep(0.005)
    Path(out).write_text(json.dumps(sent))


def spawn_watchers(
    dsn: str,
    schema: str,
    count: int,
    out: str,
    mode: str,
    nice: int = 0,
    flavour: str = "sync",
    record: bool = False,
    cpus: set[int] | None = None,
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "_watchers",
            dsn,
            schema,
            str(count),
            out,
            mode,
            str(nice),
            flavour,
            "record" if record else "count",
            ",".join(map(str, sorted(cpus))) if cpus else "-",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit("watcher process failed to start")
    return proc


def stop_watchers(proc: subprocess.Popen[str], out: str) -> dict[str, Any]:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(60)
    data: dict[str, Any] = json.loads(Path(out).read_text())
    os.unlink(out)
    return data


# ----------------------------------------------------------------------------- measurements


def throughput(
    dsn: str, schema: str, args: argparse.Namespace, script: str
) -> list[dict[str, Any]]:
    variants = bump_variants(dsn, schema)
    # (bump variant, watchers, nice of the watcher process, sync or async watchers)
    configs: list[Config] = [("coalesced", n, 0, "sync") for n in args.watchers]
    for extra in args.extra:
        n, _, kind = extra.partition(":")
        configs.append(("coalesced", int(n), 0, kind))
    if args.nice:
        configs += [("coalesced", n, args.nice, "sync") for n in args.watchers if n]
    if not args.skip_variants:
        configs += [("no_notify", 0, 0, "sync"), ("notify_every_op", 0, 0, "sync")]
    tps: dict[Config, list[float]] = {c: [] for c in configs}
    ratios: dict[Config, list[float]] = {c: [] for c in configs}
    delivered: dict[Config, list[float]] = {c: [] for c in configs}
    cpu: dict[Config, list[float]] = {c: [] for c in configs}
    reads: dict[Config, list[float]] = {c: [] for c in configs}
    lag_ms: dict[Config, list[float]] = {c: [] for c in configs}
    server_cpu: dict[Config, list[float]] = {c: [] for c in configs}
    db_cpu_us: dict[Config, list[float]] = {c: [] for c in configs}
    cost_db: dict[Config, list[float]] = {c: [] for c in configs}
    cost_all: dict[Config, list[float]] = {c: [] for c in configs}
    baseline: Config = ("coalesced", 0, 0, "sync")
    db_cpus: set[int] | None = None
    watcher_cpus: set[int] | None = None
    if args.isolate:
        db_cpus, watcher_cpus = split_cpus()
        pinned = pin_server(dsn, db_cpus)
        print(
            f"  isolated: {pinned} server processes and pgbench on CPUs {sorted(db_cpus)},"
            f" watchers on {sorted(watcher_cpus)}",
            flush=True,
        )

    postmaster = postmaster_pid(dsn)

    def measure(config: Config) -> Run:
        variant, n, nice, flavour = config
        set_bump(dsn, variants[variant])
        proc = None
        out = tempfile.mktemp(suffix=".json")
        if n:
            proc = spawn_watchers(dsn, schema, n, out, args.mode, nice, flavour, cpus=watcher_cpus)
        before = event_count(dsn, schema)
        server0 = server_cpu_seconds(postmaster) if postmaster else 0.0
        value, pgbench_cpu = run_pgbench(dsn, script, args.clients, args.seconds, db_cpus)
        server1 = server_cpu_seconds(postmaster) if postmaster else 0.0
        after = event_count(dsn, schema)
        events = max(1, after - before)
        watcher_cpu = 0.0
        if proc is not None:
            got = stop_watchers(proc, out)
            cpu[config].append(got["cpu"])
            # Delivered by the time pgbench ended (a lagging consumer shows < 1).
            delivered[config].append(min(got["received"]) / max(1, after - before))
            reads[config].append(got["reads"])
            if got["server"] is not None:
                server_cpu[config].append(got["server"])
            lag_ms[config].extend(got["lag_ms"])
            # Cores over the measured span, which pgbench's run lies within.
            watcher_cpu = got["cpu"] * args.seconds
        tps[config].append(value)
        db_us = (server1 - server0 + pgbench_cpu) / events * 1e6 if postmaster else None
        if db_us is not None:
            db_cpu_us[config].append(db_us)
        return Run(value, db_us, watcher_cpu / events * 1e6)

    try:
        _paired_rounds(args, configs, baseline, measure, ratios, cost_db, cost_all)
    finally:
        set_bump(dsn, variants["coalesced"])
        if db_cpus is not None:
            # Leave a server we were given (--dsn) as we found it.
            pin_server(dsn, set(os.sched_getaffinity(0)))
    rows = []
    for config in configs:
        variant, n, nice, flavour = config
        rows.append(
            {
                "bump": variant,
                "watchers": n,
                "flavour": flavour if n else "-",
                "nice": nice,
                "tps_median": statistics.median(tps[config]),
                "tps_all": tps[config],
                "ratio": statistics.median(ratios[config]) if ratios[config] else 1.0,
                "ratios": ratios[config],
                "delivered": min(delivered[config]) if delivered[config] else None,
                "watcher_cpu": statistics.median(cpu[config]) if cpu[config] else None,
                "hub_reads_per_s": statistics.median(reads[config]) if reads[config] else None,
                "hub_backend_cpu": (
                    statistics.median(server_cpu[config]) if server_cpu[config] else None
                ),
                "lag_p50_ms": _quantile(lag_ms[config], 49),
                "lag_p99_ms": _quantile(lag_ms[config], 98),
                "db_cpu_us_per_event": _median(db_cpu_us[config]),
                "cost_ratio_db": _median(cost_db[config]),
                "cost_ratio_all": _median(cost_all[config]),
            }
        )
    return rows


def _paired_rounds(
    args: argparse.Namespace,
    configs: list[Config],
    baseline: Config,
    measure: Callable[[Config], Run],
    ratios: dict[Config, list[float]],
    cost_db: dict[Config, list[float]],
    cost_all: dict[Config, list[float]],
) -> None:
    # The host is shared and its speed drifts by 2x within minutes, so every
    # configuration is measured right next to a fresh 0-watcher baseline (order
    # alternating) and compared with it: the ratio is the median of those pairs.
    for rnd in range(args.rounds):
        order = [c for c in configs if c != baseline]
        if rnd % 2:
            order.reverse()
        for config in order:
            first, second = (baseline, config) if rnd % 2 == 0 else (config, baseline)
            a, b = measure(first), measure(second)
            base, run = (a, b) if first == baseline else (b, a)
            ratios[config].append(run.tps / base.tps)
            costs = ""
            if base.db_us is not None and run.db_us is not None:
                cost_db[config].append(base.db_us / run.db_us)
                cost_all[config].append(base.db_us / (run.db_us + run.watcher_us))
                costs = (
                    f"  CPU/event {run.db_us:.0f}+{run.watcher_us:.0f} us"
                    f" (baseline {base.db_us:.0f})"
                    f"  cost ratios {cost_db[config][-1]:.2f} / {cost_all[config][-1]:.2f}"
                )
            variant, n, nice, flavour = config
            print(
                f"  round {rnd + 1}: {variant:16s} watchers={n:3d} {flavour:11s} nice={nice:2d}"
                f"  {run.tps:8.0f} tps  baseline {base.tps:8.0f}"
                f"  ratio {run.tps / base.tps:.2f}{costs}",
                flush=True,
            )


def thread_handoff_floor(threads: int, rounds: int = 200) -> dict[str, float]:
    """What waking `threads` blocked Python threads costs, with no pglease code.

    Each thread blocks on its own lock and, once woken, releases the next
    one's: the fastest a batch can reach every one of them while the GIL
    lets one run at a time. Returns the p50/p99 over rounds and threads of
    the delay from the first release until each thread ran, in ms.
    """
    locks = [threading.Lock() for _ in range(threads + 1)]
    for lock in locks:
        lock.acquire()
    woke = [0.0] * threads
    stop = False
    clock = time.perf_counter

    def run(i: int) -> None:
        while True:
            locks[i].acquire()
            woke[i] = clock()
            locks[i + 1].release()
            if stop:
                return

    pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    delays: list[float] = []
    steps: list[float] = []
    for _ in range(rounds):
        start = clock()
        locks[0].release()
        locks[threads].acquire()
        delays.extend((w - start) * 1000 for w in woke)
        steps.append((woke[-1] - start) / threads * 1e6)
        time.sleep(0.003)
    stop = True
    locks[0].release()
    for t in pool:
        t.join(5)
    q = statistics.quantiles(delays, n=100)
    return {"p50_ms": q[49], "p99_ms": q[98], "step_us": statistics.median(steps)}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _quantile(values: list[float], index: int) -> float | None:
    return statistics.quantiles(values, n=100)[index] if len(values) >= 2 else None


def latency(
    dsn: str, schema: str, count: int, seconds: float, mode: str, flavour: str
) -> dict[str, Any]:
    out = tempfile.mktemp(suffix=".json")
    wout = tempfile.mktemp(suffix=".json")
    proc = spawn_watchers(dsn, schema, count, out, mode, 0, flavour, record=True)
    subprocess.run(
        [sys.executable, __file__, "_writer", dsn, schema, str(seconds), wout], check=True
    )
    time.sleep(0.5)
    got = stop_watchers(proc, out)
    sent: dict[str, list[float]] = json.loads(Path(wout).read_text())
    os.unlink(wout)
    from_ack, from_send = [], []
    missing = 0
    for per_watcher in got["received"]:
        seen = {f"{rid} {rev}": t for rid, rev, t in per_watcher}
        for key, (t_send, t_ack) in sent.items():
            if key in seen:
                from_ack.append((seen[key] - t_ack) * 1000)
                from_send.append((seen[key] - t_send) * 1000)
            else:
                missing += 1
    qa = statistics.quantiles(from_ack, n=100)
    qs = statistics.quantiles(from_send, n=100)
    return {
        "watchers": count,
        "flavour": flavour,
        "events": len(sent),
        "deliveries": len(from_ack),
        "missing": missing,
        "p50_ms": qa[49],
        "p99_ms": qa[98],
        "max_ms": max(from_ack),
        "p50_from_send_ms": qs[49],
        "p99_from_send_ms": qs[98],
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_watchers":
        cpus = None if argv[9] == "-" else {int(c) for c in argv[9].split(",")}
        watchers_main(
            argv[1], argv[2], int(argv[3]), argv[4], argv[5], int(argv[6]), argv[7],
            argv[8] == "record", cpus,
        )  # fmt: skip
        return 0
    if argv and argv[0] == "_writer":
        writer_main(argv[1], argv[2], float(argv[3]), argv[4])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dsn", help="existing server (default: a throwaway embedded one)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=int, default=10, help="per pgbench run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--resources", type=int, default=1000)
    p.add_argument(
        "--watchers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 10, 100]
    )
    p.add_argument(
        "--extra",
        type=lambda s: [x for x in s.split(",") if x],
        default=["10:async", "100:async", "100:sync-batch", "100:async-batch"],
        help="more N:KIND rows; KIND is sync, async, sync-batch or async-batch"
        " (batch: the consumer calls get_batch())",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="also run each watcher count with the watcher process at this nice level",
    )
    p.add_argument("--latency-seconds", type=float, default=10.0)
    p.add_argument("--mode", choices=["listen", "poll"], default="listen")
    p.add_argument("--skip-variants", action="store_true", help="skip the no/every-op NOTIFY rows")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="throughput runs: server and pgbench on all CPUs but the last, watchers on the last"
        " (watchers on other hosts than the database, as in production)",
    )
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)

    def run(dsn: str) -> dict[str, Any]:
        setup(dsn, SCHEMA, args.resources)
        with psycopg.connect(dsn) as conn:
            version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        print(f"server {version}; machine {machine_info()}", flush=True)
        result: dict[str, Any] = {"server_version": version, "args": vars(args)}
        if not args.skip_throughput:
            print(f"throughput: pgbench -c {args.clients}, {args.seconds}s runs", flush=True)
            script = pgbench_script(SCHEMA, args.resources)
            result["throughput"] = throughput(dsn, SCHEMA, args, script)
        result["latency"] = []
        for n, flavour in () if args.skip_latency else LATENCY_CONFIGS:
            print(f"latency with {n} {flavour} watcher(s)...", flush=True)
            result["latency"].append(
                latency(dsn, SCHEMA, n, args.latency_seconds, args.mode, flavour)
            )
        if not args.skip_latency:
            result["handoff_floor"] = thread_handoff_floor(100)
        return result

    if args.dsn:
        result = run(args.dsn)
    else:
        with throwaway_server() as dsn:
            result = run(dsn)
    print()
    if "throughput" in result:
        print(
            "| _bump | watchers | kind | watcher nice | tps (median) | vs adjacent 0-watcher run"
            " | delivered by end | watcher CPU (process + hub's server backend), cores"
            " | hub reads/s | lag p50 / p99 ms | server+pgbench CPU us/event"
            " | CPU cost ratio: database side / all on one host |"
        )
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in result["throughput"]:
            d = "-" if r["delivered"] is None else f"{r['delivered']:.3f}"
            c = "-" if r["watcher_cpu"] is None else f"{r['watcher_cpu']:.2f}"
            if r["hub_backend_cpu"] is not None:
                c += f" + {r['hub_backend_cpu']:.2f}"
            h = "-" if r["hub_reads_per_s"] is None else f"{r['hub_reads_per_s']:.0f}"
            lag = (
                "-" if r["lag_p50_ms"] is None else f"{r['lag_p50_ms']:.1f} / {r['lag_p99_ms']:.1f}"
            )
            db = _fmt(r["db_cpu_us_per_event"], ".0f")
            costs = f"{_fmt(r['cost_ratio_db'], '.2f')} / {_fmt(r['cost_ratio_all'], '.2f')}"
            print(
                f"| {r['bump']} | {r['watchers']} | {r['flavour']} | {r['nice']}"
                f" | {r['tps_median']:.0f}"
                f" | {r['ratio']:.2f}x | {d} | {c} | {h} | {lag} | {db} | {costs} |"
            )
    print()
    print(
        "| watchers | kind | events | deliveries | missing | p50 ms | p99 ms | max ms"
        " | p50 from send | p99 from send |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["latency"]:
        print(
            f"| {r['watchers']} | {r['flavour']} | {r['events']} | {r['deliveries']}"
            f" | {r['missing']} |"
            f" {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f} |"
            f" {r['p50_from_send_ms']:.2f} | {r['p99_from_send_ms']:.2f} |"
        )
    if "handoff_floor" in result:
        f = result["handoff_floor"]
        print(
            f"\nfloor for 100 sync watchers (no pglease code): 100 threads handing a lock"
            f" on, one after another, reach the k-th thread after p50 {f['p50_ms']:.2f} ms,"
            f" p99 {f['p99_ms']:.2f} ms ({f['step_us']:.1f} us a hand-off)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
