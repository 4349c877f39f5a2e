"""PostgreSQL sessions shared by real OS processes: "already held", takeover, fencing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pglease import PostgresStore
from pglease.sessions import PostgresSessionRepository, SessionAlreadyClaimedError

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


OPENER = """
import sys
from pglease import PostgresStore
from pglease.sessions import PostgresSessionRepository, SessionAlreadyClaimedError

with PostgresStore(sys.argv[1], schema=sys.argv[2], max_size=2) as store:
    repo = PostgresSessionRepository(store, renew_interval=None)
    try:
        repo.open("shared").close()
        print("OPENED", flush=True)
    except SessionAlreadyClaimedError as exc:
        print("HELD", exc, flush=True)
"""


def test_second_process_gets_already_held(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    repo = PostgresSessionRepository(pg_store, renew_interval=None)
    holder = repo.create("shared")
    out, err = spawn(OPENER, pg_dsn, schema).communicate(timeout=60)
    assert out.startswith("HELD"), (out, err)
    assert f"already claimed by writer {holder.owner_id}" in out
    assert f"already held by session:{holder.owner_id}" in out
    holder.close()
    out, err = spawn(OPENER, pg_dsn, schema).communicate(timeout=60)
    assert out.startswith("OPENED"), (out, err)


HOLDER = """
import sys
from pglease import PostgresStore
from pglease.sessions import PostgresSessionRepository, WriterLeaseLostError

with PostgresStore(sys.argv[1], schema=sys.argv[2], max_size=2) as store:
    repo = PostgresSessionRepository(store, lease_seconds=1.0, renew_interval=0.2)
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


def test_takeover_after_expiry_across_processes(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    repo = PostgresSessionRepository(pg_store, lease_seconds=5.0, renew_interval=1.0)
    repo.create("shared").close()
    holder = spawn(HOLDER, pg_dsn, schema)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        ready = holder.stdout.readline().split()
        assert ready[:1] == ["READY"], holder.stderr.read() if holder.stderr else ""
        fence, owner = int(ready[1]), ready[2]
        # the holder renews every 0.2 s: its 1 s lease stays live
        time.sleep(1.3)
        with pytest.raises(SessionAlreadyClaimedError, match=f"already claimed by writer {owner}"):
            repo.open("shared")
        # freeze the holder (a GC pause, a stopped VM): its lease runs out
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            time.sleep(1.4)
            successor = repo.open("shared")
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        assert successor.fence == fence + 1
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, err = holder.communicate(timeout=60)
        assert out.startswith("LOST"), (out, err)
        assert "writer lease was lost" in out
        assert holder.returncode == 0, err
        # the stale holder wrote nothing and did not release the successor's lease
        assert successor.scan_entries() == []
        entry = successor.append_message(None, {"role": "user", "content": "mine now"})
        assert [e.id for e in successor.scan_entries()] == [entry.id]
        (info,) = repo.list().sessions
        assert info.lease is not None and info.lease.owner_id == successor.owner_id
        successor.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
