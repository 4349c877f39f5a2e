"""Session files shared by real OS processes: lease hand-over and SIGKILL mid-fork."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pglease.sessions import (
    AppendEntry,
    SessionAlreadyClaimedError,
    SessionRepository,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="uses POSIX signals")


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


HOLDER = """
import sys
from pglease.sessions import SessionRepository, WriterLeaseLostError

repo = SessionRepository(sys.argv[1], lease_seconds=1.0, renew_interval=0.2)
session = repo.open("shared")
print("READY", session.fence, session.owner_id, flush=True)
sys.stdin.readline()
try:
    session.append_message(None, {"role": "user", "content": "late"})
    print("COMMITTED", flush=True)
except WriterLeaseLostError as exc:
    print("LOST", exc, flush=True)
session.close()
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _file_locked(path: Path) -> bool:
    probe = sqlite3.connect(path, timeout=0.2, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        probe.close()


def freeze_between_transactions(pid: int, path: Path) -> None:
    """SIGSTOP `pid` at an instant it holds no lock on the file.

    A process frozen inside its renewal transaction keeps the SQLite file
    locked (the successor then gets SessionFileBusyError, rightly); the test
    is about a holder frozen between renewals, so freeze it again until it is.
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        os.kill(pid, signal.SIGSTOP)
        while not _stopped(pid):
            time.sleep(0.001)
        if not _file_locked(path):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the holder never let go of the file's write lock")


def test_second_process_takes_over_after_expiry(tmp_path: Path) -> None:
    repo = SessionRepository(tmp_path, lease_seconds=5.0, renew_interval=1.0)
    repo.create("shared").close()
    holder = spawn(HOLDER, str(tmp_path))
    try:
        assert holder.stdout is not None and holder.stdin is not None
        ready = holder.stdout.readline().split()
        assert ready[:1] == ["READY"], holder.stderr.read() if holder.stderr else ""
        fence, owner = int(ready[1]), ready[2]
        # the holder renews every 0.2 s: its 1 s lease stays live
        time.sleep(1.2)
        with pytest.raises(SessionAlreadyClaimedError, match=f"already claimed by writer {owner}"):
            repo.open("shared")
        # freeze the holder (a GC pause, a stopped VM): its lease runs out
        freeze_between_transactions(holder.pid, tmp_path / "shared.sqlite")
        try:
            time.sleep(1.3)
            successor = repo.open("shared")
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        assert successor.fence == fence + 1
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, err = holder.communicate(timeout=30)
        assert out.startswith("LOST"), (out, err)
        assert "writer lease was lost" in out
        assert holder.returncode == 0, err
        # the stale holder's close did not release the successor's lease
        entry = successor.append_message(None, {"role": "user", "content": "mine now"})
        assert [e.id for e in successor.scan_entries()] == [entry.id]
        listing = repo.list()
        (info,) = listing.sessions
        assert info.lease is not None and info.lease.owner_id == successor.owner_id
        successor.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


FORKER = """
import sys
from pglease.sessions import SessionRepository

repo = SessionRepository(sys.argv[1], renew_interval=None)
print("FORKING", flush=True)
repo.fork("big", scope="tree", id="copy").close()
print("DONE", flush=True)
"""


def build_big(repo: SessionRepository, count: int) -> None:
    with repo.create("big") as session:
        writes: list[AppendEntry] = []
        for i in range(count):
            parent = None if i == 0 else f"e{i - 1 if i % 10 else i // 2}"
            content = {"role": "user", "content": "x" * 100}
            writes.append(AppendEntry("message", parent, {"message": content}, id=f"e{i}"))
        session.commit(writes)


@pytest.mark.parametrize("delay", [0.0, 0.15])
def test_sigkill_mid_fork_leaves_nothing_listed(tmp_path: Path, delay: float) -> None:
    repo = SessionRepository(tmp_path, renew_interval=None)
    build_big(repo, 8000)
    forker = spawn(FORKER, str(tmp_path))
    try:
        assert forker.stdout is not None
        assert forker.stdout.readline().strip() == "FORKING"
        deadline = time.monotonic() + 20
        while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
            assert forker.poll() is None, "fork finished before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(delay)
        forker.send_signal(signal.SIGKILL)
        forker.wait(timeout=10)
    finally:
        if forker.poll() is None:
            forker.kill()
            forker.wait()
    assert forker.returncode == -signal.SIGKILL
    listing = repo.list()
    assert listing.ids() == ["big"]
    assert listing.problems == []
    assert not (tmp_path / "copy.sqlite").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.startswith("big.sqlite")]
    assert leftovers and all(name.startswith(".copy.") for name in leftovers)
    # the id is still free: a new fork succeeds
    with repo.fork("big", scope="tree", id="copy") as copy:
        assert copy.stats().message_count == 8000
