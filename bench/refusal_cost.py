"""Server cost of a refused claim: a claim of a lease someone else holds.

On a hot key most claims are refused, so a refusal must stay cheap: no lock,
no transaction id, nothing to flush. This measures the server CPU of one
refused claim in one backend (no client or network in the loop), for the raw
lease update (a guarded UPDATE that matches nothing), pglease's functions and
any `--variant` (e.g. the functions of an older commit), interleaved ABBA,
median of the rounds. The same throwaway server and schemas as
`server_cost.py`; every lease is held by another owner for an hour first.

With `--hot SECONDS`, also pgbench at `--clients` (8) on one held lease (the
hot key), every call a refused claim, ABBA rounds of SECONDS each: tps and
server CPU per call of each side.

    .venv/bin/python bench/refusal_cost.py [--calls 4000] [--rounds 4]
        [--variant base=/tmp/base-tree/sql] [--hot 4 --clients 8]
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

import server_cost
from _server import find_pgbench, machine_info, throwaway_server
from server_cost import (
    RESOURCES,
    RID,
    SCHEMA,
    SCRIPTS,
    TOKEN,
    backend_cpu,
    load,
    postmaster_pid,
    server_cpu,
    setup,
)


def hold_everything(dsn: str, schemas: list[str]) -> None:
    """Every lease held by `holder` (raw: an unexpired holder) for an hour."""
    token = hashlib.sha256(b"holder").digest()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(
                f"SELECT {schema}.claim(resource_id, 'bench', 'holder', %s, 3600, NULL, NULL)"
                f" FROM {schema}.leases",
                [token],
            )
        conn.execute(
            "UPDATE raw.leases SET holder = 'holder', token = %s, generation = generation + 1,"
            " expires_at = clock_timestamp() + interval '1 hour'",
            [token],
        )
        conn.execute("VACUUM ANALYZE raw.leases")
        for schema in schemas:
            conn.execute(f"VACUUM ANALYZE {schema}.leases")


def _procedure(side: str) -> str:
    """n claims of random keys, each its own transaction; all are refused."""
    rid = RID.replace(":k", "k")
    if side == "raw":
        claim = (
            "UPDATE raw.leases SET holder = 'pgbench', token = tok, generation = generation + 1,"
            " expires_at = clock_timestamp() + interval '30 s'"
            f" WHERE id = {rid} AND (expires_at IS NULL OR expires_at <= clock_timestamp())"
            " RETURNING generation INTO g"
        )
    else:
        schema = SCHEMA if side == "ours" else side
        claim = (
            f"SELECT c.generation INTO g FROM {schema}.claim({rid}, 'bench', 'pgbench', tok,"
            " 30::float8, NULL::bigint, NULL::timestamptz) c WHERE c.claimed"
        )
    return (
        f"CREATE OR REPLACE PROCEDURE refusal_loop.{side}(n integer, tok bytea)"
        " LANGUAGE plpgsql AS $$ DECLARE k integer; g bigint; BEGIN"
        f" FOR i IN 1..n LOOP k := 1 + floor(random() * {RESOURCES})::integer; g := NULL;"
        f" {claim}; COMMIT; IF g IS NOT NULL THEN RAISE 'claim % was granted', k; END IF;"
        " END LOOP; END $$"
    )


def measure(dsn: str, calls: int, rounds: int) -> None:
    sides = list(SCRIPTS)
    token = hashlib.sha256(b"pgbench").digest()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS refusal_loop CASCADE")
        conn.execute("CREATE SCHEMA refusal_loop")
        for side in sides:
            conn.execute(_procedure(side).encode())
        per: dict[str, list[float]] = {side: [] for side in sides}
        wal: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(rounds):
            for side in sides if i % 2 == 0 else reversed(sides):
                lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
                assert lsn is not None
                before = backend_cpu(conn)
                conn.execute(f"CALL refusal_loop.{side}(%s, %s)".encode(), [calls, token])
                per[side].append(1e6 * (backend_cpu(conn) - before) / calls)
                row = conn.execute(
                    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [lsn[0]]
                ).fetchone()
                assert row is not None
                wal[side].append(float(row[0]) / calls)
    raw = statistics.median(per["raw"])
    print(f"server CPU per refused claim, one backend, {calls} calls x {rounds} rounds:")
    for side in sides:
        med = statistics.median(per[side])
        spread = ",".join(f"{x:.0f}" for x in per[side])
        print(
            f"  {side:<10} {med:7.1f} us  raw/this {raw / med:5.2f}"
            f"  WAL {statistics.median(wal[side]):5.1f} B/call  ({spread})"
        )


def _hot_script(side: str) -> str:
    """One refused claim of key 1 (held by another owner)."""
    rid = RID.replace(":k", "1")
    if side == "raw":
        return (
            "UPDATE raw.leases SET holder = 'pgbench', token = :tok, generation = generation + 1,"
            " expires_at = clock_timestamp() + interval '30 s'"
            f" WHERE id = {rid} AND (expires_at IS NULL OR expires_at <= clock_timestamp())\n"
        )
    schema = SCHEMA if side == "ours" else side
    return (
        f"SELECT claimed FROM {schema}.claim({rid}, 'bench', 'pgbench', :tok, 30::float8,"
        " NULL::bigint, NULL::timestamptz)\n"
    )


def hot(dsn: str, clients: int, seconds: int, rounds: int) -> None:
    """pgbench of refused claims on one hot key, sides interleaved ABBA."""
    pgbench = find_pgbench()
    sides = list(SCRIPTS)
    tps: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    postmaster = postmaster_pid(dsn)
    for i in range(rounds):
        for side in sides if i % 2 == 0 else reversed(sides):
            with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
                f.write(_hot_script(side))
                f.flush()
                cmd = [
                    pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
                    "-T", str(seconds), "-D", f"tok={TOKEN}", "-f", f.name, dsn,
                ]  # fmt: skip
                before, idle = server_cpu(postmaster)
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                used = server_cpu(postmaster, idle)[0] - before
            found = re.search(r"tps = ([0-9.]+) \(without initial", proc.stdout)
            done = re.search(r"actually processed: (\d+)", proc.stdout)
            if proc.returncode != 0 or not found or not done:
                raise SystemExit(f"pgbench failed ({side}):\n{proc.stdout}\n{proc.stderr}")
            tps[side].append(float(found[1]))
            cpu[side].append(1e6 * used / max(int(done[1]), 1))
    raw = statistics.median(tps["raw"])
    print(f"hot key, {clients} clients, every claim refused, {rounds} rounds of {seconds} s:")
    for side in sides:
        med = statistics.median(tps[side])
        spread = ",".join(f"{x:.0f}" for x in tps[side])
        print(
            f"  {side:<10} {med:9.0f} tps  this/raw {med / raw:5.2f}"
            f"  server CPU {statistics.median(cpu[side]):6.1f} us/call  ({spread})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SQLDIR",
        help="also run the functions of another sql/ directory in schema NAME",
    )
    parser.add_argument("--hot", type=int, metavar="SECONDS", help="also pgbench the hot key")
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    variants = {}
    for spec in args.variant:
        name, _, directory = spec.partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in SCRIPTS or not directory:
            raise SystemExit(f"--variant {spec!r}: expected NAME=SQLDIR, NAME a new identifier")
        variants[name] = Path(directory)
    with throwaway_server() as dsn:
        setup(dsn, variants)
        hold_everything(dsn, [SCHEMA, *variants])
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        print(f"server {version[0] if version else '?'}; {machine_info()}; load {load()}")
        measure(dsn, args.calls, args.rounds)
        if args.hot:
            hot(dsn, args.clients, args.hot, args.rounds)
        print(f"load at the end {load()}")


if __name__ == "__main__":
    assert server_cost.SCRIPTS is SCRIPTS
    main()
