"""Chaos harness: real host processes contending for leases while a driver
SIGKILLs hosts, SIGSTOPs one past its TTL, and restarts PostgreSQL; then a
checker verifies the invariants from the database's own records.

``python -m tests._chaos host DSN SCHEMA HOST WORKERS KEYS TTL LOG`` (from the
repository root) runs one host. It lives with the tests, outside the wheel: it
is a test harness, and it uses the demo's history checker. `run_chaos` drives
a whole run; `check` judges it. Records:

* the event log (claims, releases, fenced writes, with revisions);
* ``chaos_writes``: the fenced side table, written inside `mutate`;
* ``chaos_lease_audit``: a trigger's copy of every lease-row change, so silent
  heartbeat extensions are on record too (they write no event by design);
* one log file per host: ``acq``/``ack``/``lost``/``refused`` lines.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from pglease.demo.checker import check_history
from pglease.errors import LeaseLostError, PgleaseError
from pglease.postgres import PostgresStore
from pglease.runtime.acquire import hold
from pglease.types import Owner

#: `-m tests._chaos` resolves from here.
_REPO_ROOT = Path(__file__).resolve().parent.parent
CHAOS_TYPE = "chaos"
#: Event-log findings that silent heartbeat extensions explain (see `check`).
_SILENT_EXTENSION = re.compile(r"two holders|(write|renew) after expiry")


def setup(dsn: str, schema: str) -> None:
    """Migrate, and add the side table and the lease audit trigger (harness only)."""
    PostgresStore(dsn, schema=schema, max_size=1).close()
    s = f'"{schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.chaos_writes (write_id text PRIMARY KEY,"
            " resource_id text NOT NULL, revision bigint NOT NULL, generation bigint NOT NULL,"
            " host text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.chaos_lease_audit (id bigserial PRIMARY KEY,"
            " resource_id text, generation bigint, owner_id text, expires_at timestamptz,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.execute(
            f"CREATE OR REPLACE FUNCTION {s}.chaos_audit() RETURNS trigger LANGUAGE plpgsql AS $$"
            f" BEGIN INSERT INTO {s}.chaos_lease_audit (resource_id, generation, owner_id,"
            " expires_at) VALUES (NEW.resource_id, NEW.generation, NEW.owner_id, NEW.expires_at);"
            " RETURN NEW; END $$"
        )
        conn.execute(
            f"CREATE OR REPLACE TRIGGER chaos_audit AFTER UPDATE ON {s}.leases"
            f" FOR EACH ROW EXECUTE FUNCTION {s}.chaos_audit()"
        )


# --------------------------------------------------------------------------- host


def host_main(
    dsn: str, schema: str, host: str, workers: int, keys: int, ttl: float, log_path: str
) -> None:
    """M workers loop: hold a random key, make a few fenced writes, let go."""
    while True:
        try:
            store = PostgresStore(dsn, schema=schema, max_size=workers + 1, auto_migrate=False)
            break
        except (PgleaseError, psycopg.Error):
            time.sleep(0.2)
    out = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives until killed)
    out_lock = threading.Lock()

    def log(*parts: object) -> None:
        with out_lock:
            out.write(" ".join(str(p) for p in parts) + "\n")

    insert = (
        f'INSERT INTO "{schema}".chaos_writes (write_id, resource_id, revision, generation, host)'
        f' SELECT %s, %s, coalesce(l.revision, r.revision), %s, %s FROM "{schema}".leases l'
        f' JOIN "{schema}".resources r ON r.id = l.resource_id WHERE l.resource_id = %s'
    ).encode()

    def worker(w: int) -> None:
        rnd = random.Random(f"{host}/{w}/{os.getpid()}")
        owner = Owner("host", f"{host}.{w}")
        n = 0
        while True:
            key = f"k{rnd.randrange(keys)}"
            try:
                with hold(store, CHAOS_TYPE, key, owner, ttl, timeout=ttl * 3) as lease:
                    rid, gen = lease.resource_id, lease.generation

                    losses: list[str] = []

                    def noticed(
                        _e: LeaseLostError, r: str = rid, g: int = gen, out: list[str] = losses
                    ) -> None:
                        out.append(r)
                        log("lost", r, g)

                    lease.on_lost(noticed)
                    log("acq", rid, gen)
                    revision = lease.claim.revision
                    for _ in range(rnd.randint(1, 6)):
                        time.sleep(rnd.random() * ttl / 4)
                        n += 1
                        wid = f"{host}-{w}-{os.getpid()}-{n}"

                        def apply(
                            c: psycopg.Connection[Any], i: str = wid, r: str = rid, g: int = gen
                        ) -> None:
                            c.execute(insert, [i, r, g, host, r])

                        try:
                            result = store.mutate(lease.permit(revision), "chaos.write", apply)
                        except LeaseLostError:
                            log("refused", rid, gen, wid)
                            break
                        revision = result.revision
                        log("ack", rid, gen, wid)
                if not losses:
                    log("rel", rid, gen)  # given back: not in question if paused later
            except (PgleaseError, psycopg.Error, OSError):
                time.sleep(0.05)  # timeouts, restarts: try again

    for w in range(workers):
        threading.Thread(target=worker, args=(w,), daemon=True).start()
    while True:
        time.sleep(1)


# --------------------------------------------------------------------------- checker


@dataclass
class ChaosReport:
    violations: list[str] = field(default_factory=list)
    claims: int = 0
    writes: int = 0
    acked: int = 0
    kills: int = 0
    paused_leases: int = 0
    restarted: bool = False


def _read_log(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def check(dsn: str, schema: str, logs: list[Path], paused: tuple[Path, int] | None) -> ChaosReport:
    """Verify a finished run; `paused` is (log of the paused host, its line count at SIGSTOP)."""
    report = ChaosReport()
    v = report.violations
    s = f'"{schema}"'
    with PostgresStore(dsn, schema=schema, max_size=1, auto_migrate=False) as store:
        resources = store.list_resources(CHAOS_TYPE)
        events = {r.id: store.events(r.id, limit=10_000) for r in resources}
        with store.connection() as conn:
            audit = conn.execute(
                f"SELECT resource_id, generation, owner_id, expires_at, at"
                f" FROM {s}.chaos_lease_audit ORDER BY id"
            ).fetchall()
            writes = conn.execute(
                f"SELECT write_id, resource_id, revision, generation, at FROM {s}.chaos_writes"
            ).fetchall()
    # Generations +1 per claim, revisions gap-free (the event log).
    for rid, evs in events.items():
        history = check_history(rid, evs)
        # The event log alone cannot judge expiry here: heartbeats extend a lease
        # silently (no event, by design), so its claim event's expiry is only
        # the first one. Overlaps and writes after expiry are judged below on
        # the lease audit, which records every extension.
        v.extend(f"{rid}: {x}" for x in history.violations if not _SILENT_EXTENSION.search(x))
        report.claims += history.claims
    # Never two unexpired holders, including silent heartbeat extensions.
    by_rid: dict[str, list[Any]] = {}
    for row in audit:
        by_rid.setdefault(row[0], []).append(row)
    for rid, rows in by_rid.items():
        prev = None
        for row in rows:
            taken_over = prev is not None and row[1] != prev[1] and prev[2] is not None
            if taken_over and prev is not None and prev[3] is not None and prev[3] > row[4]:
                v.append(f"{rid}: generation {row[1]} claimed at {row[4]} while {prev[1]}"
                             f" ran to {prev[3]}")  # fmt: skip
            if prev is not None and row[1] < prev[1]:
                v.append(f"{rid}: generation went down {prev[1]} -> {row[1]}")
            prev = row
    # Every accepted write carries the then-current, unexpired generation.
    for wid, rid, revision, generation, at in writes:
        report.writes += 1
        ev = next((e for e in events.get(rid, []) if e.revision == revision), None)
        if ev is None or ev.type != "chaos.write" or ev.lease_generation != generation:
            v.append(f"write {wid}: event at revision {revision} does not match generation"
                     f" {generation}")  # fmt: skip
        state = None
        for row in by_rid.get(rid, []):
            if row[4] <= at:
                state = row
        if state is None or state[1] != generation or state[2] is None or state[3] <= at:
            v.append(f"write {wid} of generation {generation} at {at} was not under a live"
                     f" lease of that generation ({state})")  # fmt: skip
    # No acknowledged write is missing.
    stored = {w[0] for w in writes}
    for path in logs:
        for parts in _read_log(path):
            if parts[0] == "ack":
                report.acked += 1
                if parts[3] not in stored:
                    v.append(f"acknowledged write {parts[3]} is missing")
    # The paused host noticed each lease it held when it was stopped.
    if paused is not None:
        path, cut = paused
        lines = _read_log(path)
        held: set[tuple[str, str]] = set()
        for parts in lines[:cut]:
            if parts[0] == "acq":
                held.add((parts[1], parts[2]))
            elif parts[0] == "lost":
                held.discard((parts[1], parts[2]))
        ended = {(p[1], p[2]) for p in lines if p[0] in ("lost",)}
        released_ok = {(p[1], p[2]) for p in lines[:cut] if p[0] == "rel"}
        report.paused_leases = len(held - released_ok)
        for lease in held - released_ok:
            # A lease the host gave back cleanly before the stop is not in question;
            # a release call is not logged, so compare with the audit instead.
            rows = [r for r in by_rid.get(lease[0], []) if str(r[1]) == lease[1]]
            if rows and rows[-1][2] is None:
                continue  # released before the pause took effect
            if lease not in ended:
                v.append(f"paused host did not notice the loss of {lease}")
    return report


# --------------------------------------------------------------------------- driver


def spawn_host(
    dsn: str, schema: str, host: str, workers: int, keys: int, ttl: float, log: Path
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests._chaos", "host", dsn, schema, host, str(workers),
         str(keys), repr(ttl), str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=_REPO_ROOT,
    )  # fmt: skip


def run_chaos(
    dsn: str,
    schema: str,
    workdir: Path,
    *,
    hosts: int = 3,
    workers: int = 2,
    keys: int = 3,
    ttl: float = 1.0,
    seconds: float = 12.0,
    kills: int = 2,
    restart: Callable[[], None] | None = None,
    seed: int = 1,
) -> ChaosReport:
    """Run the fleet with chaos for `seconds`, then stop it and `check` the records."""
    rnd = random.Random(seed)
    setup(dsn, schema)
    logs = [workdir / f"host{i}.log" for i in range(hosts)]
    procs = [spawn_host(dsn, schema, f"h{i}", workers, keys, ttl, logs[i]) for i in range(hosts)]
    # Chaos schedule: kills spread over the run, one pause, one restart.
    plan: list[tuple[float, str]] = [
        (seconds * (i + 1) / (kills + 2), "kill") for i in range(kills)
    ]
    plan.append((seconds * 0.3, "pause"))
    if restart is not None:
        plan.append((seconds * 0.65, "restart"))
    plan.sort()
    start = time.monotonic()
    paused: tuple[Path, int] | None = None
    restarted = False
    try:
        for at, action in plan:
            time.sleep(max(0.0, start + at - time.monotonic()))
            if action == "kill":
                i = rnd.randrange(1, hosts)  # host 0 is the one paused
                procs[i].send_signal(signal.SIGKILL)
                procs[i].wait(10)
                procs[i] = spawn_host(dsn, schema, f"h{i}", workers, keys, ttl, logs[i])
            elif action == "pause":
                procs[0].send_signal(signal.SIGSTOP)
                time.sleep(0.05)
                paused = (logs[0], len(_read_log(logs[0])))
                time.sleep(ttl * 2.5)
                procs[0].send_signal(signal.SIGCONT)
            elif action == "restart" and restart is not None:
                restart()
                restarted = True
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        time.sleep(ttl)  # let the resumed host see its loss
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGKILL)
            p.wait(10)
    report = check(dsn, schema, logs, paused)
    report.kills = kills
    report.restarted = restarted
    return report


if __name__ == "__main__":
    if sys.argv[1] == "host":
        a = sys.argv[2:]
        host_main(a[0], a[1], a[2], int(a[3]), int(a[4]), float(a[5]), a[6])
    else:
        raise SystemExit(f"unknown role {sys.argv[1]}")
