"""Batch heartbeat and reaper cost as the lease table grows.

For each table size M (default 1k, 100k, 1M lease rows) one schema is filled
with M resources, of which min(M, --beat) are held; then, with stale
statistics (never analysed) and fresh ones (after ANALYZE):

- ``beat``: the server time of one `heartbeat` call for all held leases
  (EXPLAIN ANALYZE's execution time, so the client and the network are out),
  median of --repeat calls, as a prepared statement as the keeper sends it;
- ``beat, 1 busy``: the same while another transaction holds one of those
  rows (the beat reports it busy through its second, rarer step);
- ``reap idle``: the server time of one `reap_next('')` pass when nothing is
  expired (what an idle reaper costs every half second).

    .venv/bin/python bench/heartbeat_scale.py [--dsn DSN] [--sizes 1000,100000,1000000]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import machine_info, throwaway_server

from pglease.migrations import migrate

SCHEMA = "pglease_hbscale"
TOKEN = hashlib.sha256(b"bench").digest()
BEAT = (
    "SELECT resource_id, status, expires_at, current_generation FROM {s}.heartbeat("
    "%s::text[], %s::bigint[], %s::bytea[], %s::text[], %s::text[], %s::float8[])"
)


def fill(conn: psycopg.Connection[Any], rows: int, held: int) -> list[str]:
    conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    migrate(conn, SCHEMA)
    conn.execute(
        f"INSERT INTO {SCHEMA}.resources (id, type, key)"
        " SELECT 'job-' || lpad(to_hex(g), 40, '0'), 'job', g::text FROM generate_series(1, %s) g",
        [rows],
    )
    conn.execute(f"INSERT INTO {SCHEMA}.leases (resource_id) SELECT id FROM {SCHEMA}.resources")
    # Held leases spread over the table (every k-th id), not one dense range.
    step = max(1, rows // held)
    ids = [f"job-{g:040x}" for g in range(1, rows + 1, step)][:held]
    conn.execute(
        f"UPDATE {SCHEMA}.leases SET generation = 1, owner_type = 'host', owner_id = 'h',"
        " token_sha256 = %s, acquired_at = clock_timestamp(), heartbeat_at = clock_timestamp(),"
        " expires_at = clock_timestamp() + interval '1 hour' WHERE resource_id = ANY (%s)",
        [TOKEN, ids],
    )
    return ids


def server_ms(conn: psycopg.Connection[Any], query: str, args: list[Any] | None) -> float:
    plan = conn.execute("EXPLAIN (ANALYZE, TIMING OFF) " + query, args).fetchall()
    found = [re.search(r"Execution Time: ([0-9.]+) ms", r[0]) for r in plan]
    return next(float(m[1]) for m in found if m)


def measure(
    conn: psycopg.Connection[Any], dsn: str, ids: list[str], repeat: int
) -> tuple[float, float, float]:
    n = len(ids)
    args = [ids, [1] * n, [TOKEN] * n, ["host"] * n, ["h"] * n, [30.0] * n]
    beat = BEAT.format(s=SCHEMA)
    rows = conn.execute(beat, args).fetchall()
    assert len(rows) == n and {r[1] for r in rows} == {"renewed"}, "every lease must renew"
    beats = [server_ms(conn, beat, args) for _ in range(repeat)]
    with psycopg.connect(dsn) as locker:
        locker.execute(
            f"SELECT 1 FROM {SCHEMA}.leases WHERE resource_id = %s FOR UPDATE", [ids[n // 2]]
        )
        busy = [server_ms(conn, beat, args) for _ in range(repeat)]
        locker.rollback()
    reap = f"SELECT * FROM {SCHEMA}.reap_next('')"
    reaps = [server_ms(conn, reap, None) for _ in range(repeat)]
    return statistics.median(beats), statistics.median(busy), statistics.median(reaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="use this server instead of a throwaway embedded one")
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--beat", type=int, default=10_000, help="leases per beat")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    def run(dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            print(f"server {version[0] if version else '?'}; {machine_info()}")
            print(
                f"{'rows':>9} {'leases':>7} {'stats':>6} {'beat ms':>9} {'1 busy ms':>10}"
                f" {'reap idle ms':>13}"
            )
            for size in (int(x) for x in args.sizes.split(",")):
                started = time.monotonic()
                ids = fill(conn, size, min(size, args.beat))
                for stats in ("stale", "fresh"):
                    if stats == "fresh":
                        conn.execute(f"ANALYZE {SCHEMA}.leases")
                        conn.execute(f"ANALYZE {SCHEMA}.resources")
                    beat, busy, reap = measure(conn, dsn, ids, args.repeat)
                    print(
                        f"{size:>9} {len(ids):>7} {stats:>6} {beat:>9.1f} {busy:>10.1f}"
                        f" {reap:>13.2f}",
                        flush=True,
                    )
                print(f"# filled and measured in {time.monotonic() - started:.0f} s", flush=True)
            conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")

    if args.dsn:
        run(args.dsn)
    else:
        with throwaway_server() as dsn:
            run(dsn)


if __name__ == "__main__":
    main()
