"""Claim+release throughput: pglease's Python API against pgbench running the same SQL.

For each client count N, on the same server and in the same run:

- ``python``: N threads share one sync `PostgresStore` (pool of N connections);
  each loops ``claim(random resource)`` then ``release(claim)`` if it was granted.
- ``pgbench``: ``pgbench -c N -j N -M prepared -T seconds`` on a script whose two
  statements are the store's own hot-path claim / release statements
  (``pglease.postgres._fastpath``), with ``$n`` turned into pgbench variables
  (the release takes the generation the claim returned, via ``\\gset``).
- ``asyncio``: N tasks share one `AsyncPostgresStore` (pool of N connections).
- ``bare``: N threads, one plain psycopg connection each, sending the same two
  statements with fixed arguments: what the driver alone costs, without the pool
  and without pglease's validation, token generation and result parsing.
- ``pq`` (``--pq``): N threads on psycopg's low-level libpq wrapper, and ``apq``
  (``--apq``): N tasks in one event loop on its non-blocking calls read with the
  store's own `results_async`. Both send fixed arguments: the floor each flavour
  could reach from Python.

A cycle is one claim attempt plus, when it was granted, its release; a refused
claim (the resource was held by another client) still counts as a cycle and is
also counted on its own. Run ``python bench/claim_release.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import io
import os
import pstats
import random
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import find_pgbench, machine_info, throwaway_server

from pglease import AsyncPostgresStore, Owner, PostgresStore, _common
from pglease.postgres._fastpath import CLAIM, RELEASE, FastPath
from pglease.postgres._queries import Queries

TARGET_RATIO = 0.8
RESOURCE_TYPE = "bench"
PGBENCH_TYPE = "pgbench"
#: pgbench resources get ids "pgbench-" + the 40-digit zero-padded number
#: PGBENCH_ID_BASE + i (decimal digits are hex digits, so the SQL functions'
#: id check accepts them): pgbench can only pass a
#: random *number* as a parameter, so these ids are numbers (all 19 digits long).
PGBENCH_ID_BASE = 10**18
OWNER_TYPE = "bench"
OWNER_ID = "client"


@dataclass
class Figure:
    """One measurement: cycles and refused claims over `seconds`, and the CPU it took.

    `client_cpu` is the CPU time of the client (this process's threads, or the
    pgbench child); `host_cpu` is the busy CPU time of the whole host (all
    cores) over the same window, so `host_cpu - client_cpu` is mostly PostgreSQL.
    """

    cycles: int
    refused: int
    seconds: float
    client_cpu: float = 0.0
    host_cpu: float = 0.0

    @property
    def rate(self) -> float:
        return self.cycles / self.seconds if self.seconds > 0 else 0.0

    def per_cycle_us(self, cpu_seconds: float) -> float:
        return cpu_seconds / self.cycles * 1e6 if self.cycles else float("nan")


def host_busy_seconds() -> float:
    """Busy CPU seconds of the whole host since boot (all cores), from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def total(figs: list[Figure]) -> Figure:
    return Figure(
        sum(f.cycles for f in figs),
        sum(f.refused for f in figs),
        sum(f.seconds for f in figs),
        sum(f.client_cpu for f in figs),
        sum(f.host_cpu for f in figs),
    )


# --------------------------------------------------------------------------- setup


def setup_schema(dsn: str, schema: str, resources: int) -> list[str]:
    """Migrate a fresh bench schema; create the Python and the pgbench resources.

    Returns the ids of the Python-side resources (made by `ensure_resource`).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    with PostgresStore(dsn, schema=schema, min_size=1, max_size=1) as store:
        with store.connection() as conn:
            # The same SQL function `ensure_resource()` runs, once per key, in one statement.
            rows = conn.execute(
                f'SELECT "{schema}".ensure_resource(%s, %s || g) FROM generate_series(1, %s) g',
                [RESOURCE_TYPE, "k", resources],
            ).fetchall()
            conn.execute(
                f'INSERT INTO "{schema}".resources (id, type, key)'
                " SELECT %s || '-' || lpad((%s::bigint + g)::text, 40, '0'), %s, g::text"
                " FROM generate_series(0, %s - 1) g",
                [PGBENCH_TYPE, PGBENCH_ID_BASE, PGBENCH_TYPE, resources],
            )
            conn.execute(
                f'INSERT INTO "{schema}".leases (resource_id)'
                f' SELECT id FROM "{schema}".resources WHERE type = %s',
                [PGBENCH_TYPE],
            )
        ids = [str(r[0]) for r in rows]
        # Validate once through the API, so the ids are ones the store accepts.
        claim = store.claim(ids[0], Owner(OWNER_TYPE, OWNER_ID), 30.0)
        assert claim is not None
        store.release(claim)
    return ids


def tidy(dsn: str, schema: str) -> None:
    """Between phases: drop leftover holders (none expected) and vacuum the hot rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f'UPDATE "{schema}".leases SET owner_type = NULL, owner_id = NULL,'
            " token_sha256 = NULL, expires_at = NULL WHERE owner_id IS NOT NULL"
        )
        conn.execute(f'VACUUM (ANALYZE) "{schema}".leases, "{schema}".resources')
        conn.execute("CHECKPOINT")


def server_facts(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        facts = {"version": str(conn.execute("SELECT version()").fetchone()[0])}  # type: ignore[index]
        for name in ("synchronous_commit", "fsync", "shared_buffers", "max_connections"):
            facts[name] = str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
        facts["transport"] = "unix socket" if "host=/" in dsn or "@/" in dsn else "tcp"
    return facts


# --------------------------------------------------------------------------- python


def _measure_threads(
    clients: int,
    warmup: float,
    seconds: float,
    loop: Callable[[int, list[int], threading.Event], None],
) -> Figure:
    """Run `loop(index, counters, stop)` in `clients` threads; count over the window only."""
    counters = [[0, 0] for _ in range(clients)]  # [cycles, refused], one list per thread
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            loop(i, counters[i], stop)
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    c0, r0, t0 = sum(c[0] for c in counters), sum(c[1] for c in counters), time.perf_counter()
    p0, h0 = time.process_time(), host_busy_seconds()
    time.sleep(seconds)
    c1, r1, t1 = sum(c[0] for c in counters), sum(c[1] for c in counters), time.perf_counter()
    p1, h1 = time.process_time(), host_busy_seconds()
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Figure(c1 - c0, r1 - r0, t1 - t0, p1 - p0, h1 - h0)


def run_sync(
    dsn: str, schema: str, ids: list[str], clients: int, ttl: float, warmup: float, seconds: float
) -> Figure:
    owner = Owner(OWNER_TYPE, OWNER_ID)
    n = len(ids)
    with PostgresStore(
        dsn, schema=schema, min_size=clients, max_size=clients, auto_migrate=False
    ) as store:

        def loop(i: int, counter: list[int], stop: threading.Event) -> None:
            rng = random.Random(i)
            claim, release = store.claim, store.release
            while not stop.is_set():
                c = claim(ids[rng.randrange(n)], owner, ttl)
                if c is None:
                    counter[1] += 1
                else:
                    release(c)
                counter[0] += 1

        return _measure_threads(clients, warmup, seconds, loop)


async def _measure_tasks(
    clients: int,
    warmup: float,
    seconds: float,
    loop: Callable[[int], Awaitable[None]],
    counters: list[list[int]],
    stop: asyncio.Event,
) -> Figure:
    """Run `loop(i)` as `clients` tasks; count their cycles after `warmup` for `seconds`."""
    tasks = [asyncio.create_task(loop(i)) for i in range(clients)]
    await asyncio.sleep(warmup)
    c0, r0 = sum(c[0] for c in counters), sum(c[1] for c in counters)
    t0, p0, h0 = time.perf_counter(), time.process_time(), host_busy_seconds()
    await asyncio.sleep(seconds)
    c1, r1 = sum(c[0] for c in counters), sum(c[1] for c in counters)
    t1, p1, h1 = time.perf_counter(), time.process_time(), host_busy_seconds()
    stop.set()
    await asyncio.gather(*tasks)
    return Figure(c1 - c0, r1 - r0, t1 - t0, p1 - p0, h1 - h0)


def run_async(
    dsn: str, schema: str, ids: list[str], clients: int, ttl: float, warmup: float, seconds: float
) -> Figure:
    owner = Owner(OWNER_TYPE, OWNER_ID)
    n = len(ids)

    async def main() -> Figure:
        async with AsyncPostgresStore(
            dsn, schema=schema, min_size=clients, max_size=clients, auto_migrate=False
        ) as store:
            await store.pool.wait()
            counters = [[0, 0] for _ in range(clients)]
            stop = asyncio.Event()

            async def loop(i: int) -> None:
                rng = random.Random(i)
                counter = counters[i]
                while not stop.is_set():
                    c = await store.claim(ids[rng.randrange(n)], owner, ttl)
                    if c is None:
                        counter[1] += 1
                    else:
                        await store.release(c)
                    counter[0] += 1

            return await _measure_tasks(clients, warmup, seconds, loop, counters, stop)

    return asyncio.run(main())


def run_bare(
    dsn: str, schema: str, ids: list[str], clients: int, ttl: float, warmup: float, seconds: float
) -> Figure:
    """The same two statements on plain psycopg connections: the driver's own ceiling."""
    q = Queries(schema)
    token = hashlib.sha256(b"bare").digest()
    n = len(ids)
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(clients)]
    try:

        def loop(i: int, counter: list[int], stop: threading.Event) -> None:
            rng = random.Random(i)
            conn = conns[i]
            while not stop.is_set():
                rid = ids[rng.randrange(n)]
                row = conn.execute(
                    q.claim, [rid, OWNER_TYPE, OWNER_ID, token, ttl, None, None]
                ).fetchone()
                assert row is not None
                if row[0]:
                    conn.execute(
                        q.release, [rid, OWNER_TYPE, OWNER_ID, row[1], token, None, None]
                    ).fetchone()
                else:
                    counter[1] += 1
                counter[0] += 1

        return _measure_threads(clients, warmup, seconds, loop)
    finally:
        for conn in conns:
            conn.close()


def run_pq(
    dsn: str, schema: str, ids: list[str], clients: int, ttl: float, warmup: float, seconds: float
) -> Figure:
    """The same SQL through psycopg's low-level libpq wrapper (`conn.pgconn`): no cursor,
    no adaptation, protocol-level prepared statements, text parameters. What a Python
    hot path could reach; blocking libpq calls here release the GIL."""
    q = Queries(schema)

    def prepared(text: bytes, nulls: tuple[int, ...]) -> bytes:
        # %s -> $n, and the arguments the store sends as NULL become NULL literals.
        parts, out, k = text.split(b"%s"), b"", 0
        for i, part in enumerate(parts[:-1]):
            if i in nulls:
                out += part + b"NULL"
            else:
                k += 1
                out += part + b"$%d" % k
        return out + parts[-1]

    claim_sql, release_sql = prepared(q.claim, (5, 6)), prepared(q.release, (5, 6))
    token = hashlib.sha256(b"pq").digest()
    ttl_text = repr(float(ttl)).encode()
    owner_type, owner_id = OWNER_TYPE.encode(), OWNER_ID.encode()
    bids = [i.encode() for i in ids]
    n = len(bids)
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(clients)]
    try:
        for conn in conns:
            conn.pgconn.prepare(b"bench_claim", claim_sql)
            conn.pgconn.prepare(b"bench_release", release_sql)

        def loop(i: int, counter: list[int], stop: threading.Event) -> None:
            rng = random.Random(i)
            pg = conns[i].pgconn
            while not stop.is_set():
                rid = bids[rng.randrange(n)]
                res = pg.exec_prepared(
                    b"bench_claim", [rid, owner_type, owner_id, token, ttl_text], [0, 0, 0, 1, 0]
                )
                if res.get_value(0, 0) == b"t":
                    gen = res.get_value(0, 1)
                    pg.exec_prepared(
                        b"bench_release", [rid, owner_type, owner_id, gen, token], [0, 0, 0, 0, 1]
                    )
                else:
                    counter[1] += 1
                counter[0] += 1

        return _measure_threads(clients, warmup, seconds, loop)
    finally:
        for conn in conns:
            conn.close()


def run_apq(
    dsn: str, schema: str, ids: list[str], clients: int, ttl: float, warmup: float, seconds: float
) -> Figure:
    """The asyncio floor: N tasks in one loop, one `AsyncConnection` each, the store's
    prepared statements sent with libpq's non-blocking calls and read with the
    fast path's `results_async`, fixed arguments. What one event loop reaches
    without the store's connection stack, validation, tokens and parsing."""
    from pglease.postgres._fastpath import results_async, unwatch

    fast = FastPath(schema)
    token = hashlib.sha256(b"apq").digest()
    ttl_text = repr(float(ttl)).encode()
    owner_type, owner_id = OWNER_TYPE.encode(), OWNER_ID.encode()
    bids = [i.encode() for i in ids]
    n = len(bids)

    async def main() -> Figure:
        conns = [
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(clients)
        ]
        try:
            for conn in conns:
                for name, text in fast.statements.items():
                    conn.pgconn.prepare(name, text.encode())
            counters = [[0, 0] for _ in range(clients)]
            stop = asyncio.Event()

            async def loop(i: int) -> None:
                rng = random.Random(i)
                conn, counter = conns[i], counters[i]
                pg = conn.pgconn
                while not stop.is_set():
                    rid = bids[rng.randrange(n)]
                    args = [rid, owner_type, owner_id, token, ttl_text, None, None]
                    pg.send_query_prepared(CLAIM, args, [0, 0, 0, 1, 0, 0, 0])
                    res = (await results_async(conn))[-1]
                    if res.get_value(0, 0) == b"t":
                        args = [rid, owner_type, owner_id, res.get_value(0, 1), token, None, None]
                        pg.send_query_prepared(RELEASE, args, [0, 0, 0, 0, 1, 0, 0])
                        await results_async(conn)
                    else:
                        counter[1] += 1
                    counter[0] += 1

            return await _measure_tasks(clients, warmup, seconds, loop, counters, stop)
        finally:
            for conn in conns:
                unwatch(conn)
                await conn.close()

    return asyncio.run(main())


Runner = Callable[[str, str, list[str], int, float, float, float], Figure]
RUNNERS: dict[str, Runner] = {
    "python": run_sync,
    "asyncio": run_async,
    "apq": run_apq,
    "bare": run_bare,
    "pq": run_pq,
}


# --------------------------------------------------------------------------- pgbench


def pgbench_script(schema: str, resources: int) -> str:
    """The store's own hot-path claim/release SQL with `$n` replaced by pgbench variables.

    pgbench cannot send a NULL through a variable, so the two arguments the
    store sends as NULL (expected_revision, now) are written as NULL literals.
    """
    statements = FastPath(schema).statements

    def fill(text: str, args: list[str]) -> str:
        assert f"${len(args)}" in text and f"${len(args) + 1}" not in text, (text, args)
        for k in range(len(args), 0, -1):  # $10 before $1
            text = text.replace(f"${k}", args[k - 1])
        return text

    # The id is built from the random number in SQL (one concatenation: pgbench
    # variables are numbers); everything else is the store's statement.
    rid = f"'{PGBENCH_TYPE}-' || lpad(:rid::text, 40, '0')"
    claim = fill(statements[CLAIM], [rid, ":otype", ":oid", ":tok", ":ttl", "NULL", "NULL"])
    release = fill(
        statements[RELEASE], [rid, ":otype", ":oid", ":generation", ":tok", "NULL", "NULL"]
    )
    lo, hi = PGBENCH_ID_BASE, PGBENCH_ID_BASE + resources - 1
    return f"\\set rid random({lo}, {hi})\n{claim} \\gset\n\\if :claimed\n{release}\n\\endif\n"


def _pgbench_claims(dsn: str, schema: str) -> int:
    """Successful claims ever made on pgbench resources (each raised a generation by 1)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            f'SELECT coalesce(sum(l.generation), 0) FROM "{schema}".leases l'
            f' JOIN "{schema}".resources r ON r.id = l.resource_id WHERE r.type = %s',
            [PGBENCH_TYPE],
        ).fetchone()
    assert row is not None
    return int(row[0])


def run_pgbench(
    pgbench: str, dsn: str, schema: str, resources: int, clients: int, ttl: float, seconds: int
) -> tuple[Figure, list[str]]:
    script = pgbench_script(schema, resources)
    token_literal = "\\x" + hashlib.sha256(b"pgbench").hexdigest()
    with tempfile.NamedTemporaryFile("w", suffix=".sql", prefix="claim_release_") as f:
        f.write(script)
        f.flush()
        cmd = [
            pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
            "-T", str(seconds), "-D", f"otype={OWNER_TYPE}", "-D", f"oid={OWNER_ID}",
            "-D", f"tok={token_literal}", "-D", f"ttl={ttl:g}", "-f", f.name, dsn,
        ]  # fmt: skip
        before = _pgbench_claims(dsn, schema)
        p0, h0, w0 = children_cpu_seconds(), host_busy_seconds(), time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        p1, h1, w1 = children_cpu_seconds(), host_busy_seconds(), time.perf_counter()
        after = _pgbench_claims(dsn, schema)
    if proc.returncode != 0:
        raise SystemExit(f"pgbench failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", proc.stdout)
    done = re.search(r"number of transactions actually processed: (\d+)", proc.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", proc.stdout)
    if not (tps and done):
        raise SystemExit(f"cannot parse pgbench output:\n{proc.stdout}")
    if failed and int(failed[1]):
        raise SystemExit(f"pgbench reported failed transactions:\n{proc.stdout}\n{proc.stderr}")
    cycles = int(done[1])
    # tps is cycles over the run without connection time; keep the same duration basis.
    seconds = cycles / float(tps[1])
    # The CPU was measured over the whole pgbench run (with its connection set-up):
    # scale the host's share to the measured part.
    scale = seconds / (w1 - w0) if w1 > w0 else 1.0
    fig = Figure(cycles, cycles - (after - before), seconds, p1 - p0, (h1 - h0) * scale)
    shown = [*cmd[:-3], "<script>", "<dsn>"]
    return fig, shown


# --------------------------------------------------------------------------- profile


def profile_sync(dsn: str, schema: str, ids: list[str], ttl: float, seconds: float) -> str:
    """cProfile one client's claim+release loop (main thread) and return the top entries."""
    owner = Owner(OWNER_TYPE, OWNER_ID)
    rng = random.Random(0)
    n = len(ids)
    with PostgresStore(dsn, schema=schema, min_size=1, max_size=1, auto_migrate=False) as store:
        for _ in range(200):  # warm the pool and the prepared statements
            c = store.claim(ids[rng.randrange(n)], owner, ttl)
            if c is not None:
                store.release(c)
        prof = cProfile.Profile()
        cycles = 0
        deadline = time.perf_counter() + seconds
        prof.enable()
        while time.perf_counter() < deadline:
            c = store.claim(ids[rng.randrange(n)], owner, ttl)
            if c is not None:
                store.release(c)
            cycles += 1
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"cProfile, 1 client, {cycles} cycles in {seconds:g}s (profiler overhead included)\n")
    stats.sort_stats("tottime").print_stats(25)
    return out.getvalue()


def _per_call_us(fn: Callable[[], object], rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - t0) / rounds * 1e6


def breakdown(dsn: str, schema: str, ids: list[str], ttl: float) -> list[tuple[str, float]]:
    """Single-client costs of the pieces of a cycle, in microseconds per call."""

    owner = Owner(OWNER_TYPE, OWNER_ID)
    q = Queries(schema)
    rng = random.Random(0)
    token = hashlib.sha256(b"x").digest()
    rows: list[tuple[str, float]] = []
    with PostgresStore(dsn, schema=schema, min_size=1, max_size=1, auto_migrate=False) as store:
        pool = store._pool

        def checkout() -> None:
            with pool.connection():
                pass

        rows.append(("pool checkout+return (no query)", _per_call_us(checkout, 20000)))
        rows.append(
            ("claim_args (validate, new token, sha256)",
             _per_call_us(lambda: _common.claim_op(ids[0], owner, ttl, None, None), 20000))
        )  # fmt: skip
        with pool.connection() as conn:
            one = _per_call_us(lambda: conn.execute(b"SELECT 1").fetchone(), 5000)
            rows.append(("SELECT 1 round trip (bare conn)", one))

            def bare_cycle() -> None:
                rid = ids[rng.randrange(len(ids))]
                row = conn.execute(q.claim, [rid, OWNER_TYPE, OWNER_ID, token, ttl, None, None])
                r = row.fetchone()
                assert r is not None and r[0]
                conn.execute(q.release, [rid, OWNER_TYPE, OWNER_ID, r[1], token, None, None])

            rows.append(("bare psycopg claim+release (same SQL)", _per_call_us(bare_cycle, 3000)))

        def api_cycle() -> None:
            c = store.claim(ids[rng.randrange(len(ids))], owner, ttl)
            assert c is not None
            store.release(c)

        rows.append(("store.claim + store.release", _per_call_us(api_cycle, 3000)))
    return rows


# --------------------------------------------------------------------------- main


def parse_clients(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients wants e.g. 1,4,8; got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("--clients wants positive integers")
    return values


@contextmanager
def server(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
    else:
        with throwaway_server() as d:
            yield d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="use this server instead of a throwaway embedded one")
    parser.add_argument(
        "--seconds", type=int, default=3, help="measured seconds per figure and round"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per client count")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring")
    parser.add_argument("--clients", type=parse_clients, default=[1, 4, 8])
    parser.add_argument("--resources", type=int, default=10_000, help="resources per side")
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--schema", default="pglease_bench", help="dropped and recreated")
    parser.add_argument("--no-async", action="store_true", help="skip the asyncio figure")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare psycopg figure")
    parser.add_argument(
        "--pq", action="store_true", help="add the low-level psycopg (pgconn) figure"
    )
    parser.add_argument(
        "--apq", action="store_true", help="add the low-level asyncio (pgconn) figure"
    )
    parser.add_argument(
        "--synchronous-commit",
        choices=["server", "on", "off"],
        default="server",
        help="session setting for every client (via PGOPTIONS); server: leave it alone",
    )
    parser.add_argument(
        "--profile",
        choices=["auto", "always", "never"],
        default="auto",
        help="cProfile + cost breakdown at 1 client (auto: when a ratio is below target)",
    )
    args = parser.parse_args(argv)
    if args.resources < 1 or args.seconds < 1 or args.rounds < 1:
        parser.error("--resources, --seconds and --rounds must be positive")

    if args.synchronous_commit != "server":
        # libpq reads PGOPTIONS: psycopg connections and the pgbench child alike.
        opts = os.environ.get("PGOPTIONS", "")
        os.environ["PGOPTIONS"] = f"{opts} -c synchronous_commit={args.synchronous_commit}".strip()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    started = datetime.now(UTC)
    pgbench = find_pgbench()
    print(f"# pglease claim+release bench, {started:%Y-%m-%d %H:%M UTC}")
    print(f"command: {command}")
    for k, v in machine_info().items():
        print(f"{k}: {v}")
    print(f"pgbench: {pgbench}")
    print(f"load average at start: {load_average()}")

    with server(args.dsn) as dsn:
        facts = server_facts(dsn)
        print(f"server: {facts.pop('version')}")
        print("server settings: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
        print(f"server: {'--dsn given' if args.dsn else 'throwaway embedded, same machine'}")
        ids = setup_schema(dsn, args.schema, args.resources)
        print(
            f"resources: {args.resources} per side, uniform random choice; ttl {args.ttl:g}s;"
            f" {args.rounds} interleaved rounds of {args.seconds}s per figure"
            f" (python sides: after {args.warmup:g}s warm-up)"
        )
        print(f"pgbench script:\n{pgbench_script(args.schema, args.resources)}", flush=True)

        kinds = ["python", "pgbench"]
        kinds += [] if args.no_async else ["asyncio"]
        kinds += [] if args.no_bare else ["bare"]
        kinds += ["pq"] if args.pq else []
        kinds += ["apq"] if args.apq else []
        results: list[dict[str, Any]] = []
        shown_cmd: list[str] = []
        for n in args.clients:
            row: dict[str, Any] = {"clients": n}
            per_round: dict[str, list[Figure]] = {k: [] for k in kinds}
            for r in range(args.rounds):
                # Rotate the order every round so slow drift (WAL, bloat, the host) is shared.
                for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                    tidy(dsn, args.schema)
                    if kind == "pgbench":
                        fig, shown_cmd = run_pgbench(
                            pgbench, dsn, args.schema, args.resources, n, args.ttl, args.seconds
                        )
                    else:
                        fig = RUNNERS[kind](
                            dsn, args.schema, ids, n, args.ttl, args.warmup, args.seconds
                        )
                    per_round[kind].append(fig)
            for kind, figs in per_round.items():
                row[kind] = total(figs)
            row["rounds"] = per_round
            results.append(row)
            print(
                f"  clients={n}: "
                + ", ".join(
                    f"{k} {row[k].rate:,.0f}/s (rounds "
                    + " ".join(f"{f.rate:,.0f}" for f in per_round[k])
                    + f"; {row[k].refused} refused)"
                    for k in kinds
                ),
                flush=True,
            )

        print(f"\npgbench command: {shlex.join(shown_cmd)} (-c/-j/-T per row)\n")
        print_table(results, args)
        print()
        print_cpu_table(results, kinds, len(os.sched_getaffinity(0)))
        below = [r["clients"] for r in results if ratio(r, "python") < TARGET_RATIO]
        if below:
            print(f"\nBELOW TARGET ({TARGET_RATIO}) at clients={below}")
        if args.profile == "always" or (args.profile == "auto" and below):
            print("\n## cost breakdown, 1 client, microseconds per call")
            for name, us in breakdown(dsn, args.schema, ids, args.ttl):
                print(f"  {us:9.1f} us  {name}")
            print("\n## " + profile_sync(dsn, args.schema, ids, args.ttl, 3.0))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{args.schema}" CASCADE')
    print(f"load average at end: {load_average()}")
    print(f"elapsed: {(datetime.now(UTC) - started).total_seconds():.0f}s")
    return 0


def ratio(row: dict[str, Any], key: str) -> float:
    fig = row.get(key)
    base: Figure = row["pgbench"]
    return fig.rate / base.rate if isinstance(fig, Figure) and base.rate else float("nan")


def ratio_cell(row: dict[str, Any], key: str) -> str:
    """Overall ratio, then the range of the per-round ratios (round i against round i)."""
    rounds: dict[str, list[Figure]] = row["rounds"]
    per = [a.rate / b.rate for a, b in zip(rounds[key], rounds["pgbench"], strict=True) if b.rate]
    spread = f" ({min(per):.2f}-{max(per):.2f})" if len(per) > 1 else ""
    return f"{ratio(row, key):.2f}{spread}"


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    head = ["clients", "python cycles/s", "pgbench cycles/s", f"ratio (>= {TARGET_RATIO})"]
    if not args.no_async:
        head += ["asyncio cycles/s", "asyncio ratio"]
    if not args.no_bare:
        head += ["bare psycopg cycles/s", "bare ratio"]
    if args.pq:
        head += ["pgconn cycles/s", "pgconn ratio"]
    if args.apq:
        head += ["asyncio pgconn cycles/s", "asyncio pgconn ratio"]
    head += ["refused py/pgb"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in results:
        cells = [
            str(r["clients"]),
            f"{r['python'].rate:,.0f}",
            f"{r['pgbench'].rate:,.0f}",
            ratio_cell(r, "python"),
        ]
        if not args.no_async:
            cells += [f"{r['asyncio'].rate:,.0f}", ratio_cell(r, "asyncio")]
        if not args.no_bare:
            cells += [f"{r['bare'].rate:,.0f}", ratio_cell(r, "bare")]
        if args.pq:
            cells += [f"{r['pq'].rate:,.0f}", ratio_cell(r, "pq")]
        if args.apq:
            cells += [f"{r['apq'].rate:,.0f}", ratio_cell(r, "apq")]
        cells.append(f"{r['python'].refused}/{r['pgbench'].refused}")
        print("| " + " | ".join(cells) + " |")
    print("ratio = cycles/s over pgbench cycles/s; in brackets the range over the rounds")


def print_cpu_table(results: list[dict[str, Any]], kinds: list[str], ncpu: int) -> None:
    """Where the CPU goes: the client's own CPU per cycle against the rest of the host's."""
    print(
        "| clients | client | cycles/s | client CPU us/cycle | rest of host CPU us/cycle"
        " (mostly postgres) | host busy |"
    )
    print("|---:|:---|---:|---:|---:|---:|")
    for r in results:
        for kind in kinds:
            f: Figure = r[kind]
            busy = f.host_cpu / (f.seconds * ncpu) if f.seconds else float("nan")
            print(
                f"| {r['clients']} | {kind} | {f.rate:,.0f} | {f.per_cycle_us(f.client_cpu):.0f}"
                f" | {f.per_cycle_us(f.host_cpu - f.client_cpu):.0f} | {busy:.0%} |"
            )


if __name__ == "__main__":
    raise SystemExit(main())
