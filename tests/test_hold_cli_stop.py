"""`pglease hold` stops its command before another host can claim the lease.

The command is a real child that ignores SIGTERM and appends its wall-clock
time (CLOCK_REALTIME) to a file every 20 ms; the rival's claim time comes from
the database clock, the same host's clock. The tests assert order (the
child's last write came before the rival's claim), never durations, and they
check the child outlived its SIGTERM or the runner's freeze, so an early
death cannot make them pass.

Timing: ttl 9 s, interval 2.5 s, margin 1.5 s, --kill-after 2.4 s: a grace
longer than the margin, which is what let the command outlive the lease
before (SIGTERM at the window's close, SIGKILL 2.4 s later, a claim possible
1.5 s after the close).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from pglease import Claim, Owner, PostgresStore, resource_id
from pglease.runtime import acquire

TTL, INTERVAL, MARGIN, GRACE = "9", "2.5", "1.5", "2.4"
RIVAL = Owner("host", "rival")
#: Ignores SIGTERM; first line its pid, then its wall-clock time every 20 ms.
CHILD = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a", buffering=1) as f:
    f.write(f"pid {os.getpid()}\n")
    while True:
        f.write(f"{time.time():.6f}\n")
        time.sleep(0.02)
"""


def _runner(store: PostgresStore, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pglease", "--dsn", store.dsn, "--schema", store.schema,
            "hold", "job", "j1", "--owner", "host:cli", *extra]  # fmt: skip


def _start(store: PostgresStore, out: Path) -> tuple[subprocess.Popen[str], int]:
    """The runner with the SIGTERM-ignoring child; returns (runner, child pid)."""
    runner = subprocess.Popen(
        [*_runner(store, "--ttl", TTL, "--interval", INTERVAL, "--margin", MARGIN,
                  "--kill-after", GRACE),
         "--", sys.executable, "-c", CHILD, str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    end = time.monotonic() + 60
    while time.monotonic() < end and len(_lines(out)) < 3:
        assert runner.poll() is None, runner.communicate()
        time.sleep(0.02)
    lines = _lines(out)
    assert len(lines) >= 3, "the child never started writing"
    return runner, int(lines[0].split()[1])


def _lines(out: Path) -> list[str]:
    try:
        text = out.read_text()
    except FileNotFoundError:
        return []
    # The last line may be half written.
    return text.split("\n")[:-1]


def _writes(out: Path) -> list[float]:
    return [float(line) for line in _lines(out)[1:]]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _db_now(store: PostgresStore) -> datetime:
    with store.connection() as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _lease_row(store: PostgresStore, rid: str) -> tuple[int, datetime | None, datetime | None]:
    """(generation, acquired_at, expires_at) by the database."""
    with store.connection() as conn:
        row = conn.execute(
            f'SELECT generation, acquired_at, expires_at FROM "{store.schema}".leases'
            " WHERE resource_id = %s",
            [rid],
        ).fetchone()
    assert row is not None
    return int(row[0]), row[1], row[2]


def _sleep_until_db(store: PostgresStore, when: datetime) -> None:
    """Sleep until the database clock reads `when` (the same host's clock)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        left = (when - _db_now(store)).total_seconds()
        if left <= 0:
            return
        time.sleep(min(left, 0.2))
    pytest.fail("the database clock never reached the target")


class _Rival:
    """Another host: claims the lease as soon as the database lets it."""

    def __init__(self, store: PostgresStore) -> None:
        self.claim: Claim | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(store,), daemon=True)
        self._thread.start()

    def _run(self, store: PostgresStore) -> None:
        try:
            self.claim = acquire(store, "job", "j1", RIVAL, 60, timeout=90)
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self) -> Claim:
        self._thread.join(120)
        assert self.error is None, self.error
        assert self.claim is not None
        return self.claim


def _stderr_lines(runner: subprocess.Popen[str]) -> Iterator[tuple[float, str]]:
    assert runner.stderr is not None
    for line in runner.stderr:
        yield time.time(), line


def test_command_dead_before_rival_claims_when_beats_fail(
    pg_store: PostgresStore, tmp_path: Path
) -> None:
    """Beats fail (the row is locked: 'busy'), the runner stays up: SIGTERM
    ahead of the window's close is ignored, SIGKILL at the close ends it."""
    out = tmp_path / "writes"
    runner, pid = _start(pg_store, out)
    rid = resource_id("job", "j1")
    stderr: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: stderr.extend(_stderr_lines(runner)), daemon=True)
    reader.start()
    with psycopg.connect(pg_store.dsn) as blocker:
        # From here every beat finds the row locked; the expiry stays put.
        row = blocker.execute(
            f'SELECT expires_at FROM "{pg_store.schema}".leases WHERE resource_id = %s FOR UPDATE',
            [rid],
        ).fetchone()
        assert row is not None
        expires_at: datetime = row[0]
        locked_at = time.time()
        rival = _Rival(pg_store)  # queues behind the lock, then waits for the expiry
        # Let go just before the database would allow a takeover, so the lock
        # delays nobody: the rival claims at the earliest the database allows.
        _sleep_until_db(pg_store, expires_at - timedelta(seconds=0.1))
        blocker.rollback()
    claim = rival.result()
    runner.wait(60)
    reader.join(10)
    generation, acquired_at, _ = _lease_row(pg_store, rid)
    assert generation == claim.generation == 2
    assert acquired_at is not None
    writes = _writes(out)
    assert runner.returncode == 75, stderr
    # It was running while its lease was in danger, and it outlived the SIGTERM.
    stopping = [t for t, line in stderr if "stopping the command" in line]
    assert stopping, stderr
    assert max(writes) > locked_at
    assert max(writes) > stopping[0], "the child must have ignored SIGTERM"
    assert not _alive(pid)
    # The guarantee: dead before anyone else could claim.
    assert max(writes) < acquired_at.timestamp(), (max(writes), acquired_at)


def test_command_dead_before_rival_claims_after_runner_froze(
    pg_store: PostgresStore, tmp_path: Path
) -> None:
    """The runner is frozen (SIGSTOP) past its trust window and thawed before the
    database expiry: it must kill the command at once, not SIGTERM it and wait."""
    out = tmp_path / "writes"
    runner, pid = _start(pg_store, out)
    rid = resource_id("job", "j1")
    runner.send_signal(signal.SIGSTOP)
    try:
        rival = _Rival(pg_store)
        # A beat sent just before the freeze may still land: wait for the
        # expiry to settle, and check it again right before the thaw.
        expires_at = _lease_row(pg_store, rid)[2]
        while True:
            time.sleep(0.3)
            again = _lease_row(pg_store, rid)[2]
            if again == expires_at:
                break
            expires_at = again
        assert expires_at is not None
        # The runner's window closed at least `margin` before the expiry;
        # thaw halfway between.
        thaw = expires_at - timedelta(seconds=float(MARGIN) / 2)
        _sleep_until_db(pg_store, thaw)
        assert _lease_row(pg_store, rid)[2] == expires_at, "frozen runners do not renew"
        assert _alive(pid), "the child runs on while its runner is frozen"
        thawed_at = time.time()
    finally:
        runner.send_signal(signal.SIGCONT)
    claim = rival.result()
    _, err = runner.communicate(timeout=60)
    generation, acquired_at, _ = _lease_row(pg_store, rid)
    assert generation == claim.generation == 2 and acquired_at is not None
    writes = _writes(out)
    assert runner.returncode == 75, err
    assert max(writes) > thawed_at - 1.0  # it was writing up to the thaw
    assert not _alive(pid)
    assert max(writes) < acquired_at.timestamp(), (max(writes), acquired_at, err)


# --------------------------------------------------------------------------- usage


def test_kill_after_beyond_the_bound_is_a_usage_error(pg_store: PostgresStore) -> None:
    proc = subprocess.run(
        [*_runner(pg_store, "--ttl", "1.5", "--kill-after", "5"), "--", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "ttl - margin - 2 x interval" in proc.stderr and "0.35s" in proc.stderr
    assert pg_store.list_resources() == []  # refused before anything was claimed


@pytest.mark.parametrize("kind", ["missing", "not-executable", "missing-on-path", "directory"])
def test_command_that_cannot_run(pg_store: PostgresStore, tmp_path: Path, kind: str) -> None:
    if kind == "missing":
        command, code = "/nonexistent", 127
    elif kind == "missing-on-path":
        command, code = "no-such-command-pglease", 127
    elif kind == "directory":
        (tmp_path / "adir").mkdir()
        command, code = "./adir", 126
    else:
        script = tmp_path / "not-executable-file"
        script.write_text("#!/bin/sh\necho hi\n")
        os.chmod(script, 0o644)
        command, code = "./not-executable-file", 126
    proc = subprocess.run(
        [*_runner(pg_store, "--ttl", "5"), "--", command],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pglease: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    # Checked before the claim: no generation burnt, no event written.
    assert pg_store.list_resources() == []
