"""Clocks: the system's, and a fake one that tests move by hand.

Code that decides by elapsed time (a rate estimate, how long an error has
persisted) reads a `Clock` instead of `time`, so that its tests can put it in
any state without real sleeps and without depending on the host's speed.
Waiting stays real: a fake clock changes what such code decides, never how
long it blocks, so a component under a frozen fake clock still runs.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    """A monotonic clock (for intervals) and a wall clock (for timestamps)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""
        ...

    def time(self) -> float:
        """Wall time, seconds since the Unix epoch."""
        ...


class SystemClock:
    """`time.monotonic` and `time.time`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"

    # Every system clock is the same clock (watchers sharing a hub compare them).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, SystemClock)

    def __hash__(self) -> int:
        return hash(SystemClock)


#: The clock everything uses unless told otherwise.
SYSTEM_CLOCK = SystemClock()


class FakeClock:
    """A clock that stands still until `advance` moves it (thread-safe).

    Both readings move together: `time()` is `wall_start` plus the same
    elapsed seconds as `monotonic()`.
    """

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._elapsed = 0.0
        self._start = float(start)
        self._wall_start = float(wall_start)

    def monotonic(self) -> float:
        with self._lock:
            return self._start + self._elapsed

    def time(self) -> float:
        with self._lock:
            return self._wall_start + self._elapsed

    def advance(self, seconds: float) -> None:
        """Move both readings forward by `seconds` (>= 0)."""
        if not seconds >= 0:
            raise ValueError("a clock only moves forward")
        with self._lock:
            self._elapsed += seconds

    def __repr__(self) -> str:
        return f"FakeClock(elapsed={self._elapsed!r})"
