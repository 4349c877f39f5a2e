"""Held leases: what `hold` hands to the code running under a lease.

A held lease knows its fencing generation, its current `Claim` (kept fresh by
the keeper) and the instant, on its keeper's clock (`pglease.clock.Clock`,
`time.monotonic()` by default), until which it may trust itself.
It is lost, once and for good, when the keeper learns the database no longer
has it (taken over, released, expired) or when the trust window closes
without a successful renewal, even if the database cannot be reached.

Leaving a `hold` block after the loss raises `LeaseLostError` (see
`_LeaseBase._exit_error`): a body that finished without its lease must not
look successful.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from .. import _instrument
from ..clock import SYSTEM_CLOCK, Clock
from ..driver import HeartbeatItem
from ..errors import LeaseLostError
from ..types import Claim, Owner, Permit
from ._timing import Timing, real_wait

log = logging.getLogger("pglease.runtime")

LostCallback = Callable[[LeaseLostError], object]


class _LeaseBase:
    """State shared by the sync and asyncio held leases; guarded by `_lock`."""

    def __init__(
        self, claim: Claim, timing: Timing, requested_at: float, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._lock = threading.Lock()
        self._claim = claim
        self.timing = timing
        #: The clock of the trust window (the keeper's): `deadline`, `lost_at`,
        #: `next_due` and `requested_at` are its `monotonic()` readings.
        self.clock = clock
        # The claim's request started at `requested_at`: the database set the
        # expiry at its own clock, no earlier, plus the ttl.
        self._deadline = requested_at + timing.ttl - timing.margin
        #: When the keeper should renew next (on `clock`).
        self.next_due = requested_at + timing.interval
        self._error: LeaseLostError | None = None
        #: Instant (on `clock`) the loss was recorded; None while held or released.
        self._lost_at: float | None = None
        # Lost on purpose by the holder (a cancelled task left it to run out):
        # not a loss to report when the block is left.
        self._abandoned = False
        self._callbacks: list[LostCallback] = []
        #: Successful heartbeats so far.
        self.renewals = 0
        #: What each beat sends for this lease. Built once: renewals change
        #: only the expiry, which a heartbeat does not send.
        self.heartbeat_item = HeartbeatItem(claim, timing.ttl)

    # --- read-only view -------------------------------------------------------

    @property
    def claim(self) -> Claim:
        """The current claim (expiry updated by every heartbeat; revision unchanged)."""
        return self._claim

    @property
    def resource_id(self) -> str:
        return self._claim.resource_id

    @property
    def owner(self) -> Owner:
        return self._claim.owner

    @property
    def generation(self) -> int:
        """The fencing token: hand it to downstream systems with every write."""
        return self._claim.generation

    @property
    def expires_at(self) -> datetime:
        """Expiry by the database clock after the last successful renewal."""
        return self._claim.expires_at

    @property
    def deadline(self) -> float:
        """Instant on the lease's `clock` (`time.monotonic()` by default) the trust
        window closes at."""
        return self._deadline

    def time_left(self) -> float:
        """Seconds of local trust left (negative once the window closed)."""
        return self._deadline - self.clock.monotonic()

    @property
    def lost_at(self) -> float | None:
        """Instant on the lease's `clock` the loss was recorded (None if not lost)."""
        return self._lost_at

    @property
    def trusted_until(self) -> float:
        """Instant (on `clock`) trust ends: the window's close, or the loss if earlier."""
        lost_at = self._lost_at
        return self._deadline if lost_at is None else min(self._deadline, lost_at)

    @property
    def lost_error(self) -> LeaseLostError | None:
        """Why the lease was lost, or None while it is held."""
        return self._error

    def permit(self, expected_revision: int) -> Permit:
        """A write permit for `mutate` carrying this lease (checks it first)."""
        self.check()
        return Permit(self._claim.resource_id, expected_revision, self._claim)

    def check(self) -> None:
        """Raise `LeaseLostError` if the lease is lost or its trust window closed."""
        self._expire_if_due()
        if self._error is not None:
            raise self._error

    def _expire_if_due(self) -> bool:
        """Lose the lease if its trust window closed; True if this call lost it."""
        if self._error is None and self.clock.monotonic() >= self._deadline:
            # The watchdog may be late (GIL, blocked loop): the clock decides.
            return self._lose(
                "the local trust window closed without a successful renewal",
                cause="trust_window",
            )
        return False

    def _exit_error(self, body_error: BaseException | None) -> LeaseLostError | None:
        """What leaving the `hold` block must raise: the loss, if the lease was lost
        while held (not released, not abandoned on purpose), unless the body raised.

        A body's own exception propagates unchanged; the loss is added to it as a
        note, so it does not mask the body's error.
        """
        with self._lock:
            error = None if self._abandoned or self._lost_at is None else self._error
        if error is None or body_error is error:  # the body's own check() raised it
            return None
        if body_error is not None:
            body_error.add_note(f"pglease: while the block ran, {error}")
            return None
        exit_error = LeaseLostError(f"{error} (the hold block was left after the loss)")
        exit_error.__cause__ = error
        return exit_error

    def on_lost(self, callback: LostCallback) -> None:
        """Call `callback(error)` once when the lease is lost (at once if it already is)."""
        with self._lock:
            if self._error is None:
                self._callbacks.append(callback)
                return
            error = self._error
        self._run_callback(callback, error)

    # --- for holders that also renew or end the lease themselves ---------------
    # (a session handle's explicit `renew()` and `close()`): the same
    # bookkeeping the keeper does, so the trust window stays one window.

    def record_renewal(self, requested_at: float, expires_at: datetime) -> bool:
        """Record a renewal the holder made itself, sent at `requested_at` on this
        lease's clock; False (nothing changes) if the lease is lost already or
        its trust window closed before the answer came."""
        return self._renewed(requested_at, expires_at)

    def expire_if_due(self) -> bool:
        """Lose the lease now if its trust window has closed (callbacks run);
        True if this call lost it."""
        return self._expire_if_due()

    def end(self, reason: str) -> None:
        """Mark the lease given up by its holder (no loss: `on_lost` callbacks do
        not run); take it out of its keeper first."""
        self._close(reason)

    # --- keeper side ------------------------------------------------------------

    def _renewed(self, requested_at: float, expires_at: datetime) -> bool:
        """Record a successful heartbeat sent at `requested_at`; False if already lost."""
        with self._lock:
            if self._error is not None or self.clock.monotonic() >= self._deadline:
                return False
            self._claim = replace(self._claim, expires_at=expires_at)
            self._deadline = max(
                self._deadline, requested_at + self.timing.ttl - self.timing.margin
            )
            self.next_due = requested_at + self.timing.interval
            self.renewals += 1
            return True

    def _lose(self, reason: str, *, cause: str, abandoned: bool = False) -> bool:
        """Mark lost (once); run callbacks and signal. True if this call lost it.

        `cause` is the loss's label in the leases-lost metric (a fixed word, never
        the reason's text). `abandoned`: the holder gave it up on purpose without
        releasing it, so leaving the block does not report it as a loss.
        """
        with self._lock:
            if self._error is not None:
                return False
            claim = self._claim
            self._error = LeaseLostError(
                f"lease generation {claim.generation} of {claim.owner} on {claim.resource_id}"
                f" is lost: {reason}"
            )
            self._lost_at = self.clock.monotonic()
            self._abandoned = abandoned
            callbacks, self._callbacks = self._callbacks, []
            error = self._error
        _instrument.recorder.lease_lost(cause)
        log.warning("%s", error)
        self._signal()
        for callback in callbacks:
            self._run_callback(callback, error)
        return True

    def _close(self, reason: str) -> None:
        """The holder gave the lease up: `check()` raises and `lost` is set from
        now on, but this is no loss, so `on_lost` callbacks do not run."""
        with self._lock:
            if self._error is not None:
                return
            claim = self._claim
            self._error = LeaseLostError(
                f"lease generation {claim.generation} of {claim.owner} on {claim.resource_id}"
                f" is no longer held: {reason}"
            )
            self._callbacks = []
        self._signal()

    def _signal(self) -> None:
        raise NotImplementedError

    def _run_callback(self, callback: LostCallback, error: LeaseLostError) -> None:
        try:
            callback(error)
        except Exception:
            log.exception("on_lost callback %r failed", callback)


class HeldLease(_LeaseBase):
    """A lease kept alive by a `Keeper` thread.

    `lost` is a `threading.Event` set the moment the lease is lost; `check()`
    raises `LeaseLostError` from then on; `on_lost` callbacks run in the thread
    that noticed (the keeper or its watchdog), so keep them short.
    """

    def __init__(
        self, claim: Claim, timing: Timing, requested_at: float, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        super().__init__(claim, timing, requested_at, clock)
        self.lost = threading.Event()

    def _signal(self) -> None:
        self.lost.set()

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost (True) or `timeout` real seconds pass (False).

        The window's close is read from the lease's clock; `timeout` is a real
        wait, whatever the clock."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = real_wait(self.clock, self.time_left())
            if end is not None:
                left = min(left or 0.0, end - time.monotonic())
            if self.lost.wait(max(left or 0.0, 0.0)):
                return True
            with contextlib.suppress(LeaseLostError):
                self.check()
            if self.lost.is_set():
                return True
            if end is not None and time.monotonic() >= end:
                return False


class AsyncHeldLease(_LeaseBase):
    """A lease kept alive by an `AsyncKeeper` task; `lost` is an `asyncio.Event`.

    Create and use it on one event loop. `on_lost` callbacks run on that loop.
    """

    def __init__(
        self,
        claim: Claim,
        timing: Timing,
        requested_at: float,
        loop: asyncio.AbstractEventLoop,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(claim, timing, requested_at, clock)
        self._loop = loop
        self.lost = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        # A real timer to the window's close on the lease's clock (exact for the
        # system clock; a fake one is re-read every FAKE_CLOCK_TICK).
        if self._timer is not None:
            self._timer.cancel()
        if self._error is None:
            delay = real_wait(self.clock, self._deadline - self.clock.monotonic())
            self._timer = self._loop.call_later(delay or 0.0, self._expire)

    def _expire(self) -> None:
        if self._error is None and self.clock.monotonic() >= self._deadline:
            self._lose(
                "the local trust window closed without a successful renewal",
                cause="trust_window",
            )
        else:
            self._arm()

    def _renewed(self, requested_at: float, expires_at: datetime) -> bool:
        if not super()._renewed(requested_at, expires_at):
            return False
        self._arm()
        return True

    def _signal(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self.lost.set()
        else:
            with contextlib.suppress(RuntimeError):  # loop closed: nobody waits
                self._loop.call_soon_threadsafe(self.lost.set)

    async def wait_lost(self, timeout: float | None = None) -> bool:
        """Wait until the lease is lost (True) or `timeout` passes (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self.lost.wait()
        except TimeoutError:
            return False
        return True
