"""Server CPU and WAL per reaped lease: `reap_next` walking N expired leases,
one lease per transaction, as the reaper does.

Each round claims N leases with a 1 ms TTL in each schema side (this tree's
`pglease`, and any `--variant NAME=SQLDIR`, e.g. an exported older sql/),
lets them expire, then one backend calls reap_next from '' until it returns
no candidate, committing after each call; the backend's CPU time (/proc) and
the WAL written, over the leases reaped. Sides interleaved ABBA, median.

    .venv/bin/python bench/reap_cost.py [--leases 2000] [--rounds 6]
        [--variant base=/tmp/base/sql]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import machine_info, throwaway_server
from server_cost import backend_cpu, load

from pglease.migrations import load_functions, load_migrations, migrate

RESOURCES = 10_000


def setup(conn: psycopg.Connection[tuple[object, ...]], variants: dict[str, Path]) -> list[str]:
    conn.execute("DROP SCHEMA IF EXISTS pglease CASCADE")
    migrate(conn, "pglease")
    for name, directory in variants.items():
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        conn.execute(f"CREATE SCHEMA {name}")
        for m in load_migrations(directory):
            conn.execute(m.render(name).encode())
        for statement in load_functions(directory).render(name):
            conn.execute(statement.encode())
    sides = ["pglease", *variants]
    conn.execute("DROP SCHEMA IF EXISTS bench_loop CASCADE")
    conn.execute("CREATE SCHEMA bench_loop")
    for side in sides:
        conn.execute(
            f"SELECT {side}.ensure_resource('bench', 'k' || lpad(g::text, 6, '0'))"
            " FROM generate_series(1, %s) g",
            [RESOURCES],
        )
        conn.execute(f"VACUUM ANALYZE {side}.leases")
        conn.execute(
            f"CREATE PROCEDURE bench_loop.reap_{side}(INOUT n integer)"
            " LANGUAGE plpgsql AS $$ DECLARE a text := ''; r record; BEGIN n := 0; LOOP"
            f" SELECT * INTO r FROM {side}.reap_next(a); EXIT WHEN r.lease_resource IS NULL;"
            " a := r.lease_resource; IF r.reaped THEN n := n + 1; END IF; COMMIT;"
            " END LOOP; END $$"
        )
    return sides


def one(
    conn: psycopg.Connection[tuple[object, ...]], side: str, leases: int
) -> tuple[float, float]:
    token = hashlib.sha256(b"reap").digest()
    conn.execute(
        f"SELECT {side}.claim(l.resource_id, 'bench', 'reap', %s, 0.001::float8,"
        " NULL::bigint, NULL::timestamptz)"
        f" FROM (SELECT resource_id FROM {side}.leases ORDER BY resource_id LIMIT %s) l",
        [token, leases],
    )
    time.sleep(0.05)
    lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    start = str(lsn[0]) if lsn else "0/0"
    before = backend_cpu(conn)
    row = conn.execute(f"CALL bench_loop.reap_{side}(0)".encode()).fetchone()
    cpu = backend_cpu(conn) - before
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start]).fetchone()
    reaped = int(str(row[0])) if row else 0
    if reaped < leases:
        raise SystemExit(f"{side}: reaped {reaped} of {leases}")
    return 1e6 * cpu / reaped, float(str(wal[0])) / reaped if wal else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=SQLDIR")
    args = parser.parse_args()
    variants = {}
    for spec in args.variant:
        name, _, directory = spec.partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == "pglease" or not directory:
            raise SystemExit(f"--variant {spec!r}: expected NAME=SQLDIR")
        variants[name] = Path(directory)
    with throwaway_server() as dsn, psycopg.connect(dsn, autocommit=True) as conn:
        sides = setup(conn, variants)
        print(f"{machine_info()}; load {load()}")
        cpu: dict[str, list[float]] = {s: [] for s in sides}
        wal: dict[str, list[float]] = {s: [] for s in sides}
        for i in range(args.rounds):
            for side in sides if i % 2 == 0 else reversed(sides):
                c, w = one(conn, side, args.leases)
                cpu[side].append(c)
                wal[side].append(w)
        print(f"per reaped lease, {args.leases} leases x {args.rounds} rounds (load now {load()}):")
        for side in sides:
            spread = ",".join(f"{x:.0f}" for x in cpu[side])
            print(f"  {side:<10} {statistics.median(cpu[side]):7.1f} us CPU"
                  f" {statistics.median(wal[side]):7.0f} B WAL  ({spread})")  # fmt: skip


if __name__ == "__main__":
    main()
