"""Server cost of the lease functions: the current set against the set before 0010.

Two schemas on one server, in one run: `before` gets the ordered migrations up
to 0009 only (function bodies as they were before the trust work: no pinned
search_path, no SECURITY DEFINER, no input checks, no fence), `current` the
full migration (every function from sql/functions). pgbench runs the same
claim+release script on each, interleaved over rounds, at each client count;
the ratio current/before is the price of the trust checks on the server.

    .venv/bin/python bench/function_cost.py [--dsn DSN] [--seconds 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import find_pgbench, machine_info, throwaway_server

from pglease.migration_files import load_migrations
from pglease.migrations import migrate

RESOURCES = 10_000
BEFORE_TRUST = 9  # the last migration before sql/functions existed


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in ("before", "current"):
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.execute("CREATE SCHEMA before")
        for m in load_migrations():
            if m.version <= BEFORE_TRUST:
                conn.execute(m.render("before").encode())
        migrate(conn, "current")
        for schema in ("before", "current"):
            conn.execute(
                f"SELECT {schema}.ensure_resource('bench', 'k' || lpad(g::text, 6, '0'))"
                " FROM generate_series(1, %s) g",
                [RESOURCES],
            )
            conn.execute(f"VACUUM ANALYZE {schema}.leases")
            conn.execute(f"VACUUM ANALYZE {schema}.resources")


def script(schema: str) -> str:
    # The resource id is computed from a random number the same way
    # ensure_resource does, so both schemas see identical ids.
    rid = (
        "'bench-' || left(encode(sha256(convert_to('bench', 'UTF8') || '\\x00'::bytea"
        " || convert_to('k' || lpad(:k::text, 6, '0'), 'UTF8')), 'hex'), 40)"
    )
    claim = (
        f"SELECT claimed, generation FROM {schema}.claim({rid}, 'bench', 'pgbench', :tok,"
        " 30::float8, NULL::bigint, NULL::timestamptz)"
    )
    release = (
        f"SELECT revision FROM {schema}.release({rid}, 'bench', 'pgbench', :generation::bigint,"
        " :tok, NULL::bigint, NULL::timestamptz)"
    )
    return f"\\set k random(1, {RESOURCES})\n{claim} \\gset\n\\if :claimed\n{release}\n\\endif\n"


def run(pgbench: str, dsn: str, schema: str, clients: int, seconds: int) -> float:
    token = "\\x" + hashlib.sha256(b"pgbench").hexdigest()
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
        f.write(script(schema))
        f.flush()
        cmd = [
            pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
            "-T", str(seconds), "-D", f"tok={token}", "-f", f.name, dsn,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", proc.stdout)
    if proc.returncode != 0 or not tps:
        raise SystemExit(f"pgbench failed:\n{proc.stdout}\n{proc.stderr}")
    return float(tps[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="use this server instead of a throwaway embedded one")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="1,4,8")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    pgbench = find_pgbench()

    def measure(dsn: str) -> None:
        setup(dsn)
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        print(f"server {version[0] if version else '?'}; {machine_info()}")
        print(f"{'clients':>7} {'before tps':>12} {'current tps':>12} {'ratio':>7}")
        for n in clients:
            before: list[float] = []
            current: list[float] = []
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                before.append(run(pgbench, dsn, "before", n, args.seconds))
                current.append(run(pgbench, dsn, "current", n, args.seconds))
            b, c = statistics.median(before), statistics.median(current)
            print(f"{n:>7} {b:>12.0f} {c:>12.0f} {c / b:>7.2f}", flush=True)

    if args.dsn:
        measure(args.dsn)
    else:
        with throwaway_server() as dsn:
            measure(dsn)


if __name__ == "__main__":
    main()
