"""Run the demo fleet and judge it from the database's own records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ..errors import ValidationError
from ..postgres import PostgresStore
from ..types import Event
from ..validation import check_ttl
from .checker import History, check_history
from .host import WRITE_EVENT


@dataclass
class DemoReport:
    hosts: int
    seconds: float
    ttl: float
    killed_host: str | None = None
    killed_resource: str | None = None
    takeover_ms: float | None = None
    histories: list[History] = field(default_factory=list)
    fenced: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    schema: str = "pglease_demo"
    #: The demo ran on the embedded server, which it leaves running.
    embedded: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations and not any(h.violations for h in self.histories)


def _all_events(store: PostgresStore, rid: str) -> list[Event]:
    events: list[Event] = []
    while page := store.events(rid, after_revision=events[-1].revision if events else 0):
        events.extend(page)
    return events


def _reset_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
        conn.execute(drop.format(sql.Identifier(schema)))


#: More host processes than this is a typo, and would exhaust the server's connections.
MAX_HOSTS = 32
MAX_RESOURCES = 100


def check_demo_args(hosts: int, resources: int, seconds: float, ttl: float) -> None:
    """Refuse settings the demo cannot run with (a usage error, exit 2), before any work."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValidationError(f"--hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
    if not 1 <= resources <= MAX_RESOURCES:
        raise ValidationError(f"--resources must be between 1 and {MAX_RESOURCES}, got {resources}")
    check_ttl(ttl)
    # Half-way through a host is SIGKILLed while it holds a lease; its lease must
    # run out before the end for a takeover to be seen.
    if not seconds >= max(1.0, 2 * ttl):
        raise ValidationError(
            f"--seconds must be at least 1s and twice the ttl ({2 * ttl:g}s), got {seconds:g}"
        )


def _spawn_host(
    dsn: str, schema: str, host: str, seed: int, rids: list[str], seconds: float, ttl: float
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "pglease.demo.host",
        "--dsn",
        dsn,
        "--schema",
        schema,
        "--host",
        host,
        "--ttl",
        str(ttl),
        "--seconds",
        str(seconds),
        "--seed",
        str(seed),
        *rids,
    ]
    # Files, not pipes: nobody reads a host's output until it has finished, and a
    # full pipe would stall the host mid-lease.
    log: Any = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by _finish)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.stdout = log  # read back by `_finish` once the host has exited
    return proc


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    """Wait for a host; return what it wrote (JSON lines, then any error text)."""
    proc.wait(timeout)
    log: Any = proc.stdout
    log.seek(0)
    text: str = log.read()
    log.close()
    return text


def _live_holder(store: PostgresStore, rids: list[str], hosts: list[str]) -> tuple[str, str] | None:
    for state in store.list_resources("controller"):
        owner = state.lease.owner
        if state.id in rids and state.lease.held and owner is not None and owner.id in hosts:
            return owner.id, state.id
    return None


class _Progress:
    """A "time left" line, rewritten in place on a terminal, at most once a second."""

    def __init__(self, out: Any, ends_at: float) -> None:
        self.out = out
        self.ends_at = ends_at
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.last = 0.0
        self.shown = False

    def tick(self, running: int) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:
            return
        self.last = now
        left = max(0.0, self.ends_at - now)
        line = f"progress: {left:4.0f}s left, {running} host processes running"
        end = "" if self.tty else "\n"
        print(("\r" if self.tty else "") + line, end=end, file=self.out, flush=True)
        self.shown = True

    def say(self, message: str) -> None:
        self.done()
        print(message, file=self.out, flush=True)

    def done(self) -> None:
        if self.tty and self.shown:
            print(file=self.out, flush=True)  # end the line rewritten in place
        self.shown = False


def _on_embedded(dsn: str) -> bool:
    from ..embedded import running_dsn

    return dsn == running_dsn()


def run_demo(
    dsn: str,
    *,
    schema: str = "pglease_demo",
    hosts: int = 4,
    resources: int = 3,
    seconds: float = 12.0,
    ttl: float = 1.0,
    out: Any = sys.stdout,
) -> DemoReport:
    """Start `hosts` processes contending for `resources` leases; SIGKILL one midway."""
    check_demo_args(hosts, resources, seconds, ttl)
    _reset_schema(dsn, schema)
    report = DemoReport(hosts=hosts, seconds=seconds, ttl=ttl, schema=schema)
    report.embedded = _on_embedded(dsn)
    with PostgresStore(dsn, schema=schema, max_size=2) as store:
        with store.connection() as conn:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {}.demo_writes (resource_id text NOT NULL,"
                    " generation bigint NOT NULL, host text NOT NULL, step int NOT NULL,"
                    " written_at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ).format(sql.Identifier(schema))
            )
        rids = [store.ensure_resource("controller", f"demo-{i}") for i in range(resources)]
        report.labels = {rid: f"controller/demo-{i}" for i, rid in enumerate(rids)}
        names = [f"h{i}" for i in range(hosts)]
        print(
            f"fleet: {hosts} host processes, {resources} resources, ttl {ttl:g}s,"
            f" {seconds:g}s; writing schema {schema} (recreated on every run)",
            file=out,
            flush=True,
        )
        procs = {
            name: _spawn_host(dsn, schema, name, i, rids, seconds, ttl)
            for i, name in enumerate(names)
        }
        started = time.monotonic()
        kill_at = started + seconds / 2
        victim: tuple[str, str] | None = None
        progress = _Progress(out, started + seconds)
        while any(proc.poll() is None for proc in procs.values()):
            if time.monotonic() > started + seconds + 60:
                break  # a host that hangs is reported below, not waited for forever
            time.sleep(0.02)
            now = time.monotonic()
            if victim is None and kill_at <= now < kill_at + seconds / 4:
                victim = _live_holder(store, rids, names)
                if victim is not None:
                    report.killed_host, report.killed_resource = victim
                    held = store.get(victim[1])
                    os.kill(procs[victim[0]].pid, signal.SIGKILL)
                    progress.say(
                        f"SIGKILL host {victim[0]} while it held {report.labels[victim[1]]} "
                        f"(generation {held.lease.generation})"
                    )
            progress.tick(sum(proc.poll() is None for proc in procs.values()))
        progress.done()
        if victim is None:
            report.violations.append("no host held a lease midway; nothing was killed")
        outputs: dict[str, str] = {}
        for name, proc in procs.items():
            try:
                text = _finish(proc, timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                text = _finish(proc, timeout=30)
                report.violations.append(f"host {name} did not finish in time")
            lines = text.splitlines()
            outputs[name] = "\n".join(line for line in lines if line.startswith("{"))
            if proc.returncode not in (0, -signal.SIGKILL):
                report.violations.append(f"host {name} failed: {text.strip()[-500:]}")
        for name, text in outputs.items():
            for line in text.splitlines():
                item = json.loads(line)
                if item["kind"] in ("fenced", "lost"):
                    report.fenced[item["resource"]] += 1
                elif item["kind"] == "late_write_accepted":
                    report.violations.append(f"host {name} wrote after losing {item['resource']}")
        side = _side_counts(store, schema)
        for rid in rids:
            events = _all_events(store, rid)
            history = check_history(rid, events)
            report.histories.append(history)
            logged = Counter(e.lease_generation for e in events if e.type == WRITE_EVENT)
            if logged != side.get(rid, Counter()):
                history.violations.append("side-table rows do not match the write events")
            if victim is not None and rid == victim[1]:
                report.takeover_ms = _takeover_ms(events, victim[0])
    return report


def _side_counts(store: PostgresStore, schema: str) -> dict[str, Counter[int | None]]:
    counts: dict[str, Counter[int | None]] = {}
    with store.connection() as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT resource_id, generation, count(*) FROM {}.demo_writes GROUP BY 1, 2"
            ).format(sql.Identifier(schema))
        ).fetchall()
    for rid, generation, n in rows:
        counts.setdefault(rid, Counter())[generation] = n
    return counts


def _takeover_ms(events: list[Event], victim: str) -> float | None:
    """From the killed holder's last expiry to the next claim, by the database clock."""
    expiry = None
    for e in events:
        if e.actor is not None and e.actor.id == victim and e.lease_expires_at is not None:
            expiry = e.lease_expires_at
        elif expiry is not None and e.type == "lease.claimed" and e.created_at >= expiry:
            return (e.created_at - expiry).total_seconds() * 1000
    return None


#: One line saying what the table's columns count.
LEGEND = (
    "legend: claims = leases won; takeovers = claims of a lease its holder never released"
    " (killed or stalled); final gen = last generation (the fencing token); fenced = late"
    " writes the database refused; check = the event log replayed against the invariants"
)


def next_steps(report: DemoReport) -> list[str]:
    """What to try after the demo: inspect what it wrote, then set up a schema of
    one's own (only `migrate` creates one) and lead an election in it."""
    base = report.schema.removesuffix("_demo")
    flag = "" if base == "pglease" else f" --schema {base}"
    steps = [
        (
            f"pglease --schema {report.schema} ls",
            "the demo's resources: holder, generation, revision",
        ),
        (
            f"pglease --schema {report.schema} events controller demo-0",
            "one resource's history: claims, takeovers, fenced writes",
        ),
        (f"pglease{flag} migrate", f"set up schema {base} (only migrate creates one)"),
        (
            f"pglease{flag} elect scheduler --owner host:$(hostname) --ttl 10",
            "then lead an election in it until Ctrl-C",
        ),
    ]
    width = max(len(command) for command, _ in steps)
    return [f"  {command:<{width}}   {what}" for command, what in steps]


def print_report(report: DemoReport, out: Any = sys.stdout) -> None:
    print(LEGEND, file=out)
    header = (
        f"{'resource':<20} {'claims':>6} {'takeovers':>9} {'final gen':>9} {'fenced':>6}  check"
    )
    print(header, file=out)
    for h in report.histories:
        verdict = "OK" if not h.violations else "FAIL: " + "; ".join(h.violations[:3])
        label = report.labels.get(h.resource_id, h.resource_id)
        print(
            f"{label:<20} {h.claims:>6} {h.takeovers:>9} {h.final_generation:>9}"
            f" {report.fenced[h.resource_id]:>6}  {verdict}",
            file=out,
        )
    if report.takeover_ms is not None:
        print(
            f"takeover after SIGKILL of {report.killed_host}: next claim "
            f"{report.takeover_ms:.0f} ms after its lease expired",
            file=out,
        )
    for violation in report.violations:
        print(f"FAIL: {violation}", file=out)
    print(
        "invariants: "
        + (
            "OK (never two holders, generations strictly increasing, late writes fenced)"
            if report.ok
            else "VIOLATED"
        ),
        file=out,
    )
    print(f"the demo's records stay in schema {report.schema}; what to try next:", file=out)
    for step in next_steps(report):
        print(step, file=out)
    if report.embedded:
        print(
            "the embedded PostgreSQL is still running (later commands reuse it);"
            " stop it with `pglease embedded stop`",
            file=out,
        )


def report_json(report: DemoReport) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "killed_host": report.killed_host,
        "killed_resource": report.killed_resource,
        "takeover_ms": report.takeover_ms,
        "violations": report.violations,
        "schema": report.schema,
        "inspect": f"pglease --schema {report.schema} ls",
        "embedded_running": report.embedded,
        "resources": [
            {
                "resource": h.resource_id,
                "label": report.labels.get(h.resource_id),
                "claims": h.claims,
                "takeovers": h.takeovers,
                "final_generation": h.final_generation,
                "writes": h.writes,
                "fenced": report.fenced[h.resource_id],
                "violations": h.violations,
            }
            for h in report.histories
        ],
    }
