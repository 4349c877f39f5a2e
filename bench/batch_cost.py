"""Batches of 10 leases against raw's single claim+release cycle, per lease.

One throwaway server, one run, the setup of bench/server_cost.py (the schema
`pglease` fully migrated, `raw.leases` on the same 10,000 ids). pgbench runs
three scripts, each statement its own transaction (autocommit), on random keys:

  raw     UPDATE raw.leases ... (claim), then UPDATE ... (release): one cycle
  ours    SELECT pglease.claim(...), then SELECT pglease.release(...): one cycle
  batch   SELECT ... FROM pglease.claim_many(10 ids), then
          SELECT ... FROM pglease.release_many(the ones claimed): up to 10 cycles

The figure is leases per second (claim+release cycles that granted), counted
on the server as the rise of the generations over the run (a claim raises its
lease's generation by one; raw's table the same), so a batch item that found
its lease held counts for nothing. "batch/raw" is the target's ratio (at
least 1.5 at 8 clients, issue 24). Rounds are interleaved (ABBA) at each
client count, so other load on the machine hits every side alike; the median
per side is printed with each round's ratio and the load average at the start
and the end.

`--floor` adds a fourth side, `floor`: the same script on set-based batch
functions (bench/batch_floor.sql, one statement for all items; see its
header for what it leaves out), to show what the per-item design leaves on
the table.

`--previous REV` adds a side `prev`: the batch functions of
sql/functions/15_batch.sql as it was at git revision REV (e.g. the per-item
design, 2bb17d0), installed as claim_many_prev / release_many_prev next to
the current ones, so both designs run in the same rounds.

`--cpu CYCLES` instead measures server CPU per lease in one backend, no client
or network in the loop (as `server_cost.py --cpu`): each side in a procedure
that commits after every statement, the backend's own CPU time from /proc.

    .venv/bin/python bench/batch_cost.py [--seconds 5] [--rounds 3] [--clients 1,8]
    .venv/bin/python bench/batch_cost.py --floor --clients 8
    .venv/bin/python bench/batch_cost.py --previous 2bb17d0 [--cpu 2000]
    .venv/bin/python bench/batch_cost.py --cpu 2000 [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import find_pgbench, machine_info, throwaway_server
from server_cost import (
    RAW,
    RESOURCES,
    SCHEMA,
    TOKEN,
    _loop_procedure,
    backend_cpu,
    load,
    ours,
    setup,
)

BATCH = 10
#: The batch's keys: :k, :k + STRIDE, ... (distinct, spread over the table).
STRIDE = RESOURCES // BATCH


def _rid(key: str) -> str:
    """The resource id of key number `key` (an SQL expression), as ensure_resource makes it."""
    return (
        "'bench-' || left(encode(sha256(convert_to('bench', 'UTF8') || '\\x00'::bytea"
        f" || convert_to('k' || lpad(({key})::text, 6, '0'), 'UTF8')), 'hex'), 40)"
    )


def batch(schema: str) -> str:
    """claim_many of 10 keys, then release_many of those it got."""
    return "\n".join([
        f"\\set k random(1, {STRIDE})",
        f"WITH a AS (SELECT array_agg({_rid(f':k + {STRIDE} * i')} ORDER BY i) AS rids"
        f" FROM generate_series(0, {BATCH - 1}) i),"
        f" c AS (SELECT x.claimed, x.generation, a.rids[x.ord] AS rid FROM a,"
        f" {schema}.claim_many(a.rids, 'bench', 'pgbench',"
        f" array_fill(:tok::bytea, ARRAY[{BATCH}]), 30::float8, NULL::timestamptz) x)"
        " SELECT count(*) FILTER (WHERE claimed) AS n,"
        " array_agg(rid) FILTER (WHERE claimed) AS rids,"
        " array_agg(generation) FILTER (WHERE claimed) AS gens FROM c \\gset",
        "\\if :n",
        f"SELECT count(*) FROM {schema}.release_many(:rids::text[],"
        " array_fill('bench'::text, ARRAY[:n::int]), array_fill('pgbench'::text, ARRAY[:n::int]),"
        " :gens::bigint[], array_fill(:tok::bytea, ARRAY[:n::int]), NULL::timestamptz)",
        "\\endif",
        "",
    ])  # fmt: skip


SCRIPTS = {"raw": RAW, "batch": batch(SCHEMA), "ours": ours(SCHEMA)}
#: Where each side's leases are: the sum of their generations rises by one per grant.
GENERATIONS = {
    "raw": "SELECT sum(generation) FROM raw.leases",
    "batch": f"SELECT sum(generation) FROM {SCHEMA}.leases",
    "ours": f"SELECT sum(generation) FROM {SCHEMA}.leases",
}


FLOOR_SQL = Path(__file__).resolve().parent / "batch_floor.sql"


def add_floor(dsn: str) -> None:
    """The `floor` side: bench/batch_floor.sql's functions in the bench schema."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(FLOOR_SQL.read_text(encoding="utf-8").replace("@schema@", SCHEMA).encode())
    SCRIPTS["floor"] = (
        batch(SCHEMA)
        .replace(".claim_many(", ".claim_many_floor(")
        .replace(".release_many(", ".release_many_floor(")
    )
    GENERATIONS["floor"] = GENERATIONS["batch"]


def add_previous(dsn: str, rev: str) -> None:
    """The `prev` side: the batch functions at git revision `rev`, renamed."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(
        ["git", "show", f"{rev}:sql/functions/15_batch.sql"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for name in ("claim_many", "renew_many", "release_many"):
        text = text.replace(f"@schema@.{name}(", f"@schema@.{name}_prev(")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(text.replace("@schema@", SCHEMA).encode())
    SCRIPTS["prev"] = (
        batch(SCHEMA)
        .replace(".claim_many(", ".claim_many_prev(")
        .replace(".release_many(", ".release_many_prev(")
    )
    GENERATIONS["prev"] = GENERATIONS["batch"]


def _generations(dsn: str, side: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(GENERATIONS[side]).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def run(pgbench: str, dsn: str, side: str, clients: int, seconds: int) -> float:
    """One pgbench run of one side: leases granted (and released) per second."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
        f.write(SCRIPTS[side])
        f.flush()
        cmd = [
            pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
            "-T", str(seconds), "-D", f"tok={TOKEN}", "-f", f.name, dsn,
        ]  # fmt: skip
        before = _generations(dsn, side)
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        elapsed = time.monotonic() - started
        granted = _generations(dsn, side) - before
    failed = re.search(r"number of failed transactions: (\d+)", proc.stdout)
    if proc.returncode != 0 or (failed and int(failed[1]) > 0):
        raise SystemExit(f"pgbench failed ({side}):\n{proc.stdout}\n{proc.stderr}")
    # pgbench's own duration is -T; the connection setup before it is small
    # and alike for every side.
    return granted / min(elapsed, float(seconds))


def compare(pgbench: str, dsn: str, clients: list[int], seconds: int, rounds: int) -> None:
    sides = list(SCRIPTS)
    floor = "floor" in SCRIPTS
    prev = "prev" in SCRIPTS
    print(
        f"{'clients':>7} {'raw /s':>9} {'batch /s':>9} {'ours /s':>9} {'batch/raw':>9}"
        f" {'batch/ours':>10} {'rounds (batch/raw)':>22} {'load':>11}"
        + (f" {'floor /s':>9} {'floor/raw':>9}" if floor else "")
        + (f" {'prev /s':>9} {'prev/raw':>9} {'batch/prev':>10}" if prev else "")
    )
    for n in clients:
        at_start = load()
        runs: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(rounds):
            for side in sides if i % 2 == 0 else reversed(sides):
                runs[side].append(run(pgbench, dsn, side, n, seconds))
        med = {side: statistics.median(runs[side]) for side in sides}
        per_round = ",".join(
            f"{b / r:.2f}" for r, b in zip(runs["raw"], runs["batch"], strict=True)
        )
        print(
            f"{n:>7} {med['raw']:>9.0f} {med['batch']:>9.0f} {med['ours']:>9.0f}"
            f" {med['batch'] / med['raw']:>9.2f} {med['batch'] / med['ours']:>10.2f}"
            f" {per_round:>22} {at_start + '>' + load():>11}"
            + (f" {med['floor']:>9.0f} {med['floor'] / med['raw']:>9.2f}" if floor else "")
            + (
                f" {med['prev']:>9.0f} {med['prev'] / med['raw']:>9.2f}"
                f" {med['batch'] / med['prev']:>10.2f}"
                if prev
                else ""
            ),
            flush=True,
        )


def _batch_procedure(side: str = "batch", suffix: str = "") -> str:
    """The batch script's two statements in a procedure, a COMMIT after each."""
    return (
        f"CREATE OR REPLACE PROCEDURE bench_loop.{side}(n integer, tok bytea) LANGUAGE plpgsql"
        " AS $$ DECLARE k integer; a text[]; rr text[]; gg bigint[]; m integer; BEGIN"
        f" FOR i IN 1..n LOOP k := 1 + floor(random() * {STRIDE})::integer;"
        f" a := ARRAY(SELECT {_rid(f'k + {STRIDE} * j')} FROM generate_series(0, {BATCH - 1}) j"
        " ORDER BY j);"
        " SELECT array_agg(a[x.ord]) FILTER (WHERE x.claimed),"
        " array_agg(x.generation) FILTER (WHERE x.claimed), count(*) FILTER (WHERE x.claimed)"
        f" INTO rr, gg, m FROM {SCHEMA}.claim_many{suffix}(a, 'bench', 'pgbench',"
        f" array_fill(tok, ARRAY[{BATCH}]), 30::float8, NULL::timestamptz) x; COMMIT;"
        f" IF m > 0 THEN PERFORM count(*) FROM {SCHEMA}.release_many{suffix}(rr,"
        " array_fill('bench'::text, ARRAY[m]), array_fill('pgbench'::text, ARRAY[m]), gg,"
        " array_fill(tok, ARRAY[m]), NULL::timestamptz); END IF; COMMIT;"
        " END LOOP; END $$"
    )


def cpu_loops(dsn: str, cycles: int, rounds: int) -> None:
    """Server CPU per lease (claim+release) in one backend, sides interleaved ABBA."""
    per_call = {"raw": 1, "batch": BATCH, "ours": 1}
    if "prev" in SCRIPTS:
        per_call["prev"] = BATCH
    token = hashlib.sha256(b"pgbench").digest()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS bench_loop CASCADE")
        conn.execute("CREATE SCHEMA bench_loop")
        conn.execute(_loop_procedure("raw").encode())
        conn.execute(_loop_procedure("ours").encode())
        conn.execute(_batch_procedure().encode())
        if "prev" in per_call:
            conn.execute(_batch_procedure("prev", "_prev").encode())
        per: dict[str, list[float]] = {side: [] for side in per_call}
        for i in range(rounds):
            for side in list(per_call) if i % 2 == 0 else reversed(per_call):
                calls = max(cycles // per_call[side], 1)
                before = backend_cpu(conn)
                conn.execute(f"CALL bench_loop.{side}(%s, %s)".encode(), [calls, token])
                per[side].append(1e6 * (backend_cpu(conn) - before) / (calls * per_call[side]))
    raw = statistics.median(per["raw"])
    print(f"server CPU per lease, one backend, {cycles} leases x {rounds} rounds:")
    for side in per_call:
        med = statistics.median(per[side])
        spread = ",".join(f"{x:.0f}" for x in per[side])
        print(f"  {side:<6} {med:7.1f} us  raw/this {raw / med:5.2f}  ({spread})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--floor", action="store_true", help="also the set-based floor")
    parser.add_argument("--previous", metavar="REV", help="also the batches at git REV")
    parser.add_argument(
        "--cpu", type=int, metavar="CYCLES", help="server CPU per lease in one backend instead"
    )
    args = parser.parse_args()
    pgbench = find_pgbench()
    with throwaway_server() as dsn:
        setup(dsn, {})
        if args.floor:
            add_floor(dsn)
        if args.previous:
            add_previous(dsn, args.previous)
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        print(f"server {version[0] if version else '?'}; {machine_info()}; load {load()}")
        if args.cpu:
            cpu_loops(dsn, args.cpu, args.rounds)
            return
        print(f"batch of {BATCH}; figures are leases claimed and released per second")
        compare(pgbench, dsn, [int(c) for c in args.clients.split(",")], args.seconds, args.rounds)


if __name__ == "__main__":
    main()
