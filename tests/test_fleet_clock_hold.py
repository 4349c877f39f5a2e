"""`pglease hold`'s kill schedule reads the lease's clock: driven by a FakeClock,
a real child (leading its own process group) gets SIGTERM exactly when the
clock reaches ``close - grace`` and SIGKILL when it reaches the trust window's
close, however fast the host is.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pglease import Claim, Owner, resource_id
from pglease.cli.hold import _Supervisor
from pglease.cli.process_group import ProcessGroup
from pglease.clock import FakeClock
from pglease.runtime import HeldLease, Timing

#: Notes SIGTERM in its file and keeps running; SIGKILL ends it.
CHILD = r"""
import signal, sys, time
out = open(sys.argv[1], "a", buffering=1)
signal.signal(signal.SIGTERM, lambda *_: out.write("term\n"))
out.write("ready\n")
while True:
    time.sleep(0.05)
"""


def _eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def test_kill_schedule_follows_the_fake_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    timing = Timing.of(30.0)  # the window closes 27 s after the claim
    grace = 2.0
    claim = Claim(
        resource_id("job", "j1"), Owner("host", "cli"), "t" * 43, 1,
        datetime.now(UTC) + timedelta(seconds=30), 1,
    )  # fmt: skip
    lease = HeldLease(claim, timing, clock.monotonic(), clock)
    out = tmp_path / "signals"
    group = ProcessGroup.spawn([sys.executable, "-c", CHILD, str(out)], dict(os.environ))
    try:
        _eventually(lambda: out.exists() and "ready" in out.read_text())
        wake = threading.Event()
        supervisor = _Supervisor(group, lease, grace, [], wake)
        result: list[int] = []
        group.reap_in_background(wake)
        runner = threading.Thread(target=lambda: result.append(supervisor.run()), daemon=True)
        runner.start()

        closes = lease.deadline - clock.monotonic()
        clock.advance(closes - grace - 0.1)
        time.sleep(0.3)  # several wake-ups: not yet
        assert out.read_text().splitlines() == ["ready"] and group.returncode is None
        clock.advance(0.2)  # past close - grace: SIGTERM
        _eventually(lambda: "term" in out.read_text())
        assert supervisor.stopped_for_lease
        clock.advance(grace - 0.2)  # the window is still open: no SIGKILL yet
        time.sleep(0.3)
        assert group.returncode is None and runner.is_alive()
        clock.advance(0.2)  # the window closes: SIGKILL
        runner.join(30)
        assert result == [-signal.SIGKILL]
        assert lease.lost_error is not None  # the clock decided it, nobody else
    finally:
        group.signal(signal.SIGKILL)
