"""The soak under stalls (issue 31), short: hosts each behind their own
fault-injecting proxy, partitions inside and outside fenced transactions,
heals by resume and by reset, one outage of the whole server; the checker
(an independent reader of the raw tables) finds no violation, and it does
find each kind of violation planted in what it reads.

No figure is asserted (calls against their bounds, time to learn of a loss):
`bench/stall_soak.py` measures those; see bench/RESULTS.md.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ._stall_soak import (
    Settings,
    SoakReport,
    Tables,
    check,
    read_log,
    read_tables,
    run_soak,
    summary,
)

#: The run (about 40 s, more on a busy machine) happens in the first test's setup.
pytestmark = pytest.mark.timeout(600)

SETTINGS = Settings(hosts=3, holders=2, seconds=24.0, outages=1, outage_seconds=4.0, seed=31,
                    partition_max=5.0)  # fmt: skip


@dataclass
class Run:
    report: SoakReport
    tables: Tables
    logs: list[list[list[Any]]]


@pytest.fixture(scope="module")
def soak(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    schema = f"t_soak_{uuid.uuid4().hex[:8]}"
    workdir = tmp_path_factory.mktemp("soak")
    try:
        report = run_soak(pg_dsn, schema, workdir, SETTINGS)
        logs = [read_log(workdir / f"host{i}.jsonl") for i in range(SETTINGS.hosts)]
        yield Run(report, read_tables(pg_dsn, schema), logs)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_a_short_soak_under_stalls_finds_no_violation(soak: Run) -> None:
    report = soak.report
    print(summary(report))
    assert report.violations == []
    f = report.figures
    # The run did what it says: faults, writes under them, events watched.
    assert f["partitions"] >= 2 and f["healed_by_reset"] >= 1
    assert f["partitions_in_transaction"] >= 1
    assert f["outages"] and f["acknowledged_writes"] > 0
    assert f["hold_entries"]["granted"] > 0 and f["events"] > 0
    assert {"claim", "renew", "mutate", "get"} <= set(f["calls"])


def _ids(logs: list[list[list[Any]]], kind: str) -> list[list[Any]]:
    return [r for rs in logs for r in rs if r[0] == kind]


def test_the_checker_finds_what_is_planted(soak: Run) -> None:
    tables, logs = soak.tables, soak.logs
    assert check(tables, logs) == []

    # A write by a generation that was no longer the live one.
    stale = copy.deepcopy(tables)
    wid, rid, seq, revision, generation, at = max(stale.writes, key=lambda w: w[4])
    stale.writes.append((wid + "-stale", rid, seq + 1, revision, generation - 1, at))
    assert any("stale write" in v for v in check(stale, logs))

    # An acknowledged write that is not in the table.
    lost = copy.deepcopy(logs)
    lost[0].append(["ack", "h0-planted", rid, generation])
    assert any("acknowledged write h0-planted is missing" in v for v in check(tables, lost))

    # A write the host was told did not commit, present after all.
    honest = copy.deepcopy(logs)
    honest[1].append(["nocommit", wid, rid, generation, "DatabaseUnavailableError"])
    assert any("reported as not committed" in v for v in check(tables, honest))

    # A watcher that got an event twice, or missed one.
    twice = copy.deepcopy(logs)
    first = next(i for i, r in enumerate(twice[2]) if r[0] == "ev")
    twice[2].insert(first + 1, twice[2][first])
    assert any("received twice" in v for v in check(tables, twice))
    missed = copy.deepcopy(logs)
    missed[2].pop(first)
    assert any("missed 1 events" in v for v in check(tables, missed))

    # Two holders at once: a claim of the next generation before the
    # previous holder's expiry.
    overlap = copy.deepcopy(tables)
    held = next(r for r in overlap.audit if r[2] is not None and r[3] is not None)
    overlap.audit.insert(overlap.audit.index(held) + 1,
                         (held[0], held[1] + 1, "intruder", held[3], held[4]))  # fmt: skip
    assert any("claimed at" in v and "while generation" in v for v in check(overlap, logs))

    # A holder that trusted its lease past the next generation's claim.
    late = copy.deepcopy(logs)
    claimed = {(a[0], a[1]): a[4] for a in reversed(tables.audit)}  # first row of each
    rec = next(r for rs in late for r in rs if r[0] == "belief" and (r[1], r[2] + 1) in claimed)
    rec[3] = claimed[(rec[1], rec[2] + 1)].timestamp() + 1.0
    assert any("after generation" in v for v in check(tables, late))

    # An event the writes table has no row for (all-or-nothing broken).
    orphan = copy.deepcopy(tables)
    orphan.writes = [w for w in orphan.writes if w[0] != wid]
    found = check(orphan, logs)
    assert any("events for" in v for v in found), found


def test_a_host_log_read_back_skips_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "host.jsonl"
    path.write_text('["ack", "w1", "r", 1]\n["ev", 1, "r"')
    assert read_log(path) == [["ack", "w1", "r", 1]]
