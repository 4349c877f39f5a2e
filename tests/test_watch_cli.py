"""`pglease watch` / `prune` / `reap` as real processes."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import IO

import pytest

from pglease import Owner, PostgresStore
from pglease.cursors import decode_cursor

# Until the main CLI registers the watch commands, drive them through a parser
# with the same global options; afterwards through `python -m pglease` itself.
_SHIM = textwrap.dedent(
    """
    import argparse, sys
    from pglease.cli.watch import register
    p = argparse.ArgumentParser(prog="pglease")
    p.add_argument("--dsn")
    p.add_argument("--schema", default="pglease")
    p.add_argument("--json", action="store_true")
    register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args()
    sys.exit(args.func(args))
    """
)


def _main_cli_has_watch() -> bool:
    try:
        from pglease.cli import build_parser
    except ImportError:
        return False
    parser = build_parser()
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        choices = getattr(action, "choices", None) or {}
        if "watch" in choices:
            return True
    return False


def _cmd(pg_dsn: str, schema: str, *args: str) -> list[str]:
    base = (
        [sys.executable, "-m", "pglease"]
        if _main_cli_has_watch()
        else [sys.executable, "-c", _SHIM]
    )
    return [*base, "--dsn", pg_dsn, "--schema", schema, *args]


def _run(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cmd(pg_dsn, schema, *args), capture_output=True, text=True, timeout=60, check=False
    )


def test_watch_json_limit_and_prune(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    rid = pg_store.ensure_resource("run", "cli1")
    other = pg_store.ensure_resource("job", "cli2")
    for r in (rid, other):
        claim = pg_store.claim(r, Owner("host", "a"), 5)
        assert claim is not None
        pg_store.release(claim)
    out = _run(
        pg_dsn, schema, "watch", "--after", "start", "--type", "run", "--json", "--limit", "2"
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(e["type"], e["revision"], e["resource_id"]) for e in lines] == [
        ("lease.claimed", 1, rid),
        ("lease.released", 2, rid),
    ]
    # The printed cursor is at or past the last event printed (it moves past
    # filtered-out events too); resuming from it gives nothing twice.
    printed = out.stderr.split("cursor: ")[-1].split()[0]
    assert decode_cursor(printed) >= decode_cursor(lines[-1]["cursor"])
    first_cursor = lines[0]["cursor"]
    out = _run(pg_dsn, schema, "watch", "--after", first_cursor, "--limit", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == lines[1]["cursor"]

    out = _run(pg_dsn, schema, "prune", "--older-than", "0s", "--force")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deleted 4 events"

    out = _run(pg_dsn, schema, "watch", "--after", first_cursor)
    assert out.returncode == 5
    assert "pruned horizon" in out.stderr

    out = _run(pg_dsn, schema, "prune", "--older-than", "soon")
    assert out.returncode == 2
    assert "duration" in out.stderr

    out = _run(pg_dsn, schema, "watch", "--after", "bogus")
    assert out.returncode == 2
    assert "cursor" in out.stderr


def _readline(stream: IO[str], timeout: float) -> str:
    """The next line of `stream`, or "" when none comes within `timeout` seconds."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return ""


@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_watch_prints_live_and_exits_cleanly_on_ctrl_c_or_sigterm(
    pg_store: PostgresStore, pg_dsn: str, schema: str, poll: bool, signum: signal.Signals
) -> None:
    rid = pg_store.ensure_resource("run", "live")
    # From the start of the (empty) log: on a loaded machine the process may
    # join the stream only after the claim below, which "now" would then miss.
    args = ["watch", "--after", "start", *(["--poll"] if poll else [])]
    proc = subprocess.Popen(
        _cmd(pg_dsn, schema, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        claim = pg_store.claim(rid, Owner("host", "a"), 5)
        assert claim is not None
        assert proc.stdout is not None
        line = _readline(proc.stdout, timeout=30)
        assert " lease.claimed run/live rev=1 gen=1 actor=host:a" in line
        cursor = line.split()[0]
        # Both signals end the watch the same way: the cursor on stderr, exit 0.
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    [cursor_line] = err.splitlines()
    printed = cursor_line.removeprefix("cursor: ")
    assert decode_cursor(printed) >= decode_cursor(cursor)


def test_reap_once(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    rid = pg_store.ensure_resource("run", "reap")
    assert pg_store.claim(rid, Owner("host", "a"), 0.05) is not None
    time.sleep(0.1)
    out = _run(pg_dsn, schema, "reap", "--once")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reaped 1 leases"
    assert [e.type for e in pg_store.events(rid)] == ["lease.claimed", "lease.expired"]
