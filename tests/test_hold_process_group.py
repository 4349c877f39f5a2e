"""`pglease hold` / `pglease elect -- CMD` stop everything the command started.

Real processes: a shell's background jobs (grandchildren of the runner), a
pipeline, members that ignore SIGTERM. The processes are found by walking
the runner's descendants in /proc once they are up, so a member that the
runner never signals is still watched. The rival claims in a loop and looks
at the processes right after its claim is granted: the grant comes after the
runner's release, which comes after the group is gone, so every one of them
must be dead by then (processes do not come back), without any timing
assumption.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psycopg
import pytest

from pglease import Claim, Owner, PostgresStore, resource_id
from pglease.admin import revoke_lease
from pglease.runtime.election import ELECTION_TYPE

from .test_cli import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

RIVAL = Owner("host", "rival")
DEADLINE = 90.0
#: Background jobs: two sleeps, grandchildren once the shell forked them.
GRANDCHILDREN = "sleep 300 & sleep 301 & wait"
#: A pipeline: both stages in the command's group.
PIPELINE = "sleep 302 | sleep 303"
#: Everyone ignores SIGTERM (an ignored signal stays ignored across exec).
DEAF = "trap '' TERM; sleep 304 & sleep 305 & wait"


def _stat(pid: int) -> list[str] | None:
    """(state, ppid, pgrp, ...) of `pid`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _descendants(root: int) -> dict[int, str]:
    """Live descendants of `root`: pid -> command name."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        names[int(entry)] = name
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = names[child]
            todo.append(child)
    return found


def _sleeps(runner: subprocess.Popen[str], count: int) -> list[int]:
    """The pids of the command's `sleep` processes, once all `count` are up."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        assert runner.poll() is None, runner.communicate()
        sleeps = [pid for pid, name in _descendants(runner.pid).items() if name == "sleep"]
        if len(sleeps) >= count:
            return sleeps
        time.sleep(0.05)
    pytest.fail("the command's processes never started")


def _hold(store: PostgresStore, command: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pglease", "--dsn", store.dsn, "--schema", store.schema,
         "hold", "job", "pg", "--owner", "host:h1", *extra, "--", "sh", "-c", command],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _rival_claims(store: PostgresStore, rid: str, pids: list[int]) -> Claim:
    """Claim as soon as the database allows; every process must be dead by then.

    Looked at right after the grant: the runner releases only once the group is
    gone and the grant comes after that release, so a process seen alive here
    (processes do not come back) ran while the rival held the lease. A look
    before the attempt would race with the group dying in between.
    """
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        claim = store.claim(rid, RIVAL, 60)
        if claim is not None:
            running = [pid for pid in pids if _running(pid)]
            assert running == [], f"claimed while {running} still ran"
            return claim
        time.sleep(0.02)
    pytest.fail("the rival never got the lease")


def _revoke(store: PostgresStore, rid: str) -> datetime:
    """Revoke the lease; return the revoked holder's last expiry."""
    with store.connection() as conn:
        row = conn.execute(
            f'SELECT expires_at FROM "{store.schema}".leases WHERE resource_id = %s', [rid]
        ).fetchone()
    assert row is not None and row[0] is not None
    with psycopg.connect(store.dsn, autocommit=True) as conn:
        assert revoke_lease(conn, store.schema, rid).revoked
    return row[0]  # type: ignore[no-any-return]


def _acquired_at(store: PostgresStore, rid: str) -> datetime:
    with store.connection() as conn:
        row = conn.execute(
            f'SELECT acquired_at FROM "{store.schema}".leases WHERE resource_id = %s', [rid]
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _kill_all(runner: subprocess.Popen[str], pids: list[int]) -> None:
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    if runner.poll() is None:
        runner.kill()
        runner.wait(30)


def _loss_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "lost" in line or "no longer" in line]


@pytest.mark.parametrize(
    ("command", "count"), [(GRANDCHILDREN, 2), (PIPELINE, 2), (DEAF, 2)], ids=["bg", "pipe", "deaf"]
)
def test_revoke_stops_the_whole_group_before_a_rival_claims(
    pg_store: PostgresStore, command: str, count: int
) -> None:
    runner = _hold(pg_store, command, "--ttl", "3")
    pids: list[int] = []
    try:
        pids = _sleeps(runner, count)
        rid = resource_id("job", "pg")
        expiry = _revoke(pg_store, rid)
        claim = _rival_claims(pg_store, rid, pids)
        _, err = runner.communicate(timeout=DEADLINE)
    finally:
        _kill_all(runner, pids)
    assert runner.returncode == 75, err
    assert claim.generation == 3  # 1 held, 2 revoked
    # The database let nobody in before the revoked holder's last expiry.
    assert _acquired_at(pg_store, rid) >= expiry
    # The loss is told once, on one line.
    assert len(_loss_lines(err)) == 1, err


@pytest.mark.parametrize(
    ("command", "count"), [(GRANDCHILDREN, 2), (PIPELINE, 2), (DEAF, 2)], ids=["bg", "pipe", "deaf"]
)
def test_sigterm_to_the_runner_stops_the_group_before_it_releases(
    pg_store: PostgresStore, command: str, count: int
) -> None:
    # ttl 6: kill-after may be up to 6 - 0.6 - 2 x 2 = 1.4 s.
    runner = _hold(pg_store, command, "--ttl", "6", "--kill-after", "1")
    pids: list[int] = []
    try:
        pids = _sleeps(runner, count)
        rid = resource_id("job", "pg")
        runner.send_signal(signal.SIGTERM)
        claim = _rival_claims(pg_store, rid, pids)
        _, err = runner.communicate(timeout=DEADLINE)
    finally:
        _kill_all(runner, pids)
    assert claim.generation == 2
    # The command's own end: SIGTERM, or SIGKILL when it ignored SIGTERM.
    expected = signal.SIGKILL if command == DEAF else signal.SIGTERM
    assert runner.returncode == 128 + expected, err
    assert "Traceback" not in err


def test_processes_left_by_a_command_that_exits_are_stopped_before_release(
    pg_store: PostgresStore,
) -> None:
    runner = _hold(pg_store, "sleep 306 & sleep 307 & sleep 0.5; exit 3", "--ttl", "6")
    pids: list[int] = []
    try:
        pids = _sleeps(runner, 2)
        pids = [pid for pid in pids if "306" in _cmdline(pid) or "307" in _cmdline(pid)]
        assert len(pids) == 2
        claim = _rival_claims(pg_store, resource_id("job", "pg"), pids)
        _, err = runner.communicate(timeout=DEADLINE)
    finally:
        _kill_all(runner, pids)
    assert claim.generation == 2
    assert runner.returncode == 3, err  # the command's own code
    assert "left processes in its group" in err


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def test_elect_command_group_is_stopped_before_the_next_leader(
    pg_store: PostgresStore,
) -> None:
    runner = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--dsn", pg_store.dsn, "--schema", pg_store.schema,
         "elect", "sched", "--owner", "host:a", "--ttl", "3", "--", "sh", "-c", GRANDCHILDREN],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pids: list[int] = []
    try:
        pids = _sleeps(runner, 2)
        rid = resource_id(ELECTION_TYPE, "sched")
        resigned = subprocess.run(
            [sys.executable, "-m", "pglease", "--dsn", pg_store.dsn, "--schema",
             pg_store.schema, "resign", "sched"],
            cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE,
        )  # fmt: skip
        assert resigned.returncode == 0, resigned.stderr
        claim = _rival_claims(pg_store, rid, pids)
        _, err = runner.communicate(timeout=DEADLINE)
    finally:
        _kill_all(runner, pids)
    assert claim.generation == 3
    assert runner.returncode == 75, err
    lines = _loss_lines(err)
    assert len(lines) == 1, err
    assert "lost" in lines[0]
