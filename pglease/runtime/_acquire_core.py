"""The sans-I/O parts of acquire, shared by the asyncio source and its twin.

The claim request an acquire repeats (`_Plan`), what one answer means
(`_Outcome`), how long a wait between attempts may last (`_Pause`), and the
metrics of an attempt and of a whole wait. The waiting itself is in
`_acquire_async` (and its generated blocking twin `_acquire`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import _instrument
from .._common import claim_op
from ..clock import Clock, SystemClock
from ..driver import ClaimAttempt, ClaimRequest, LeaveQueue
from ..errors import (
    AcquireTimeoutError,
    CommitOutcomeUnknownError,
    DatabaseUnavailableError,
    PgleaseError,
    StoreClosedError,
    ValidationError,
)
from ..types import Claim, Owner
from ..validation import check_timeout
from ._timing import Timing, real_wait

log = logging.getLogger("pglease.runtime")

#: Without a watcher, how often a waiter re-checks a held lease (seconds).
FALLBACK_POLL = 0.5
#: Bounds of a fair waiter's queue-entry ttl (it is the lease ttl within these).
MIN_WAITER_TTL = 1.0
MAX_WAITER_TTL = 30.0
#: Wake this long after the computed expiry, so the claim is not judged early.
_EXPIRY_SLACK = 0.001
#: After a claim gave up on a locked lease row (lock_timeout), try again after
#: this (real seconds): the lock wait itself was the wait, this only keeps a
#: tiny lock_timeout from spinning.
BUSY_PAUSE = 0.05
#: A stoppable wait (an election) looks at its stop flag this often.
STOP_POLL = 0.25
#: One step of an acquire (the keeper's connect, ensuring the resource, a claim
#: round trip) may wait this long past the acquire's deadline for an answer
#: already on its way; then its connection is shut down. So an acquire with a
#: timeout of T ends within about T + STEP_GRACE, whatever the network does.
STEP_GRACE = 1.0
#: The longest a fair waiter that gives up waits to delete its queue entry
#: (past it the entry runs out by itself within its own ttl).
LEAVE_LIMIT = 1.0


@dataclass(frozen=True, slots=True)
class _Outcome:
    claim: Claim | None
    #: Seconds (local) until something may change without an event: the holder's
    #: expiry, or a dead queue head's entry running out.
    wake_in: float | None


def _check_timeout(timeout: float | None) -> float | None:
    return check_timeout(timeout)


class _Plan:
    """One acquire's fixed arguments: the claim request it repeats."""

    def __init__(self, rid: str, owner: Owner, ttl: float, fair: bool) -> None:
        self.rid = rid
        self.owner = owner
        checked = claim_op(rid, owner, ttl, None, None)  # the store's checks, a fresh token
        self.token = checked.token
        self.ttl = checked.ttl
        self.fair = fair
        self.waiter = uuid.uuid4().hex if fair else None
        self.waiter_ttl = min(max(self.ttl, MIN_WAITER_TTL), MAX_WAITER_TTL)
        self.refresh_every = self.waiter_ttl / 3
        self.request = ClaimRequest(
            rid, owner, self.token, self.ttl, self.waiter, self.waiter_ttl if fair else None
        )

    def leave(self) -> LeaveQueue | None:
        return None if self.waiter is None else LeaveQueue(self.rid, self.waiter)

    def outcome(self, answer: ClaimAttempt) -> _Outcome:
        if answer.claimed:
            assert answer.expires_at is not None
            claim = Claim(
                self.rid, self.owner, self.token, answer.generation, answer.expires_at,
                answer.revision,
            )  # fmt: skip
            return _Outcome(claim, None)
        waits = []
        if answer.expires_at is not None:
            waits.append((answer.expires_at - answer.judged_at).total_seconds() + _EXPIRY_SLACK)
        if answer.position and answer.head_expires_at is not None:
            waits.append(
                (answer.head_expires_at - answer.judged_at).total_seconds() + _EXPIRY_SLACK
            )
        if self.fair:
            waits.append(self.refresh_every)
        return _Outcome(None, max(0.0, min(waits)) if waits else None)

    def late(self, claim: Claim, took: float, trust: float) -> None:
        """Log a claim won but answered after its trust window (not handed out)."""
        log.warning(
            "claim of %s (generation %d) answered %.3fs after its request, past its"
            " trust window of %.3fs: treated as lost, not handed out",
            claim.resource_id, claim.generation, took, trust,
        )  # fmt: skip

    def timeout_error(self, timeout: float | None) -> AcquireTimeoutError:
        return AcquireTimeoutError(
            f"could not acquire {self.rid} for {self.owner} within {timeout:g}s"
            + (" (fair queue entry removed)" if self.fair else "")
        )


#: Stands in for a room's enqueue lock when none is needed (a `nullcontext`
#: serves `with` and `async with` alike).
_NO_LOCK: contextlib.nullcontext[None] = contextlib.nullcontext()


def _left(clock: Clock, deadline: float | None) -> float | None:
    return None if deadline is None else deadline - clock.monotonic()


class _Budget:
    """An acquire's timeout, spent across all its steps: the keeper's connect
    (`hold`), ensuring the resource, the waiting room, each claim round trip."""

    def __init__(self, clock: Clock, timeout: float | None) -> None:
        self.clock = clock
        self.timeout = timeout
        self.deadline = None if timeout is None else clock.monotonic() + timeout

    def left(self) -> float | None:
        return _left(self.clock, self.deadline)

    def over(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def step(self) -> float | None:
        """Real seconds the next step may wait for an answer: what is left, plus
        `STEP_GRACE`. None without a timeout, or under a clock other than the
        system's (its seconds are not real ones): the store's limits then."""
        left = self.left()
        if left is None or not isinstance(self.clock, SystemClock):
            return None
        return max(0.0, left) + STEP_GRACE

    def step_failed(self, exc: PgleaseError, what: str) -> PgleaseError:
        """What a failed step that claimed nothing means: past the deadline the
        acquire timed out (the step was cut off, or failed anyway); a claim
        whose outcome is unknown stays that (the caller may hold it)."""
        if (
            isinstance(exc, DatabaseUnavailableError)
            # Outcome unknown: the caller may hold it. Closed: not the network.
            and not isinstance(exc, (CommitOutcomeUnknownError, StoreClosedError))
            and self.over()
        ):
            return AcquireTimeoutError(f"could not acquire {what} within {self.timeout:g}s: {exc}")
        return exc


class _Pause:
    """How long one wait between attempts may last, and when it is over.

    Until the first of: a wake-up from the room (the caller waits on it), the
    holder's expiry (`wake_in`, real seconds), the deadline (on `clock`), a
    fallback re-check (no working room: `FALLBACK_POLL`), a stop request.
    """

    def __init__(
        self,
        clock: Clock,
        deadline: float | None,
        wake_in: float | None,
        poll: bool,
        stop: Any = None,
    ) -> None:
        now = time.monotonic()
        self.clock = clock
        self.deadline = deadline
        self.end = None if wake_in is None else now + wake_in
        if poll:
            # No watcher: a release would go unnoticed until the expiry.
            self.end = _min_wait(self.end, now + FALLBACK_POLL)
        self.stop = stop

    def next_wait(self) -> float | None:
        """Real seconds to wait next; <= 0 when the pause is over."""
        if self.stop is not None and self.stop.is_set():
            return 0.0
        left = _left(self.clock, self.deadline)
        if left is not None and left <= 0:
            return 0.0
        wait = real_wait(self.clock, left)
        if self.end is not None:
            wait = _min_wait(wait, self.end - time.monotonic())
        if self.stop is not None:
            wait = _min_wait(wait, STOP_POLL)
        return wait


def _trust(ttl: float, trust: float | None) -> float:
    """Seconds after its request a won claim's answer may come and still be
    handed out: its trust window (`hold`'s own; `acquire`'s is the one `hold`
    would give the ttl by default, ``ttl - margin``)."""
    if trust is not None:
        return trust
    timing = Timing.of(ttl)
    return timing.ttl - timing.margin


def _same_clock(keeper_clock: Clock, clock: Clock | None) -> None:
    """A held lease's trust window is on its keeper's clock: refuse another one."""
    if clock is not None and clock != keeper_clock:
        raise ValidationError(f"clock {clock!r} is not the keeper's clock {keeper_clock!r}")


def _min_wait(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _record_wait(clock: Clock, began: float, error: BaseException | None) -> None:
    """Observe how long an acquire waited (on its clock), by how it ended."""
    outcome = "acquired" if error is None else _instrument.acquire_outcome(error)
    if outcome is not None:
        _instrument.recorder.acquire_wait(clock.monotonic() - began, outcome)


@contextlib.contextmanager
def _waiting(clock: Clock) -> Iterator[None]:
    """Observe how long the acquire inside waited (on `clock`), by how it ended."""
    began = clock.monotonic()
    try:
        yield
    except BaseException as error:
        _record_wait(clock, began, error)
        raise
    _record_wait(clock, began, None)


def _claim_outcome(answer: ClaimAttempt | None) -> str:
    """The claims_total outcome of one acquire attempt's answer."""
    return "busy" if answer is None else "claimed" if answer.claimed else "held"
