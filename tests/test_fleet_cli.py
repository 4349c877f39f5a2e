"""`pglease hold` as a real OS process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

from pglease import Owner, PostgresStore, resource_id


def _hold(dsn: str, schema: str, *command: str, ttl: str = "6") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pglease", "--dsn", dsn, "--schema", schema, "hold", "job", "j1",
         "--owner", "host:cli", "--ttl", ttl, "--", *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_hold_runs_command_with_fence_and_releases(pg_store: PostgresStore) -> None:
    script = "import os, sys; print(os.environ['PGLEASE_FENCE']); sys.exit(7)"
    proc = _hold(pg_store.dsn, pg_store.schema, sys.executable, "-c", script)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert out.strip() == "1"
    state = pg_store.get(resource_id("job", "j1"))
    assert not state.lease.held and state.lease.generation == 1


def test_hold_stops_command_when_lease_lost(pg_store: PostgresStore) -> None:
    script = "import time; print('up', flush=True); time.sleep(120)"
    proc = _hold(pg_store.dsn, pg_store.schema, sys.executable, "-c", script)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    rid = resource_id("job", "j1")
    far = datetime.now(UTC) + timedelta(days=1)
    assert pg_store.claim(rid, Owner("host", "other"), 60, now=far) is not None
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "lost" in err


def test_sigterm_is_forwarded_and_lease_released(pg_store: PostgresStore) -> None:
    script = "import time; print('up', flush=True); time.sleep(120)"
    proc = _hold(pg_store.dsn, pg_store.schema, sys.executable, "-c", script)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not pg_store.get(resource_id("job", "j1")).lease.held


def test_hold_timeout_exit_code(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("job", "j1")
    assert pg_store.claim(rid, Owner("host", "other"), 60) is not None
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", pg_store.dsn, "--schema", pg_store.schema,
         "hold", "job", "j1", "--owner", "host:cli", "--ttl", "3", "--timeout", "0.5", "--",
         "true"],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - start < 50
