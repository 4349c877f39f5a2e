"""File-session leases under the repository's keeper (pglease.runtime), both flavours.

The keeper runs on a `FakeClock`, so a beat happens when a test moves the
clock, never by a sleep; every wait for its effect is bounded. The file's own
expiry clock (`now_ms`) is the wall clock unless a test says otherwise.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pglease.clock import FakeClock
from pglease.errors import LeaseLostError
from pglease.sessions import AsyncSessionRepository, SessionRepository, WriterLeaseLostError

from ._blocking import FLAVOURS, Blocking, LoopThread

ROOT = Path(__file__).resolve().parent.parent
WAIT = 30.0  # generous bound for the keeper's thread (task) to act on a loaded host

MakeRepo = Callable[..., Any]


@pytest.fixture(params=FLAVOURS)
def make_repo(request: pytest.FixtureRequest) -> Iterator[MakeRepo]:
    """`make_repo(directory, **options)`: a file-session repository of the
    flavour, as a blocking object (the asyncio one through `Blocking`)."""
    made: list[Any] = []
    loop = LoopThread() if request.param == "async" else None

    def make(directory: Path, **options: Any) -> Any:
        if loop is None:
            repo: Any = SessionRepository(directory, **options)
        else:

            async def build() -> AsyncSessionRepository:
                return AsyncSessionRepository(directory, **options)

            repo = Blocking(loop.run(build()), loop)
        made.append(repo)
        return repo

    try:
        yield make
    finally:
        for repo in reversed(made):
            repo.close()
        if loop is not None:
            loop.close()


def file_clock(clock: FakeClock) -> Callable[[], int]:
    """The files' expiry clock on the same fake time as the keeper's: a slow
    host cannot run a lease out between two beats a test makes."""
    return lambda: int(clock.time() * 1000)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def lease_row(path: Path) -> tuple[str, int, int] | None:
    """The file's writer lease row (owner, fence, expiry), None without one."""
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT owner_id, fence, expires_at_ms FROM writer_lease").fetchone()
    finally:
        conn.close()
    return None if row is None else (str(row[0]), int(row[1]), int(row[2]))


def expiry(path: Path) -> int:
    row = lease_row(path)
    assert row is not None
    return row[2]


TAKE_OVER = """
import sys, time
from pglease.sessions import SessionRepository

# Two minutes ahead: the first writer's lease (30 s) looks run out to us.
repo = SessionRepository(
    sys.argv[1], renew_interval=None, now_ms=lambda: time.time_ns() // 1_000_000 + 120_000
)
handle = repo.open("taken")
print(handle.fence, handle.owner_id, flush=True)
"""  # exits without closing: the row stays the new writer's


def test_a_lease_taken_over_by_another_process_is_lost_at_the_next_beat(
    tmp_path: Path, make_repo: MakeRepo
) -> None:
    clock = FakeClock()
    lost: list[str] = []
    repo = make_repo(
        tmp_path,
        lease_seconds=30,
        renew_interval=10,
        clock=clock,
        on_lost=lambda h: lost.append(h.id),
    )
    session = repo.create("taken")
    root = session.append_message(None, {"role": "user", "content": "mine"})
    keeper = repo.keeper
    assert keeper is not None and len(keeper) == 1

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TAKE_OVER), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    fence, owner = done.stdout.split()
    assert int(fence) == session.fence + 1
    assert not session.lost.is_set()  # no beat yet: nothing is known

    clock.advance(10)  # the next beat is due
    wait_for(session.lost.is_set, "the beat to report the takeover")
    assert lost == ["taken"]
    assert len(keeper) == 0  # never renewed again
    assert keeper.stats.lost == 1
    with pytest.raises(WriterLeaseLostError, match="writer lease was lost") as caught:
        session.append_message(root.id, {"role": "user", "content": "late"})
    assert isinstance(caught.value, LeaseLostError)
    # The beat changed nothing: the row is still the new writer's.
    successor = lease_row(tmp_path / "taken.sqlite")
    assert successor is not None and successor[:2] == (owner, int(fence))
    session.close()  # never raises, never deletes the successor's lease
    assert lease_row(tmp_path / "taken.sqlite") == successor
    assert lost == ["taken"]  # once


def _blocker(path: Path) -> sqlite3.Connection:
    """Another connection holding the file's write lock."""
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    return blocker


def test_a_beat_on_a_locked_file_retries_until_the_trust_window_closes(
    tmp_path: Path, make_repo: MakeRepo
) -> None:
    clock = FakeClock()
    lost: list[str] = []
    # margin = min(3 / 10, 1 / 2) = 0.3: trusted until 2.7 s after the claim.
    repo = make_repo(
        tmp_path,
        lease_seconds=3,
        renew_interval=1,
        busy_timeout=0.1,
        clock=clock,
        now_ms=file_clock(clock),
        on_lost=lambda h: lost.append(h.id),
    )
    session = repo.create("locked")
    keeper = repo.keeper
    assert keeper is not None
    path = tmp_path / "locked.sqlite"
    before = lease_row(path)
    assert before is not None
    blocker = _blocker(path)
    try:
        for beats in (1, 2, 3):  # due at 1.0, then busy retries 0.05 apart
            clock.advance(1.0 if beats == 1 else 0.05)
            wait_for(lambda b=beats: keeper.stats.beats >= b, f"beat {beats}")
            assert not session.lost.is_set()  # busy is retried, not a loss
        assert keeper.stats.renewed == 0
        assert len(keeper) == 1
        clock.advance(1.7)  # 2.8 s: past the trust window, never renewed
        wait_for(session.lost.is_set, "the trust window to close")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert lost == ["locked"]
    # The loss is signalled by whichever notices first (asyncio: a loop timer);
    # the keeper's own task drops the lease when it next sweeps.
    wait_for(lambda: len(keeper) == 0, "the keeper to drop the lost lease")
    with pytest.raises(WriterLeaseLostError, match="writer lease was lost"):
        session.set_register("k", "x", 1)
    # Never extended while the file was locked; the keeper may have given it
    # back once the lock went (best effort, holder cleared, fence kept), so
    # that others need not wait.
    assert before is not None
    assert lease_row(path) in (before, ("", before[1], 0))


def test_a_beat_that_got_through_after_busy_ones_keeps_the_lease(
    tmp_path: Path, make_repo: MakeRepo
) -> None:
    clock = FakeClock()
    repo = make_repo(
        tmp_path,
        lease_seconds=3,
        renew_interval=1,
        busy_timeout=0.1,
        clock=clock,
        now_ms=file_clock(clock),
    )
    session = repo.create("relieved")
    keeper = repo.keeper
    assert keeper is not None
    path = tmp_path / "relieved.sqlite"
    first_expiry = expiry(path)
    blocker = _blocker(path)
    try:
        clock.advance(1.0)
        wait_for(lambda: keeper.stats.beats >= 1, "a busy beat")
        assert keeper.stats.renewed == 0
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    clock.advance(0.05)  # the busy retry
    wait_for(lambda: keeper.stats.renewed >= 1, "the retried beat to renew")
    assert expiry(path) > first_expiry  # extended, by the file's clock
    clock.advance(1.8)  # 2.85 s: past the first window, inside the renewed one
    wait_for(lambda: keeper.stats.renewed >= 2, "the next regular beat")
    assert not session.lost.is_set()
    assert session.set_register("k", "x", 1) > 0


def test_a_lease_run_out_in_the_file_is_expired_at_the_next_beat(
    tmp_path: Path, make_repo: MakeRepo
) -> None:
    clock = FakeClock()
    now = [1_000_000]
    repo = make_repo(
        tmp_path, lease_seconds=3, renew_interval=1, clock=clock, now_ms=lambda: now[0]
    )
    session = repo.create("late")
    keeper = repo.keeper
    assert keeper is not None
    now[0] += 3_000  # the file's clock: the lease runs out before the beat
    clock.advance(1.0)
    wait_for(session.lost.is_set, "the beat to find the lease run out")
    assert len(keeper) == 0
    with pytest.raises(WriterLeaseLostError):
        session.renew()


def test_closing_is_no_loss_and_stops_the_keeper(tmp_path: Path, make_repo: MakeRepo) -> None:
    clock = FakeClock()
    lost: list[str] = []
    repo = make_repo(
        tmp_path,
        lease_seconds=3,
        renew_interval=1,
        clock=clock,
        now_ms=file_clock(clock),
        on_lost=lambda h: lost.append(h.id),
    )
    first = repo.create("a")
    second = repo.create("b")
    keeper = repo.keeper
    assert keeper is not None and len(keeper) == 2
    clock.advance(1.0)
    wait_for(lambda: keeper.stats.renewed >= 2, "one beat renewing both files")
    assert keeper.stats.last_beat_size == 2
    first.close()
    assert len(keeper) == 1
    clock.advance(1.0)
    wait_for(lambda: keeper.stats.renewed >= 3, "the beat of the file still open")
    assert not second.lost.is_set() and lost == []
    repo.close()
    assert second.closed and repo.keeper is None
    assert lost == [] and keeper.stats.lost == 0
    assert lease_row(tmp_path / "b.sqlite") == ("", 1, 0)  # released, its fence kept


def test_without_renew_interval_there_is_no_keeper(tmp_path: Path, make_repo: MakeRepo) -> None:
    repo = make_repo(tmp_path, renew_interval=None)
    session = repo.create("quiet")
    assert repo.keeper is None
    session.renew()  # the explicit renewal still works
    assert not session.lost.is_set()


def test_an_interval_close_to_the_lease_length_still_keeps_the_lease(
    tmp_path: Path, make_repo: MakeRepo
) -> None:
    clock = FakeClock()
    # Allowed since before the keeper (0 < interval < lease): the trust
    # window's margin shrinks so that each beat still comes before it closes.
    repo = make_repo(
        tmp_path, lease_seconds=1.0, renew_interval=0.9, clock=clock, now_ms=file_clock(clock)
    )
    session = repo.create("tight")
    keeper = repo.keeper
    assert keeper is not None
    for beat in (1, 2, 3):
        clock.advance(0.9)
        wait_for(lambda b=beat: keeper.stats.renewed >= b, f"renewal {beat}")
        assert not session.lost.is_set()
    assert session.set_register("k", "x", 1) > 0
