"""The failover test of tests/test_failover.py, against a Patroni pair.

On this machine, with nothing but local ports and a temp dir:

1. a venv of its own with Patroni (`--venv`, reused when it already has the
   pinned version), and Debian's `etcd` (installed with apt-get when missing
   and running as root);
2. a single-member etcd, two PostgreSQL 15 nodes under Patroni with
   `synchronous_mode: true` (and `synchronous_mode_strict: true` unless
   `--no-strict`); waits for a leader and a streaming sync standby;
3. the load of tests/test_failover.py (claims, fenced writes and releases from
   threads) and a watcher, through one store on a multi-host DSN with
   `target_session_attrs=read-write`;
4. SIGKILL of the whole leader (its Patroni and every postgres process, as a
   machine dies), Patroni promotes the sync standby; the dead node is then
   started again, as a rebooted machine would be, and rejoins as the standby
   (in strict mode the new primary's commits wait until it has). With
   `--kill postgres` only the leader's postgres dies, and its Patroni
   restarts it in place;
5. the invariants of the synchronous test (no acknowledged claim or write
   lost, no generation handed out twice, the store and watcher carried on by
   themselves, the watcher's stream is the new primary's log), and a timeline.

Every process it starts and its temp dir are removed at the end, on failure
and on Ctrl-C too. Exit status 0 only when every invariant holds;
`--asynchronous` (`synchronous_mode: false`) shows them failing. Run
`.venv/bin/python bench/patroni/run.py --help` from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests/ is importable from the repository root

import psycopg  # noqa: E402

from pglease import PostgresStore  # noqa: E402
from pglease.types import Event  # noqa: E402
from tests import _pgcluster  # noqa: E402
from tests._pgcluster import PG15, SERVER_USER, Node, wait_for  # noqa: E402
from tests.test_failover import SCHEMA, Load, check_synchronous_failover, log_of  # noqa: E402

PATRONI_SPEC = "patroni[etcd3,psycopg3]==4.1.5"
SCOPE = "pglease-bench"


class CountingHandler(logging.Handler):
    """Counts the library log records by logger; prints them only with --verbose.

    The pool and the watcher log every failed connection attempt during the
    outage (dozens of multi-line records): the count is what the report needs.
    """

    def __init__(self, verbose: bool) -> None:
        super().__init__(logging.WARNING)
        self.verbose = verbose
        self.counts: dict[str, int] = {}
        #: Wall-clock times of the pool's failed connection attempts.
        self.pool_failures: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.name} {record.levelname}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if record.name.startswith("psycopg.pool") and "error connecting" in record.getMessage():
            self.pool_failures.append(record.created)
        if self.verbose:
            print(self.format(record), file=sys.stderr)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ set-up


def _as_server_user() -> list[str]:
    return ["runuser", "-u", SERVER_USER, "--"] if os.geteuid() == 0 else []


def ensure_etcd() -> str:
    """The etcd binary; apt-get installs Debian's etcd-server when it is missing."""
    found = shutil.which("etcd")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        log("etcd not found: apt-get install etcd-server")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "etcd-server"],
            env=env,
            check=True,
            capture_output=True,
        )
        # The package may start a system etcd on the default ports; ours uses others.
        found = shutil.which("etcd")
    if found is None:
        sys.exit("etcd not found (Debian: apt-get install etcd-server)")
    return found


def ensure_patroni(venv: Path, spec: str) -> Path:
    """A venv with `spec` installed; returns its `patroni` executable."""
    patroni = venv / "bin" / "patroni"
    version = spec.split("==")[-1] if "==" in spec else None
    if patroni.exists() and version is not None:
        out = subprocess.run([str(patroni), "--version"], capture_output=True, text=True)
        if out.stdout.split()[-1:] == [version]:
            return patroni
    log(f"creating {venv} with {spec}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    out = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", spec], capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"pip install {spec} failed:\n{out.stderr.strip()}")
    # Patroni runs as the server user: it must be able to read the venv.
    subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
    return patroni


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (random, as _pgcluster picks)."""
    ports: set[int] = set()
    while len(ports) < n:
        port = random.randint(20000, 60000)
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            ports.add(port)
    return sorted(ports)


def http_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


# ------------------------------------------------------------------ processes


class Proc:
    """A process started as the server user in a session of its own (killpg-able)."""

    def __init__(self, argv: list[str], logfile: Path) -> None:
        self.argv = argv
        self.logfile = logfile
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        out = open(self.logfile, "ab")  # noqa: SIM115 - the child keeps it
        self.popen = subprocess.Popen(
            [*_as_server_user(), *self.argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()

    def kill(self) -> None:
        """SIGKILL the whole process group, then reap it."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self.popen = None


class Etcd(Proc):
    def __init__(self, binary: str, base: Path, client: int, peer: int) -> None:
        self.client = client
        peer_url = f"http://127.0.0.1:{peer}"
        client_url = f"http://127.0.0.1:{client}"
        super().__init__(
            [
                binary,
                "--name",
                "bench",
                "--data-dir",
                str(base / "etcd"),
                "--listen-client-urls",
                client_url,
                "--advertise-client-urls",
                client_url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"bench={peer_url}",
                "--initial-cluster-state",
                "new",
            ],
            base / "etcd.log",
        )

    def wait_healthy(self) -> None:
        url = f"http://127.0.0.1:{self.client}/health"
        wait_for("etcd to be healthy", lambda: http_json(url).get("health") == "true", 60)


class PatroniNode(Node):
    """One Patroni member and the PostgreSQL 15 it manages.

    A `Node` of tests/_pgcluster.py (so `log_of`, `query` and `crash` work on
    it) reached over TCP on 127.0.0.1, as Patroni's replication and pg_rewind
    connections are; pg_ctl is Patroni's business, not ours.
    """

    def __init__(self, base: Path, name: str, pg_port: int, api_port: int) -> None:
        super().__init__(base, name, pg_port)
        self.api_port = api_port
        self.config = base / f"{name}.yml"
        self.patroni: Proc | None = None

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def write_config(self, settings: dict[str, Any]) -> None:
        # JSON is YAML: Patroni reads it as is, and the repo venv needs no yaml.
        self.config.write_text(json.dumps(settings, indent=2))
        os.chmod(self.config, 0o644)

    def start_patroni(self, patroni: Path) -> None:
        self.patroni = Proc([str(patroni), str(self.config)], self.log)
        self.patroni.start()

    def api(self, path: str) -> Any:
        return http_json(f"http://127.0.0.1:{self.api_port}{path}")

    def postmaster_pids(self) -> list[int]:
        """The postmaster and its children, or [] when none runs."""
        try:
            pid = self.pid()
        except (OSError, ValueError, IndexError):
            return []
        if not _pgcluster._alive(pid):
            return []
        return [pid, *_pgcluster._children(pid)]

    def kill(self) -> None:
        """SIGKILL Patroni first (it must not react), then every postgres process."""
        if self.patroni is not None:
            self.patroni.kill()
        pids = self.postmaster_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(
            f"{self.name}'s processes to die",
            lambda: not any(_pgcluster._alive(p) for p in pids),
            10,
        )

    def writable(self) -> bool:
        """Whether this server is up and out of recovery (a primary)."""
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                return row is not None and not row[0]
        except psycopg.OperationalError:
            return False


def patroni_settings(
    node: PatroniNode, etcd_port: int, args: argparse.Namespace, secrets_: dict[str, str]
) -> dict[str, Any]:
    return {
        "scope": SCOPE,
        "name": node.name,
        "log": {"level": "INFO"},
        "restapi": {
            "listen": f"127.0.0.1:{node.api_port}",
            "connect_address": f"127.0.0.1:{node.api_port}",
        },
        "etcd3": {"hosts": [f"127.0.0.1:{etcd_port}"]},
        "bootstrap": {
            "dcs": {
                "ttl": args.ttl,
                "loop_wait": args.loop_wait,
                "retry_timeout": args.retry_timeout,
                "maximum_lag_on_failover": 1048576,
                "synchronous_mode": not args.asynchronous,
                "synchronous_mode_strict": args.strict and not args.asynchronous,
                "postgresql": {
                    # The killed primary has WAL its standby never got (commits
                    # that were waiting for the standby's ack): rewind it away.
                    "use_pg_rewind": True,
                    "parameters": {
                        "synchronous_commit": "on",
                        # Only processes die here, never the OS: skip fsyncs.
                        "fsync": "off",
                        "shared_buffers": "16MB",
                        "max_connections": 40,
                        "wal_sender_timeout": "5s",
                        "wal_receiver_status_interval": "1s",
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}],
        },
        "postgresql": {
            "listen": f"127.0.0.1:{node.port}",
            "connect_address": f"127.0.0.1:{node.port}",
            "data_dir": str(node.data),
            "bin_dir": str(PG15),
            "pgpass": str(node.data.parent / f"{node.name}.pgpass"),
            # Loopback only, throwaway cluster: trust; the passwords are random anyway.
            "pg_hba": [
                "local all all trust",
                "host all all 127.0.0.1/32 trust",
                "host replication all 127.0.0.1/32 trust",
            ],
            "authentication": {
                "superuser": {"username": "postgres", "password": secrets_["superuser"]},
                "replication": {"username": "replicator", "password": secrets_["replication"]},
            },
            "parameters": {"unix_socket_directories": str(node.sock)},
            "remove_data_directory_on_rewind_failure": True,
            "remove_data_directory_on_diverged_timelines": True,
        },
        "watchdog": {"mode": "off"},
        "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
    }


# ------------------------------------------------------------------ the pair


class Pair:
    """etcd and two Patroni members in a temp dir; `close` removes them all."""

    def __init__(self, args: argparse.Namespace, etcd_bin: str, patroni: Path) -> None:
        self.args = args
        self.patroni = patroni
        self.base = Path(tempfile.mkdtemp(prefix="pglease-patroni-"))
        os.chmod(self.base, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.base, SERVER_USER)
        client, peer, pg1, pg2, api1, api2 = free_ports(6)
        self.etcd = Etcd(etcd_bin, self.base, client, peer)
        self.nodes = [
            PatroniNode(self.base, "n1", pg1, api1),
            PatroniNode(self.base, "n2", pg2, api2),
        ]
        pw = {"superuser": secrets.token_hex(12), "replication": secrets.token_hex(12)}
        for node in self.nodes:
            node.sock.mkdir()
            if os.geteuid() == 0:
                shutil.chown(node.sock, SERVER_USER)
            node.write_config(patroni_settings(node, client, args, pw))

    @property
    def dsn(self) -> str:
        """Both nodes in one libpq DSN: connect to whichever accepts writes."""
        a, b = self.nodes
        return (
            f"host=127.0.0.1,127.0.0.1 port={a.port},{b.port}"
            " user=postgres dbname=postgres target_session_attrs=read-write"
        )

    def start(self) -> None:
        self.etcd.start()
        self.etcd.wait_healthy()
        log(f"etcd up on 127.0.0.1:{self.etcd.client}")
        # The first member bootstraps (initdb); the second clones it with
        # pg_basebackup once there is a leader.
        self.nodes[0].start_patroni(self.patroni)
        wait_for("n1 to bootstrap and lead", lambda: self.roles().get("n1") == "leader", 120)
        self.nodes[1].start_patroni(self.patroni)
        self.wait_sync_pair(120)

    def members(self) -> list[dict[str, Any]]:
        """/cluster from the first member whose REST API answers."""
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError):
                return list(node.api("/cluster")["members"])
        return []

    def roles(self) -> dict[str, str]:
        return {
            m["name"]: f"{m['role']}/{m['state']}" if m["role"] != "leader" else "leader"
            for m in self.members()
            if m["role"] != "leader" or m["state"] == "running"
        }

    def wait_sync_pair(self, timeout: float) -> tuple[PatroniNode, PatroniNode]:
        """Waits for a running leader and a streaming sync standby (an async one
        with --asynchronous); returns (leader, standby)."""
        role, state = ("replica", "async") if self.args.asynchronous else ("sync_standby", "sync")

        def ready() -> tuple[PatroniNode, PatroniNode] | None:
            roles = self.roles()
            leader = [n for n in self.nodes if roles.get(n.name) == "leader"]
            sync = [n for n in self.nodes if roles.get(n.name) == f"{role}/streaming"]
            if not (leader and sync):
                return None
            # And PostgreSQL agrees: the standby is attached, as sync (or async).
            rows = leader[0].query(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = %s"
                " AND state = 'streaming' AND sync_state = %s",
                [sync[0].name, state],
            )
            return (leader[0], sync[0]) if rows else None

        found = wait_for(f"a leader and a streaming {state} standby", ready, timeout)
        assert found is not None  # wait_for returns only a truthy value
        return found

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.kill()
        self.etcd.kill()
        if self.args.keep_logs is not None:
            self.args.keep_logs.mkdir(parents=True, exist_ok=True)
            for path in self.base.glob("*.log"):
                shutil.copy(path, self.args.keep_logs / path.name)
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def pair(args: argparse.Namespace, etcd_bin: str, patroni: Path) -> Iterator[Pair]:
    made = Pair(args, etcd_bin, patroni)
    try:
        made.start()
        yield made
    except BaseException:
        for node in made.nodes:
            with contextlib.suppress(OSError):
                tail = node.log.read_text().splitlines()[-15:]
                print(f"--- last lines of {node.log.name}:", *tail, sep="\n", file=sys.stderr)
        raise
    finally:
        made.close()


# ------------------------------------------------------------------ the run


@dataclass
class Timeline:
    """Samples of what the callers were told, every 50 ms, from a thread."""

    load: Load
    samples: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            with self.load.lock:
                sample = (time.monotonic(), len(self.load.claims), dict(self.load.errors))
            self.samples.append(sample)

    def acked_at(self, t: float) -> int:
        return max((a for s, a, _ in self.samples if s <= t), default=0)

    def errors_between(self, t1: float, t2: float) -> dict[str, int]:
        def at(t: float) -> dict[str, int]:
            return next((e for s, _, e in reversed(self.samples) if s <= t), {})

        first, last = at(t1), at(t2)
        return {k: v - first.get(k, 0) for k, v in last.items() if v - first.get(k, 0)}

    def no_ack(self, after: float) -> tuple[float, float]:
        """The longest stretch after `after` with no new acknowledged claim."""
        best = (after, after)
        last_t, last_a = after, self.acked_at(after)
        for s, a, _ in self.samples:
            if s < after:
                continue
            if a > last_a:
                if s - last_t > best[1] - best[0]:
                    best = (last_t, s)
                last_t, last_a = s, a
        return best


def rejoin_method(node: PatroniNode, offset: int) -> str:
    """What the restarted node's Patroni log (from `offset`) says it did to follow."""
    with open(node.log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    diverged = next((ln.split("stderr=")[-1] for ln in lines if "servers diverged" in ln), None)
    rebuilt = any("removing data directory" in ln.lower() for ln in lines)
    if any("pg_rewind exit code=0" in ln for ln in lines):
        how = f"pg_rewind ({diverged})" if diverged else "pg_rewind"
    elif rebuilt:
        how = "a new base backup (data directory removed)"
    else:
        how = "crash recovery, then streaming from the new leader (no rewind needed)"
    return how + ("; then a new base backup" if rebuilt and how.startswith("pg_rewind") else "")


def observe_alone(primary: PatroniNode, load: Load, seconds: float) -> dict[str, Any]:
    """Samples the new primary for `seconds` while it has no standby.

    In strict mode Patroni keeps `synchronous_standby_names` set (to `*`), so
    commits wait on `SyncRep` and callers block; in non-strict mode it clears it
    and the primary takes writes standalone.
    """
    log(f"{primary.name} alone for {seconds:g} s before the old node comes back")
    names = primary.query("SHOW synchronous_standby_names")[0][0]
    acked = load.acked()
    most = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(psycopg.Error):
            rows = primary.query(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
            )
            most = max(most, int(rows[0][0]))
        time.sleep(0.2)
    # What the store's connections are doing at the end of the window.
    backends = primary.query(
        "SELECT coalesce(wait_event, state), count(*) FROM pg_stat_activity"
        " WHERE application_name = %s GROUP BY 1 ORDER BY 1",
        [f"pglease-{SCHEMA}"],
    )
    most = max(most, dict(backends).get("SyncRep", 0))
    return {
        "synchronous_standby_names on the new primary alone": repr(names),
        "store backends on the new primary at the end": dict(backends),
        f"claims acknowledged in those {seconds:g} s": load.acked() - acked,
        "most backends waiting on SyncRep meanwhile": most,
    }


def run(p: Pair, args: argparse.Namespace, records: CountingHandler) -> bool:
    leader, standby = p.wait_sync_pair(60)
    log(f"leader {leader.name} (:{leader.port}), sync standby {standby.name} (:{standby.port})")
    # The store settings of tests/test_failover.py: calls during the outage fail
    # fast (DatabaseUnavailableError) and the load threads retry, as a host would.
    store = PostgresStore(
        p.dsn,
        schema=SCHEMA,
        max_size=6,
        pool_timeout=3,
        connect_timeout=5,
        statement_timeout=10,
        lock_timeout=5,
    )
    checks: dict[str, Any] = {}
    delivered: list[Event] = []
    with store:
        rids = [store.ensure_resource("job", f"k{i}") for i in range(4)]
        with store.watch(after="start") as watcher:
            load = Load(store, rids)
            timeline = Timeline(load)
            sampler = threading.Thread(target=timeline.run, daemon=True)
            sampler.start()
            load.start(args.threads)
            try:
                wait_for(
                    f"{args.claims} acknowledged claims", lambda: load.acked() >= args.claims, 60
                )
                delivered.extend(watcher.get_batch(timeout=5))

                t_kill, t_kill_wall = time.monotonic(), time.time()
                if args.kill == "node":
                    log(f"SIGKILL of the leader {leader.name}: its Patroni and every postgres")
                    leader.kill()
                else:
                    log(f"SIGKILL of the leader {leader.name}'s postgres; its Patroni lives")
                    leader.crash()
                before = load.acked()
                # A dead node cannot come back by itself; a leader whose postgres
                # died keeps its key and restarts it, or hands over to the standby.
                candidates = [standby] if args.kill == "node" else [leader, standby]
                found = wait_for(
                    "Patroni to bring up a primary",
                    lambda: next((n for n in candidates if n.writable()), None),
                    args.ttl * 3 + 60,
                )
                assert found is not None  # wait_for returns only a truthy value
                primary: PatroniNode = found
                t_promoted = time.monotonic()
                verb = "promoted" if primary is standby else "restarted as the primary"
                log(f"{primary.name} {verb} after {t_promoted - t_kill:.1f} s")
                wait_for(
                    f"{primary.name} to be Patroni's leader",
                    lambda: p.roles().get(primary.name) == "leader",
                    30,
                )
                offset = leader.log.stat().st_size
                if args.kill == "node":
                    # The new primary alone for a while, as when a dead machine takes
                    # time to come back: what do the callers see meanwhile?
                    alone = observe_alone(standby, load, args.rejoin_delay)
                    # The dead machine comes back: its Patroni rewinds it and follows.
                    log(f"restarting {leader.name}'s Patroni")
                    leader.start_patroni(p.patroni)
                else:
                    alone = {}
                t_restart = time.monotonic()
                new_leader, new_sync = p.wait_sync_pair(args.ttl * 3 + 180)
                t_rejoined = time.monotonic()
                assert new_leader is primary, f"{new_leader.name} leads, not {primary.name}"
                how = (
                    f"{new_sync.name} rejoined by {rejoin_method(new_sync, offset)}"
                    if new_sync is leader
                    else f"{new_sync.name} stayed the standby (no failover)"
                )
                log(f"{new_sync.name} is the sync standby after {t_rejoined - t_kill:.1f} s")
                # The same store object, with no help: its pool reconnects through the
                # multi-host DSN to the server that now accepts writes.
                wait_for(
                    f"{args.claims} claims on the new primary",
                    lambda: load.acked() >= before + args.claims,
                    120,
                )
                t_resumed = min(
                    (
                        s
                        for s, a, _ in timeline.samples
                        if s > t_promoted and a > timeline.acked_at(t_promoted)
                    ),
                    default=float("nan"),
                )
            finally:
                # Also on a failure above: no load thread may outlive the store.
                load.stop.set()
                timeline.stop.set()
                for thread in load.threads:
                    thread.join(30)
            load.finish()
            timeline.stop.set()
            sampler.join(5)
            with store.connection() as conn:
                row = conn.execute("SELECT inet_server_port()").fetchone()
                checks["store now on port"] = row[0] if row else None

            log_rows = log_of(primary)
            deadline = time.monotonic() + 30
            while len(delivered) < len(log_rows) and time.monotonic() < deadline:
                delivered.extend(watcher.get_batch(timeout=1))
            checks["watcher reconnects"] = watcher.health.reconnects

    generation = dict(primary.query(f"SELECT resource_id, generation FROM {SCHEMA}.leases"))
    gap_from, gap_to = timeline.no_ack(t_kill - 1)
    report: dict[str, Any] = {
        "mode": mode(args) + f", kill {args.kill}",
        f"kill -> {primary.name} {verb} (writable)": f"{t_promoted - t_kill:.1f} s",
        "kill -> old node's Patroni restarted": (
            f"{t_restart - t_kill:.1f} s" if args.kill == "node" else "not needed"
        ),
        "kill -> Patroni shows a sync standby again": f"{t_rejoined - t_kill:.1f} s",
        "kill -> first claim acknowledged on the new primary": f"{t_resumed - t_kill:.1f} s",
        "longest stretch with no acknowledged claim": f"{gap_to - gap_from:.1f} s",
        "errors before promotion": timeline.errors_between(t_kill, t_promoted),
        "errors from promotion to rejoin": timeline.errors_between(t_promoted, t_rejoined),
        "errors after rejoin": timeline.errors_between(t_rejoined, time.monotonic()),
        "claims acknowledged (before kill / total)": f"{before} / {len(load.claims)}",
        "fenced writes acknowledged": len(load.writes),
        "events on the new primary / delivered": f"{len(log_rows)} / {len(delivered)}",
        "log records (WARNING and up) by logger": dict(records.counts),
        # psycopg_pool spaces its reconnection attempts out exponentially:
        # the first claim on the new primary waits for the next attempt.
        "the pool's failed connection attempts (s after the kill)": [
            round(t - t_kill_wall, 1) for t in records.pool_failures if t >= t_kill_wall
        ],
        **alone,
        "the standby after the failover": how,
        **checks,
    }
    ok = True
    try:
        check_synchronous_failover(load, log_rows, generation, delivered)
        assert checks["watcher reconnects"] >= 1, "the watcher never reconnected"
        assert checks["store now on port"] == primary.port, "the store is not on the new primary"
        report["invariants"] = (
            "hold: no acknowledged claim or write lost, no generation twice,"
            " the watcher's stream equals the new primary's log"
        )
    except AssertionError as exc:
        ok = False
        report["invariants"] = f"VIOLATED: {exc}"
    print()
    for key, value in report.items():
        print(f"- {key}: {value}")
    return ok


def mode(args: argparse.Namespace) -> str:
    if args.asynchronous:
        return "synchronous_mode: false"
    return f"synchronous_mode: true, synchronous_mode_strict: {str(args.strict).lower()}"


def versions(patroni: Path, etcd_bin: str) -> str:
    def first(argv: list[str]) -> str:
        out = subprocess.run([*_as_server_user(), *argv], capture_output=True, text=True)
        return (out.stdout or out.stderr).splitlines()[0].strip()

    return "; ".join(
        [
            first([str(patroni), "--version"]),
            first([etcd_bin, "--version"]),
            first([str(PG15 / "postgres"), "--version"]),
            f"psycopg {psycopg.__version__}",
            f"Python {platform.python_version()}",
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv",
        type=Path,
        default=Path("/var/tmp/pglease-patroni-venv"),
        help="Patroni's venv (made if missing; readable by the server user)",
    )
    parser.add_argument("--patroni", default=PATRONI_SPEC, help="pip spec for Patroni")
    parser.add_argument(
        "--no-strict",
        dest="strict",
        action="store_false",
        help="synchronous_mode_strict: false (the new primary goes"
        " standalone instead of waiting for a standby)",
    )
    parser.add_argument(
        "--asynchronous",
        action="store_true",
        help="synchronous_mode: false, to see the checks fail: Patroni may then promote"
        " a standby that misses acknowledged claims",
    )
    parser.add_argument("--ttl", type=int, default=20, help="Patroni's leader key ttl (s)")
    parser.add_argument("--loop-wait", type=int, default=2, help="Patroni's loop_wait (s)")
    parser.add_argument(
        "--retry-timeout",
        type=int,
        default=5,
        help="Patroni's retry_timeout (s); loop_wait + 2 * retry_timeout <= ttl",
    )
    parser.add_argument(
        "--kill",
        choices=["node", "postgres"],
        default="node",
        help="SIGKILL the leader's Patroni and postgres (a machine dies), or only its"
        " postgres (Patroni restarts it in place within primary_start_timeout, 300 s)",
    )
    parser.add_argument(
        "--rejoin-delay",
        type=float,
        default=10,
        help="seconds between the promotion and the old node's restart",
    )
    parser.add_argument("--threads", type=int, default=4, help="load threads")
    parser.add_argument(
        "--keep-logs", type=Path, help="copy the etcd and Patroni logs to this directory"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print the store's and the pool's log records"
    )
    parser.add_argument(
        "--claims",
        type=int,
        default=40,
        help="acknowledged claims to wait for before the kill, and after it",
    )
    args = parser.parse_args()
    if args.loop_wait + 2 * args.retry_timeout > args.ttl:
        parser.error("Patroni needs loop_wait + 2 * retry_timeout <= ttl")
    if min(args.threads, args.claims, args.loop_wait) < 1 or args.rejoin_delay < 0:
        parser.error(
            "--threads, --claims and --loop-wait must be 1 or more, --rejoin-delay 0 or more"
        )
    if (reason := _pgcluster.skip_reason()) is not None:
        sys.exit(f"cannot run PostgreSQL 15 here: {reason}")
    etcd_bin = ensure_etcd()
    patroni = ensure_patroni(args.venv, args.patroni)

    # SIGTERM (and SIGHUP) unwind like Ctrl-C, so the cleanup below always runs.
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    log(versions(patroni, etcd_bin))
    log(
        f"{mode(args)}: ttl {args.ttl}, loop_wait {args.loop_wait},"
        f" retry_timeout {args.retry_timeout}"
    )
    records = CountingHandler(args.verbose)
    logging.getLogger().addHandler(records)
    started = time.monotonic()
    with pair(args, etcd_bin, patroni) as p:
        ok = run(p, args, records)
    log(f"done in {time.monotonic() - started:.0f} s; everything stopped and removed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
