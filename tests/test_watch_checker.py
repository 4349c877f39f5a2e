"""The checker: writer and watcher processes run for a fixed time; watchers are
killed and restarted from their saved cursors, the server is restarted once;
at the end every watcher received exactly the committed events, in log order."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest

from pglease import PostgresStore
from tests._watch_helpers import (
    CHECK_KEYS,
    CHECK_TYPE,
    committed_events,
    kill,
    read_received,
    restart_server,
    restart_unavailable_reason,
    spawn,
    wait_for_server,
)


def _check(received: list[tuple[int, str, int]], expected: list[tuple[int, str, int]]) -> None:
    ids = [r[0] for r in received]
    assert len(ids) == len(set(ids)), "a watcher got an event twice"
    missing = {e[0] for e in expected} - set(ids)
    assert not missing, f"a watcher missed {len(missing)} events, e.g. {sorted(missing)[:5]}"
    assert received == expected
    last: dict[str, int] = defaultdict(int)
    for _, rid, revision in received:
        assert revision == last[rid] + 1, f"{rid}: revision {revision} after {last[rid]}"
        last[rid] = revision


def _run_checker(pg_dsn: str, schema: str, tmp_path: Path, *, restart: bool) -> None:
    with PostgresStore(pg_dsn, schema=schema) as store:
        for key in CHECK_KEYS:
            store.ensure_resource(CHECK_TYPE, key)
    watchers = [
        ("listen", "sync"),
        ("poll", "sync"),
        ("listen", "async"),
    ]
    outs = [tmp_path / f"watcher{i}.tsv" for i in range(len(watchers))]

    def start_watcher(i: int):  # type: ignore[no-untyped-def]
        mode, flavour = watchers[i]
        return spawn("watcher", pg_dsn, schema, str(outs[i]), mode, flavour)

    writers = [spawn("writer", pg_dsn, schema, str(seed)) for seed in range(3)]
    procs = [start_watcher(i) for i in range(len(watchers))]
    try:
        time.sleep(1.5)
        kill(procs[0])
        procs[0] = start_watcher(0)
        time.sleep(1.0)
        if restart:
            restart_server(pg_dsn)
            wait_for_server(pg_dsn)
        time.sleep(1.5)
        for i in (1, 2):
            kill(procs[i])
            procs[i] = start_watcher(i)
        time.sleep(1.0)
        kill(procs[0])  # down while the last writes happen; restarts afterwards
        time.sleep(1.0)
    finally:
        for w in writers:
            kill(w)
    procs[0] = start_watcher(0)
    try:
        expected = committed_events(pg_dsn, schema)
        assert len(expected) > 50, "the writers produced too few events to check much"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all(len(read_received(o)) >= len(expected) for o in outs):
                break
            time.sleep(0.2)
        time.sleep(0.3)  # anything extra (a duplicate) would show up now
    finally:
        for p in procs:
            kill(p)
    for i, out in enumerate(outs):
        received = read_received(out)
        try:
            _check(received, expected)
        except AssertionError as exc:
            raise AssertionError(f"watcher {i} {watchers[i]}: {exc}") from None


def test_checker_kills_and_restarts(pg_dsn: str, schema: str, tmp_path: Path) -> None:
    _run_checker(pg_dsn, schema, tmp_path, restart=False)


def test_checker_with_server_restart(pg_dsn: str, schema: str, tmp_path: Path) -> None:
    reason = restart_unavailable_reason(pg_dsn)
    if reason:
        pytest.skip(f"server restart part skipped: {reason}")
    _run_checker(pg_dsn, schema, tmp_path, restart=True)
