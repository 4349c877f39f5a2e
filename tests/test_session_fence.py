"""A session's writer fence never goes back: it rises across clean closes,
crashes (a real process killed while holding), expiry takeovers and reopens,
like a lease generation, on session files and in PostgreSQL. `handle.fence` is
a token callers pass downstream, so one value must never name two writers."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pglease import PostgresStore
from pglease.sessions import (
    PostgresSessionRepository,
    SessionAlreadyClaimedError,
    SessionRepository,
)

from .test_session_processes import spawn

Action = Literal["close", "commit", "crash"]


class Clock:
    """A session file's clock (Unix ms), moved by hand."""

    def __init__(self, now: int = 1_700_000_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def lease_row(path: Path) -> tuple[str, int, int] | None:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT owner_id, fence, expires_at_ms FROM writer_lease").fetchone()
    finally:
        conn.close()
    return None if row is None else (str(row[0]), int(row[1]), int(row[2]))


@pytest.fixture
def pg_repo(pg_store: PostgresStore) -> Iterator[PostgresSessionRepository]:
    with PostgresSessionRepository(pg_store, lease_seconds=0.3, renew_interval=None) as repo:
        yield repo


# --- the reproduction of issue 23 ---------------------------------------------------------


def test_a_file_fence_rises_after_a_clean_close(tmp_path: Path) -> None:
    clock = Clock()
    r = SessionRepository(tmp_path, lease_seconds=0.3, renew_interval=None, now_ms=clock)
    a = r.create("s")
    clock.advance(400)  # a's lease runs out
    b = r.open("s")
    b.close()
    c = r.open("s")
    # Before: 1, 2, then 1 again (the release deleted the row, fence and all).
    assert (a.fence, b.fence, c.fence) == (1, 2, 3)
    c.close()
    a.close()  # a stale holder's close releases nothing of its successors'
    # Released: the holder cleared, the fence kept for the next claim.
    assert lease_row(r.path_for("s")) == ("", 3, 0)
    assert r.list().sessions[0].lease is None  # nobody holds it
    with r.open("s") as d:
        assert d.fence == 4
    r.close()


def test_a_postgres_fence_rises_after_a_clean_close(
    pg_repo: PostgresSessionRepository,
) -> None:
    a = pg_repo.create("s")
    time.sleep(0.6)  # a's 0.3 s lease runs out (judged by the database clock)
    b = pg_repo.open("s")
    b.close()
    c = pg_repo.open("s")
    assert (a.fence, b.fence, c.fence) == (1, 2, 3)
    c.close()
    a.close()
    with pg_repo.open("s") as d:
        assert d.fence == 4


# --- crashes: a real process killed while it holds the lease ---------------------------------


FILE_HOLDER = """
import sys
from pglease.sessions import SessionRepository

repo = SessionRepository(sys.argv[1], lease_seconds=1.0, renew_interval=0.2)
session = repo.open("shared")
session.append_message(None, {"role": "user", "content": "held"})
print("READY", session.fence, flush=True)
sys.stdin.readline()  # held (and renewed) until killed
"""

PG_HOLDER = """
import sys
from pglease import PostgresStore
from pglease.sessions import PostgresSessionRepository

with PostgresStore(sys.argv[1], schema=sys.argv[2], max_size=2) as store:
    repo = PostgresSessionRepository(store, lease_seconds=1.0, renew_interval=0.2)
    session = repo.open("shared")
    session.append_message(None, {"role": "user", "content": "held"})
    print("READY", session.fence, flush=True)
    sys.stdin.readline()  # held (and renewed) until killed
"""


def kill_holder(script: str, *args: str) -> int:
    """Start a process that opens session "shared", SIGKILL it while it holds
    the lease; the fence it held."""
    holder = spawn(script, *args)
    try:
        assert holder.stdout is not None
        ready = holder.stdout.readline().split()
        assert ready[:1] == ["READY"], holder.stderr.read() if holder.stderr else ""
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
        return int(ready[1])
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


pytestmark_posix = pytest.mark.skipif(sys.platform == "win32", reason="uses POSIX signals")


@pytestmark_posix
def test_a_file_fence_rises_after_a_killed_holder(tmp_path: Path) -> None:
    SessionRepository(tmp_path, renew_interval=None).create("shared").close()  # fence 1
    held = kill_holder(FILE_HOLDER, str(tmp_path))
    assert held == 2  # the close of fence 1 did not send the next claim back to 1
    # The dead holder's lease runs out at its recorded expiry: a clock 5 s
    # ahead of the wall clock is past it without waiting.
    ahead = SessionRepository(
        tmp_path, renew_interval=None, now_ms=lambda: int(time.time() * 1000) + 5_000
    )
    with ahead.open("shared") as successor:
        assert successor.fence == held + 1
        assert [e.payload["message"]["content"] for e in successor.scan_entries()] == ["held"]
    with ahead.open("shared") as again:
        assert again.fence == held + 2
    ahead.close()


def open_when_free(repo: PostgresSessionRepository, session_id: str) -> Any:
    """Open `session_id` as soon as its (dead) holder's lease has run out."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return repo.open(session_id)
        except SessionAlreadyClaimedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytestmark_posix
def test_a_postgres_fence_rises_after_a_killed_holder(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    repo = PostgresSessionRepository(pg_store, renew_interval=None)
    repo.create("shared").close()  # fence 1
    held = kill_holder(PG_HOLDER, pg_dsn, schema)
    assert held == 2
    with open_when_free(repo, "shared") as successor:
        assert successor.fence == held + 1
    with repo.open("shared") as again:
        assert again.fence == held + 2
    repo.close()


# --- any sequence of closes, commits and crashes: strictly increasing fences ------------------


def run_cycles(
    open_session: Callable[[], Any], let_expire: Callable[[], None], actions: list[Action]
) -> list[int]:
    """Open the session once per action and end each holder as the action
    says: `close`, `commit` (write, then close) or `crash` (abandoned while
    holding: its lease runs out). The fences handed out, in order."""
    fences: list[int] = []
    abandoned: list[Any] = []
    for action in actions:
        handle = open_session()
        fences.append(handle.fence)
        if action == "crash":
            abandoned.append(handle)
            let_expire()
        else:
            if action == "commit":
                handle.append_message(None, msg(f"by fence {handle.fence}"))
            handle.close()
    last = open_session()
    fences.append(last.fence)
    last.close()
    for handle in abandoned:
        handle.close()  # stale: releases nothing of its successors'
    return fences


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["close", "commit", "crash"]), min_size=1, max_size=12))
def test_file_fences_strictly_increase(actions: list[Action]) -> None:
    clock = Clock()
    with tempfile.TemporaryDirectory() as directory:
        repo = SessionRepository(directory, lease_seconds=0.3, renew_interval=None, now_ms=clock)
        repo.create("s").close()
        fences = run_cycles(lambda: repo.open("s"), lambda: clock.advance(301), actions)
        repo.close()
    assert all(a < b for a, b in itertools.pairwise(fences)), fences
    assert fences[0] == 2  # the create had fence 1


def test_postgres_fences_strictly_increase(pg_repo: PostgresSessionRepository) -> None:
    pg_repo.create("s").close()
    actions: list[Action] = ["close", "crash", "commit", "crash", "crash", "close", "commit"]
    fences = run_cycles(lambda: open_when_free(pg_repo, "s"), lambda: time.sleep(0.4), actions)
    assert all(a < b for a, b in itertools.pairwise(fences)), fences
    assert fences[0] == 2
