"""The CLI never ends in a traceback: a closed stdout, SIGTERM to a long-running command."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from pglease import Owner, PostgresStore
from pglease.watch.reaper import REAPER_RESOURCE

from .test_cli import ROOT

#: More table than a pipe buffers (64 KiB), so `ls` is still writing when the reader leaves.
ROWS = 2000


def test_ls_into_a_closed_pipe_exits_quietly(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    with pg_store.connection() as conn:
        conn.execute(
            f"SELECT {schema}.ensure_resource('run', 'key-' || g) FROM generate_series(1, %s) g",
            [ROWS],
        )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, "ls"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        header = proc.stdout.readline()  # `| head -1`
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert header.startswith("TYPE")
    assert proc.returncode in (0, 141)
    assert err == ""


def test_sigterm_stops_reap_like_ctrl_c(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema, "reap",
         "--owner", "host:reaper", "--interval", "0.05"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # The reaper is running once it holds its election lease: wait for that.
        rid = pg_store.ensure_resource(*REAPER_RESOURCE)
        deadline = time.monotonic() + 30
        while not pg_store.get(rid).lease.held and proc.poll() is None:
            assert time.monotonic() < deadline, "the reaper never took its lease"
            time.sleep(0.05)  # a bounded poll of the database state
        assert proc.poll() is None, proc.communicate()[1]
        assert pg_store.get(rid).lease.owner == Owner("host", "reaper")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert err.startswith("reaped ") and "Traceback" not in err
    # It left the way Ctrl-C leaves: its election lease released, not left to expire.
    assert not pg_store.get(rid).lease.held
