"""Run the demo fleet and judge it from the database's own records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ..postgres import PostgresStore
from ..types import Event
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
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _live_holder(store: PostgresStore, rids: list[str], hosts: list[str]) -> tuple[str, str] | None:
    for state in store.list_resources("controller"):
        owner = state.lease.owner
        if state.id in rids and state.lease.held and owner is not None and owner.id in hosts:
            return owner.id, state.id
    return None


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
    _reset_schema(dsn, schema)
    report = DemoReport(hosts=hosts, seconds=seconds, ttl=ttl)
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
            f"fleet: {hosts} host processes, {resources} resources, ttl {ttl}s, {seconds}s",
            file=out,
            flush=True,
        )
        procs = {
            name: _spawn_host(dsn, schema, name, i, rids, seconds, ttl)
            for i, name in enumerate(names)
        }
        kill_at = time.monotonic() + seconds / 2
        victim: tuple[str, str] | None = None
        while victim is None and time.monotonic() < kill_at + seconds / 4:
            time.sleep(0.02)
            if time.monotonic() >= kill_at:
                victim = _live_holder(store, rids, names)
        if victim is None:
            report.violations.append("no host held a lease midway; nothing was killed")
        else:
            report.killed_host, report.killed_resource = victim
            held = store.get(victim[1])
            os.kill(procs[victim[0]].pid, signal.SIGKILL)
            print(
                f"SIGKILL host {victim[0]} while it held {report.labels[victim[1]]} "
                f"(generation {held.lease.generation})",
                file=out,
                flush=True,
            )
        outputs: dict[str, str] = {}
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=seconds + 60)
            outputs[name] = stdout
            if proc.returncode not in (0, -signal.SIGKILL):
                report.violations.append(f"host {name} failed: {stderr.strip()[-500:]}")
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


def print_report(report: DemoReport, out: Any = sys.stdout) -> None:
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


def report_json(report: DemoReport) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "killed_host": report.killed_host,
        "killed_resource": report.killed_resource,
        "takeover_ms": report.takeover_ms,
        "violations": report.violations,
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
