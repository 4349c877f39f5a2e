"""Peers benchmark: pglease next to other lock and lease libraries, on servers started here.

Every peer runs as its own process (a worker script in ``bench/peers_workers/``), one at
a time, against a server this script started: raw psycopg, pglease's `PostgresStore`
and `AsyncPostgresStore`, dislock (its public `LeaseLock`, and its SQL on a persistent
connection), OpenStack tooz's PostgreSQL driver (all on one throwaway embedded
PostgreSQL), python-redis-lock on a Debian ``redis-server`` (no persistence), and etcd
from Debian (``etcd``, one member, fsync on) through the aetcd asyncio client.

A cycle is a try-claim (acquire without waiting) of a random key out of ``--keys``
(10,000), plus its release when granted; the hot cell sends every claim to one key.
Third-party peers get their own virtual environment under ``--venvs``
(``/var/tmp/pglease-peers/<name>``), made on first use and reused. Each cell runs raw
psycopg first and last, so drift on the shared host shows as their ratio.

Run ``python bench/peers.py --help``; the default takes about 10 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import machine_info, throwaway_server

from pglease import PostgresStore

WORKERS = Path(__file__).resolve().parent / "peers_workers"
RAW = "raw psycopg"
OURS = "pglease sync"


@dataclass(frozen=True)
class Peer:
    """One contender: which worker runs it, in which venv, against which server."""

    name: str
    worker: str
    server: str  # "pg", "redis" or "etcd"
    venv: str | None = None  # None: this interpreter (the project's own venv)
    packages: tuple[str, ...] = ()
    mode: str = ""
    note: str = ""


PEERS: list[Peer] = [
    Peer(OURS, "w_pglease.py", "pg"),
    Peer("pglease async", "w_pglease.py", "pg", mode="async"),
    Peer("dislock LeaseLock", "w_dislock.py", "pg", "dislock", ("dislock", "psycopg[binary]")),
    Peer("dislock SQL", "w_dislock.py", "pg", "dislock", ("dislock", "psycopg[binary]"), "sql"),
    Peer("tooz postgresql", "w_tooz.py", "pg", "tooz", ("tooz", "psycopg2-binary")),
    Peer("python-redis-lock", "w_redis.py", "redis", "redislock", ("python-redis-lock", "redis")),
    Peer("etcd txn (aetcd)", "w_etcd.py", "etcd", "aetcd", ("aetcd",), "txn"),
    Peer("etcd session (aetcd)", "w_etcd.py", "etcd", "aetcd", ("aetcd",), "session"),
]
RAW_PEER = Peer(RAW, "w_raw.py", "pg")


@dataclass
class Cell:
    threads: int
    hot: bool

    @property
    def label(self) -> str:
        return f"hot key, {self.threads}" if self.hot else f"uniform, {self.threads}"


@dataclass
class Result:
    peer: str
    cell: str
    round: int
    position: str = ""  # "first" / "last" for the two raw runs
    figures: dict[str, Any] = field(default_factory=dict)
    failure: str = ""

    @property
    def rate(self) -> float:
        f = self.figures
        return f["cycles"] / f["seconds"] if f and f.get("seconds") else 0.0

    @property
    def cpu_us(self) -> float:
        f = self.figures
        return f["cpu"] / f["cycles"] * 1e6 if f and f.get("cycles") else float("nan")


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Any, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        time.sleep(0.1)
    raise SystemExit(f"{what} did not come up within {limit:.0f} s")


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process; on exit stop it (SIGTERM, then SIGKILL) and reap it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)


@contextlib.contextmanager
def redis_server(base: Path) -> Iterator[str]:
    """A Debian redis-server on a unix socket, persistence off (no RDB, no AOF)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not on PATH (Debian: apt-get install redis-server)")
    sock = base / "redis.sock"
    argv = [
        exe,
        "--port",
        "0",
        "--unixsocket",
        str(sock),
        "--unixsocketperm",
        "700",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(base),
        "--daemonize",
        "no",
    ]

    def ping() -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(str(sock))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    with process(argv, base / "redis.log"):
        wait_until(ping, "redis-server")
        yield str(sock)


@contextlib.contextmanager
def etcd_server(base: Path) -> Iterator[str]:
    """A Debian etcd, one member on loopback, default durability (fsync on every commit)."""
    exe = shutil.which("etcd")
    if exe is None:
        raise FileNotFoundError("etcd not on PATH (Debian: apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    curl, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    argv = [
        exe,
        "--name",
        "peers",
        "--data-dir",
        str(base / "etcd"),
        "--listen-client-urls",
        curl,
        "--advertise-client-urls",
        curl,
        "--listen-peer-urls",
        purl,
        "--initial-advertise-peer-urls",
        purl,
        "--initial-cluster",
        f"peers={purl}",
        "--initial-cluster-state",
        "new",
        # Txn cycles make revisions fast; compaction keeps the database small.
        "--auto-compaction-mode",
        "revision",
        "--auto-compaction-retention",
        "10000",
        "--logger",
        "zap",
        "--log-level",
        "warn",
    ]

    def healthy() -> bool:
        with urllib.request.urlopen(f"{curl}/health", timeout=2) as r:
            return b"true" in r.read()

    with process(argv, base / "etcd.log"):
        wait_until(healthy, "etcd")
        yield f"127.0.0.1:{client}"


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


# --------------------------------------------------------------------------- venvs


def ensure_venv(root: Path, peer: Peer) -> Path:
    """The peer's own venv (made and filled on first use; reused while its packages match)."""
    if peer.venv is None:
        return Path(sys.executable)
    where = root / peer.venv
    python = where / "bin" / "python"
    stamp = where / "peers-packages.txt"
    wanted = "\n".join(peer.packages)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    subprocess.run(
        [sys.executable, "-m", "venv", "--clear", str(where)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *peer.packages],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"pip exited {done.returncode}"])[-1]
        raise RuntimeError(f"pip install {' '.join(peer.packages)} failed: {last}")
    stamp.write_text(wanted)
    return python


# --------------------------------------------------------------------------- postgres


def setup_pg(dsn: str, keys: int) -> None:
    """Fresh schemas for raw psycopg, dislock and pglease (migrated by the store)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in ("peers_raw", "peers_dislock", "peers_pglease"):
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.execute("CREATE SCHEMA peers_raw")
        conn.execute(
            "CREATE TABLE peers_raw.lease (key text PRIMARY KEY, holder text,"
            " expires_at timestamptz, gen bigint NOT NULL DEFAULT 0)"
        )
        conn.execute(
            "INSERT INTO peers_raw.lease (key) SELECT 'k' || g FROM generate_series(0, %s) g",
            [keys - 1],
        )
        # dislock ships no DDL: this is the table its queries address.
        conn.execute("CREATE SCHEMA peers_dislock")
        conn.execute(
            "CREATE TABLE peers_dislock.key_value (key text PRIMARY KEY, value text NOT NULL,"
            " expire_at timestamptz NOT NULL)"
        )
    with PostgresStore(dsn, schema="peers_pglease", min_size=1, max_size=1) as store:
        store.ensure_resource("bench", "k0")


def refusal_wal(dsn: str, refusals: int = 200) -> dict[str, float]:
    """WAL bytes one refused claim writes, raw UPDATE vs pglease, on a lease held by another.

    A refusal that writes WAL has an xid, so its commit waits for a flush: that is
    what the hot-key cell measures.
    """
    from pglease import Owner

    out: dict[str, float] = {}
    with (
        PostgresStore(dsn, schema="peers_pglease", min_size=1, max_size=1) as store,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        rid = store.ensure_resource("bench", "k0")
        held = store.claim(rid, Owner("bench", "holder"), 600.0)
        conn.execute(
            "UPDATE peers_raw.lease SET holder = 'holder', expires_at = now() + interval '600 s'"
            " WHERE key = 'k0'"
        )
        raw_claim = (
            "UPDATE peers_raw.lease SET holder = 'other', expires_at = now() + interval '30 s',"
            " gen = gen + 1 WHERE key = 'k0' AND (holder IS NULL OR expires_at <= now())"
            " RETURNING gen"
        )

        def refuse_raw() -> bool:
            return conn.execute(raw_claim).fetchone() is None

        def refuse_ours() -> bool:
            return store.claim(rid, Owner("bench", "other"), 30.0) is None

        for name, refuse in ((RAW, refuse_raw), (OURS, refuse_ours)):
            lsn0 = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]  # type: ignore[index]
            if not all(refuse() for _ in range(refusals)):
                raise SystemExit(f"refusal_wal: {name} claimed a held lease")
            moved = conn.execute(
                "SELECT pg_current_wal_insert_lsn() - %s::pg_lsn", [str(lsn0)]
            ).fetchone()[0]  # type: ignore[index]
            out[name] = float(moved) / refusals
        if held is not None:
            store.release(held)
        conn.execute("UPDATE peers_raw.lease SET holder = NULL, expires_at = NULL WHERE key = 'k0'")
    return out


def tidy_pg(dsn: str) -> None:
    """Between runs: free leftover raw holders, vacuum the hot tables, checkpoint."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE peers_raw.lease SET holder = NULL, expires_at = NULL WHERE holder IS NOT NULL"
        )
        conn.execute(
            "VACUUM (ANALYZE) peers_raw.lease, peers_dislock.key_value,"
            " peers_pglease.leases, peers_pglease.resources"
        )
        conn.execute("CHECKPOINT")


def pg_facts(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        facts = {"version": str(conn.execute("SELECT version()").fetchone()[0])}  # type: ignore[index]
        for name in ("fsync", "synchronous_commit", "shared_buffers", "max_connections"):
            facts[name] = str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
    return facts


def tooz_url(dsn: str) -> str:
    """tooz wants ``postgresql://user@host/db``, with a socket directory as the host option."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    host, port = str(info.get("host", "")), str(info.get("port", "5432"))
    return (
        f"postgresql://{info.get('user', 'postgres')}@localhost/{info.get('dbname', 'postgres')}"
        f"?host={host}&port={port}"
    )


# --------------------------------------------------------------------------- running


def run_worker(
    python: Path, peer: Peer, target: str, cell: Cell, args: argparse.Namespace
) -> dict[str, Any]:
    argv = [
        str(python),
        str(WORKERS / peer.worker),
        "--target",
        target,
        "--threads",
        str(cell.threads),
        "--seconds",
        str(args.seconds),
        "--warmup",
        str(args.warmup),
        "--keys",
        str(args.keys),
    ]
    if cell.hot:
        argv.append("--hot")
    if peer.mode:
        argv += ["--mode", peer.mode]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    limit = args.seconds + args.warmup + 180
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"worker still running after {limit:.0f} s (killed)") from exc
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise RuntimeError(f"worker exited {done.returncode}: {tail}")
    return dict(json.loads(lines[-1]))


def targets_for(peer: Peer, dsn: str, redis: str | None, etcd: str | None) -> str | None:
    if peer.server == "redis":
        return redis
    if peer.server == "etcd":
        return etcd
    return tooz_url(dsn) if peer.worker == "w_tooz.py" else dsn


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def report(results: list[Result], cells: list[Cell], rounds: int) -> str:
    lines: list[str] = []
    for r in range(1, rounds + 1):
        lines.append(f"\n### run {r}\n")
        lines.append(
            "| cell | peer | cycles/s | x raw | x ours | p99 ms | client CPU us/cycle"
            " | refused | errors |"
        )
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for cell in cells:
            rows = [x for x in results if x.round == r and x.cell == cell.label]
            raws = [x.rate for x in rows if x.peer == RAW and not x.failure]
            raw = sum(raws) / len(raws) if raws else 0.0
            ours = next((x.rate for x in rows if x.peer == OURS and not x.failure), 0.0)
            for x in rows:
                name = f"{x.peer} ({x.position})" if x.position else x.peer
                if x.failure:
                    lines.append(f"| {cell.label} | {name} | failed: {x.failure} | | | | | | |")
                    continue
                f = x.figures
                cols = [
                    cell.label,
                    name,
                    f"{x.rate:,.0f}",
                    fmt(x.rate / raw if raw else None, ".2f"),
                    fmt(x.rate / ours if ours else None, ".2f"),
                    fmt(f.get("p99_ms"), ".2f"),
                    fmt(x.cpu_us, ",.0f"),
                    f"{f.get('refused', 0):,}",
                    f"{f.get('errors', 0):,}",
                ]
                lines.append("| " + " | ".join(cols) + " |")
            if len(raws) == 2 and raws[0]:
                lines.append(
                    f"| {cell.label} | drift (raw last / first) | {raws[1] / raws[0]:.2f}"
                    " | | | | | | |"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,4,8", help="uniform-key cells (comma list)")
    p.add_argument(
        "--hot-threads", type=int, default=8, help="threads in the hot-key cell; 0 skips"
    )
    p.add_argument("--seconds", type=float, default=4.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--keys", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=2, help="full passes over every cell")
    p.add_argument("--only", default="", help="comma list of peer names to keep (raw always runs)")
    p.add_argument("--venvs", default="/var/tmp/pglease-peers", help="where peer venvs live")
    p.add_argument("--json", default="", help="also write every figure to this file")
    args = p.parse_args()

    # SIGTERM unwinds like Ctrl-C, so every server and temp dir below is cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cells = [Cell(int(n), False) for n in args.threads.split(",") if n]
    if args.hot_threads > 0:
        cells.append(Cell(args.hot_threads, True))
    keep = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = keep - {x.name for x in PEERS}
    if unknown:
        raise SystemExit(
            f"--only: unknown peer(s) {sorted(unknown)}; known: {[x.name for x in PEERS]}"
        )
    peers = [x for x in PEERS if not keep or x.name in keep]

    started = datetime.now(UTC)
    print(
        f"# peers bench, {started:%Y-%m-%d %H:%M} UTC, load average at start: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    for k, v in machine_info().items():
        print(f"- {k}: {v}")
    print(
        f"- disk under {tempfile.gettempdir()}: "
        + tool_version(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", tempfile.gettempdir()])
    )

    root = Path(args.venvs)
    root.mkdir(parents=True, exist_ok=True)
    pythons: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for peer in [RAW_PEER, *peers]:
        try:
            pythons[peer.name] = ensure_venv(root, peer)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            skipped[peer.name] = f"venv: {exc}"

    results: list[Result] = []
    versions: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pglease-peers-")))
        dsn = stack.enter_context(throwaway_server())
        servers: dict[str, str | None] = {"redis": None, "etcd": None}
        for name, start in (("redis", redis_server), ("etcd", etcd_server)):
            if not any(x.server == name for x in peers):
                continue
            d = base / name
            d.mkdir()
            try:
                servers[name] = stack.enter_context(start(d))
            except (OSError, SystemExit) as exc:
                for x in peers:
                    if x.server == name:
                        skipped[x.name] = f"{name} server: {exc}"
        setup_pg(dsn, args.keys)
        wal = refusal_wal(dsn)
        print(
            "- WAL bytes per refused claim (200 on a held lease): "
            + ", ".join(f"{k} {v:.0f}" for k, v in wal.items())
        )
        print(
            "- postgresql: "
            + ", ".join(f"{k} {v}" for k, v in pg_facts(dsn).items())
            + " (unix socket)"
        )
        if servers["redis"]:
            print(
                "- redis: "
                + tool_version(["redis-server", "--version"])
                + " (unix socket; --save '' --appendonly no: nothing is persisted)"
            )
        if servers["etcd"]:
            print(
                "- etcd: "
                + tool_version(["etcd", "--version"])
                + " (one member, loopback TCP, fsync on: the default)"
            )
        for name, why in skipped.items():
            print(f"- skipped {name}: {why}")

        for rnd in range(1, args.rounds + 1):
            for cell in cells:
                order = [(RAW_PEER, "first"), *((x, "") for x in peers), (RAW_PEER, "last")]
                for peer, position in order:
                    if peer.name in skipped:
                        continue
                    res = Result(peer.name, cell.label, rnd, position)
                    target = targets_for(peer, dsn, servers["redis"], servers["etcd"])
                    if peer.server == "pg":
                        tidy_pg(dsn)
                    try:
                        assert target is not None
                        res.figures = run_worker(pythons[peer.name], peer, target, cell, args)
                        versions.setdefault(peer.name, res.figures.get("versions", {}))
                    except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
                        res.failure = str(exc)[:200]
                    results.append(res)
                    tag = res.failure or f"{res.rate:,.0f}/s"
                    print(
                        f"  run {rnd} {cell.label:>12} {peer.name:<22} {position:<5} {tag}",
                        flush=True,
                    )

    print("\n## versions")
    for peer_name, vers in versions.items():
        print(f"- {peer_name}: " + ", ".join(f"{k} {val}" for k, val in vers.items()))
    print(f"- python: {platform.python_version()} for every venv")
    print(report(results, cells, args.rounds))
    errs = {x.peer: x.figures.get("error_messages") for x in results if x.figures.get("errors")}
    for name, msgs in errs.items():
        print(f"- {name} errors, first messages: {msgs}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))


if __name__ == "__main__":
    main()
