"""Heartbeat timing: one validated set of numbers per held lease."""

from __future__ import annotations

from dataclasses import dataclass

from ..clock import Clock, SystemClock
from ..errors import InvalidTimingError
from ..validation import check_positive_seconds, check_ttl

#: The renew interval may be at most this fraction of the TTL: two more beats
#: can fail before the lease runs out (DESIGN.md: renew at most every ttl/3).
MAX_INTERVAL_FRACTION = 1 / 3
#: A beat later than this fraction of the interval is logged as late.
LATE_FRACTION = 0.5


def _positive(value: object, what: str) -> float:
    return check_positive_seconds(value, what, InvalidTimingError)


@dataclass(frozen=True, slots=True)
class Timing:
    """TTL, renew interval and safety margin of one held lease.

    The holder trusts its lease until ``request start + ttl - margin`` of its
    last successful renewal, on the local monotonic clock (the keeper's
    `pglease.clock.Clock`, `time.monotonic()` by default). The database judges
    expiry at ``server time of the renewal + ttl``, which is never earlier; the
    margin absorbs clock-rate drift and the time the holder needs to stop
    working once it is told the lease is lost (`pglease hold` kills its
    command at the window's close, so the margin covers the kill's delay).
    """

    ttl: float
    interval: float
    margin: float

    @classmethod
    def of(cls, ttl: float, interval: float | None = None, margin: float | None = None) -> Timing:
        """Validate; default interval ttl/3, default margin ttl/10 (below the interval)."""
        ttl = check_ttl(ttl)
        interval = (
            ttl * MAX_INTERVAL_FRACTION if interval is None else _positive(interval, "interval")
        )
        if interval > ttl * MAX_INTERVAL_FRACTION * (1 + 1e-9):
            raise InvalidTimingError(
                f"renew interval {interval:g}s is not well below the ttl {ttl:g}s: it must be at"
                f" most ttl/3 ({ttl / 3:g}s) so that two failed beats still leave time to renew"
            )
        margin = min(ttl / 10, interval / 2) if margin is None else _positive(margin, "margin")
        if margin >= interval:
            raise InvalidTimingError(
                f"margin {margin:g}s must be below the renew interval {interval:g}s, otherwise"
                " the local trust window closes before the next beat"
            )
        return cls(ttl, interval, margin)

    @property
    def late_after(self) -> float:
        """Seconds past its due time after which a beat is reported as late."""
        return self.interval * LATE_FRACTION


#: Under a clock other than the system's (a test's `FakeClock`) no wait of the
#: fleet runtime lasts longer than this, in real seconds: a fake clock only
#: moves when a test advances it and tells nobody, so every waiting component
#: re-reads it at least this often and acts on the new time at that wake-up.
FAKE_CLOCK_TICK = 0.05


def real_wait(clock: Clock, seconds: float | None) -> float | None:
    """The real seconds to block for a wait of `seconds` on `clock` (None: no end).

    The system clock runs in real time, so the wait is exact; any other clock
    may be moved at any moment, so the wait is cut to `FAKE_CLOCK_TICK` and
    the caller re-reads the clock when it wakes (decisions read the clock,
    waits stay real).
    """
    if isinstance(clock, SystemClock):
        return None if seconds is None else max(0.0, seconds)
    return FAKE_CLOCK_TICK if seconds is None else min(max(0.0, seconds), FAKE_CLOCK_TICK)
