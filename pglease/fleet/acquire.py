"""Blocking acquire and `hold` (acquire + keep alive + release), sync and asyncio.

Wake-ups, never a fixed poll: a waiter sleeps until the holder's known expiry
(converted to a local delay from the database's own clock, read in the same
round trip) or until a `lease.released` / `lease.expired` event on the resource
wakes it, whichever comes first. Events reach waiters through the process's
waiting room for the resource (`_rooms`): one watcher subscription shared by
all waiters of the process, one waiter woken per event. If `pglease.watch` is
missing or fails, waiters fall back to the expiry timer plus a coarse re-check
every `FALLBACK_POLL` seconds, since a release would otherwise go unnoticed
until the expiry.

Fairness (``fair=True``): the waiter enqueues in the resource's queue
(PostgreSQL: `claim_fair`, migration 0005; SQLite: its lease_waiters table)
and may claim only as the head of the live queue, so fair waiters are served
in the order they arrived, across hosts (SQLite: across processes).
Besides the wake-ups above a fair waiter also wakes when the head's queue
entry would run out (a dead head), and every third of its own entry's ttl to
refresh it. On timeout, error or cancellation its entry is deleted.

Backends: every attempt goes through the store's runtime driver
(`store.runtime_driver()`, `pglease.driver`), so the same code waits on
PostgreSQL and on SQLite.

Busy rows: a claim that waits for the lease row's lock longer than the store's
``lock_timeout`` (a stalled transaction holds it; on SQLite the file's write
lock past ``busy_timeout``) changes nothing and the driver answers None;
acquire counts that as "busy" and tries again until its own `timeout`, which
then raises `AcquireTimeoutError` as for a held lease.

Errors: the drivers raise only `PgleaseError`s (on PostgreSQL worded with the
store's limits): a connection that broke while the claim was in flight is a
`CommitOutcomeUnknownError` (the claim may have committed under this call's
token), a pool or connect failure a `DatabaseUnavailableError`.

Clock: the deadline of `timeout`, and the instant a won claim's trust window
starts from, read ``clock`` (`pglease.clock.Clock`, the system clock by
default; `hold` uses its keeper's). Waits stay real: the holder's expiry is a
real delay computed from the database's clock, and under any other clock the
waiter re-reads it at least every `FAKE_CLOCK_TICK` without a database round
trip, so advancing a fake clock past the deadline ends the wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _instrument
from .._common import claim_args
from ..clock import SYSTEM_CLOCK, Clock
from ..driver import (
    AsyncRuntimeDriver,
    ClaimAttempt,
    ClaimRequest,
    LeaveQueue,
    RuntimeDriver,
)
from ..errors import AcquireTimeoutError, LeaseLostError, PgleaseError, ValidationError
from ..types import Claim, Owner
from ..validation import check_timeout, check_ttl
from ._rooms import AsyncRoom, Member, SyncRoom, join_async, join_sync
from ._timing import Timing, real_wait
from .keeper import AsyncKeeper, Keeper
from .lease import AsyncHeldLease, HeldLease, LostCallback

log = logging.getLogger("pglease.fleet")

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


class SyncLeaseStore(Protocol):
    """What the blocking runtime uses of a store: the store API and its driver."""

    def runtime_driver(self) -> RuntimeDriver: ...
    def ensure_resource(self, resource_type: str, key: str) -> str: ...
    def release(self, claim: Claim) -> int: ...


class AsyncLeaseStore(Protocol):
    """What the asyncio runtime uses of a store: the store API and its driver."""

    def runtime_driver(self) -> AsyncRuntimeDriver: ...
    async def ensure_resource(self, resource_type: str, key: str) -> str: ...
    async def release(self, claim: Claim) -> int: ...


# --------------------------------------------------------------------------- shared


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
        self.token, args = claim_args(rid, owner, ttl, None, None)
        self.ttl = float(args[4])
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

    def timeout_error(self, timeout: float | None) -> AcquireTimeoutError:
        return AcquireTimeoutError(
            f"could not acquire {self.rid} for {self.owner} within {timeout:g}s"
            + (" (fair queue entry removed)" if self.fair else "")
        )


class _NoLock:
    """Stands in for a room's enqueue lock when none is needed."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
_NO_ALOCK = _NoLock()


def _left(clock: Clock, deadline: float | None) -> float | None:
    return None if deadline is None else deadline - clock.monotonic()


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


# --------------------------------------------------------------------------- sync


def _record_wait(clock: Clock, began: float, error: BaseException | None) -> None:
    """Observe how long an acquire waited (on its clock), by how it ended."""
    outcome = "acquired" if error is None else _instrument.acquire_outcome(error)
    if outcome is not None:
        _instrument.recorder.acquire_wait(clock.monotonic() - began, outcome)


def _acquire(
    store: SyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    timeout: float | None,
    fair: bool,
    use_watcher: bool,
    stop: Any = None,
    clock: Clock = SYSTEM_CLOCK,
) -> tuple[Claim, float]:
    """(claim, start on `clock` of the request that won it)."""
    began = clock.monotonic()
    try:
        won = _acquire_loop(
            store, resource_type, key, owner, ttl, timeout, fair, use_watcher, stop, clock
        )
    except BaseException as exc:
        _record_wait(clock, began, exc)
        raise
    _record_wait(clock, began, None)
    return won


def _acquire_loop(
    store: SyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    timeout: float | None,
    fair: bool,
    use_watcher: bool,
    stop: Any,
    clock: Clock,
) -> tuple[Claim, float]:
    timeout = _check_timeout(timeout)
    ttl = check_ttl(ttl)  # bad input changes nothing: checked before the resource is made
    deadline = None if timeout is None else clock.monotonic() + timeout
    rid = store.ensure_resource(resource_type, key)
    driver = store.runtime_driver()
    plan = _Plan(rid, owner, ttl, fair)
    room: SyncRoom | None = None
    member: Member | None = None
    if use_watcher and timeout != 0:
        room, member = join_sync(store, rid, fair, clock)
    won = False
    try:
        if room is not None:
            room.await_ready(_left(clock, deadline))
        first = True
        while True:
            if member is not None:
                member.consume()
            # A fair waiter's first attempt creates its queue entry: one at a
            # time per room, so local wake-up order is the database's order.
            enqueue = room.enqueue if room is not None and fair and first else _NO_LOCK
            with enqueue:
                started = clock.monotonic()
                answer = _attempt(driver, plan)
                if first and room is not None and member is not None:
                    room.rank(member)
            first = False
            outcome = _Outcome(None, BUSY_PAUSE) if answer is None else plan.outcome(answer)
            if outcome.claim is not None:
                won = True
                return outcome.claim, started
            left = _left(clock, deadline)
            if left is not None and left <= 0:
                raise plan.timeout_error(timeout)
            if stop is not None and stop.is_set():
                raise AcquireTimeoutError("acquire stopped")
            poll = room is None or room.broken
            pause = _Pause(clock, deadline, outcome.wake_in, poll, stop)
            while (wait := pause.next_wait()) is None or wait > 0:
                if room is not None and member is not None:
                    if room.wait(member, wait):
                        break
                elif wait is not None:
                    time.sleep(wait)
    finally:
        if room is not None and member is not None:
            room.leave(member, won)
        if plan.waiter is not None and not won:
            _leave_queue(driver, plan)


def _attempt(driver: RuntimeDriver, plan: _Plan) -> ClaimAttempt | None:
    """One claim round trip: its answer, or None when the lease row stayed locked."""
    try:
        answer = driver.attempt_claim(plan.request)
    except PgleaseError:
        _instrument.recorder.claim("error")
        raise
    _instrument.recorder.claim(_claim_outcome(answer))
    return answer


def _claim_outcome(answer: ClaimAttempt | None) -> str:
    """The claims_total outcome of one acquire attempt's answer."""
    return "busy" if answer is None else "claimed" if answer.claimed else "held"


def _leave_queue(driver: RuntimeDriver, plan: _Plan) -> None:
    leave = plan.leave()
    if leave is None:
        return
    try:
        driver.leave_queue(leave)
    except PgleaseError as exc:
        # Unreachable database: the entry runs out by itself within waiter_ttl.
        log.warning("could not remove fair-queue entry of %s: %s", plan.owner, exc)


def acquire(
    store: SyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    timeout: float | None = None,
    *,
    fair: bool = False,
    use_watcher: bool = True,
    clock: Clock = SYSTEM_CLOCK,
) -> Claim:
    """Claim the lease on (type, key), waiting while another holder has it.

    Waits at most `timeout` seconds on `clock` (None: forever; 0: one
    attempt), then raises `AcquireTimeoutError`, leaving nothing behind (a fair
    waiter's queue entry is deleted); a lease row locked past the store's
    lock_timeout counts as held. Returns a plain `Claim` (not renewed: use
    `hold` for that). Raises only `PgleaseError`s.
    """
    claim, _ = _acquire(
        store, resource_type, key, owner, ttl, timeout, fair, use_watcher, None, clock
    )
    return claim


@contextmanager
def hold(
    store: SyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    *,
    timeout: float | None = None,
    fair: bool = False,
    interval: float | None = None,
    margin: float | None = None,
    on_lost: LostCallback | None = None,
    keeper: Keeper | None = None,
    use_watcher: bool = True,
    clock: Clock | None = None,
) -> Iterator[HeldLease]:
    """``with hold(store, type, key, owner, ttl) as lease:`` acquire (waiting up to
    `timeout`), keep the lease alive from the store's keeper thread, release on exit.

    Inside, call `lease.check()` before side effects, pass `lease.generation`
    downstream, write with `store.mutate(lease.permit(revision), ...)`, or wait
    on `lease.lost`. Timing: renew every `interval` (default ttl/3), trust until
    ``request start + ttl - margin``; see `Timing`. `clock` (default: the
    keeper's, else the system clock) decides the timeout and the trust window.

    The keeper's connection is taken before claiming: if none can be had, this
    raises `DatabaseUnavailableError` at once and claims nothing. Raises only
    `PgleaseError`s (and the body's own exceptions).
    """
    timing = Timing.of(ttl, interval, margin)  # bad settings fail before any claim
    # Not `keeper or ...`: a keeper with no leases yet is falsy (it has __len__).
    keeper = keeper if keeper is not None else Keeper.for_store(store, clock or SYSTEM_CLOCK)
    _same_clock(keeper.clock, clock)
    keeper.connect()
    claim, requested_at = _acquire(
        store, resource_type, key, owner, timing.ttl, timeout, fair, use_watcher,
        clock=keeper.clock,
    )  # fmt: skip
    lease = keeper.add(claim, timing, requested_at)
    if on_lost is not None:
        lease.on_lost(on_lost)
    body_error: BaseException | None = None
    try:
        yield lease
    except BaseException as exc:
        body_error = exc
        raise
    finally:
        keeper.remove(lease)
        # A trust window that closed unnoticed is a loss too; the database may
        # still have the lease, so it is released all the same.
        expired = lease._expire_if_due()
        if lease.lost_error is None or expired:
            try:
                store.release(lease.claim)
            except LeaseLostError as exc:
                # Ended in the database before we gave it back: that is a loss.
                lease._lose(
                    f"the database no longer had it at release ({exc})", cause="not_current"
                )
            except PgleaseError as exc:
                log.warning(
                    "could not release %s (it expires by itself): %s", claim.resource_id, exc
                )
            lease._close("released on exit")
        # Leaving the block after the loss must not look like success.
        lost = lease._exit_error(body_error)
        if lost is not None:
            raise lost


# --------------------------------------------------------------------------- asyncio


async def _acquire_async(
    store: AsyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    timeout: float | None,
    fair: bool,
    use_watcher: bool,
    clock: Clock = SYSTEM_CLOCK,
) -> tuple[Claim, float]:
    began = clock.monotonic()
    try:
        won = await _acquire_loop_async(
            store, resource_type, key, owner, ttl, timeout, fair, use_watcher, clock
        )
    except BaseException as exc:
        _record_wait(clock, began, exc)
        raise
    _record_wait(clock, began, None)
    return won


async def _acquire_loop_async(
    store: AsyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    timeout: float | None,
    fair: bool,
    use_watcher: bool,
    clock: Clock,
) -> tuple[Claim, float]:
    timeout = _check_timeout(timeout)
    ttl = check_ttl(ttl)  # bad input changes nothing: checked before the resource is made
    deadline = None if timeout is None else clock.monotonic() + timeout
    rid = await store.ensure_resource(resource_type, key)
    driver = store.runtime_driver()
    plan = _Plan(rid, owner, ttl, fair)
    room: AsyncRoom | None = None
    member: Member | None = None
    if use_watcher and timeout != 0:
        room, member = join_async(store, rid, fair, clock)
    won = False
    try:
        if room is not None:
            await room.await_ready(_left(clock, deadline))
        first = True
        while True:
            if member is not None:
                member.consume()
            enqueue = room.enqueue if room is not None and fair and first else _NO_ALOCK
            async with enqueue:
                started = clock.monotonic()
                answer = await _attempt_async(driver, plan)
                if first and room is not None and member is not None:
                    room.rank(member)
            first = False
            outcome = _Outcome(None, BUSY_PAUSE) if answer is None else plan.outcome(answer)
            if outcome.claim is not None:
                won = True
                return outcome.claim, started
            left = _left(clock, deadline)
            if left is not None and left <= 0:
                raise plan.timeout_error(timeout)
            pause = _Pause(clock, deadline, outcome.wake_in, room is None or room.broken)
            while (wait := pause.next_wait()) is None or wait > 0:
                if room is not None and member is not None:
                    if await room.wait(member, wait):
                        break
                elif wait is not None:
                    await asyncio.sleep(wait)
    finally:
        if room is not None and member is not None:
            room.leave(member, won)  # synchronous: done even when cancelled
        # Shielded: a cancelled waiter still takes its queue entry with it.
        cleanup = asyncio.ensure_future(_cleanup_async(driver, plan, won))
        await asyncio.shield(cleanup)


async def _attempt_async(driver: AsyncRuntimeDriver, plan: _Plan) -> ClaimAttempt | None:
    """The asyncio twin of `_attempt`."""
    try:
        answer = await driver.attempt_claim(plan.request)
    except PgleaseError:
        _instrument.recorder.claim("error")
        raise
    _instrument.recorder.claim(_claim_outcome(answer))
    return answer


async def _cleanup_async(driver: AsyncRuntimeDriver, plan: _Plan, won: bool) -> None:
    leave = plan.leave()
    if leave is None or won:
        return
    try:
        await driver.leave_queue(leave)
    except PgleaseError as exc:
        log.warning("could not remove fair-queue entry of %s: %s", plan.owner, exc)


async def acquire_async(
    store: AsyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    timeout: float | None = None,
    *,
    fair: bool = False,
    use_watcher: bool = True,
    clock: Clock = SYSTEM_CLOCK,
) -> Claim:
    """Asyncio twin of `acquire`. Cancelling it removes a fair waiter's queue entry;
    a claim whose request was in flight when cancelled may be won unseen and then
    simply runs out after `ttl`."""
    claim, _ = await _acquire_async(
        store, resource_type, key, owner, ttl, timeout, fair, use_watcher, clock
    )
    return claim


@asynccontextmanager
async def hold_async(
    store: AsyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    *,
    timeout: float | None = None,
    fair: bool = False,
    interval: float | None = None,
    margin: float | None = None,
    on_lost: LostCallback | None = None,
    keeper: AsyncKeeper | None = None,
    release_on_cancel: bool = False,
    use_watcher: bool = True,
    clock: Clock | None = None,
) -> AsyncIterator[AsyncHeldLease]:
    """``async with hold_async(store, type, key, owner, ttl) as lease:`` the asyncio
    twin of `hold`, renewed by the loop's `AsyncKeeper` task.

    On normal exit or an exception the lease is released. When the body is
    cancelled the lease is by default only abandoned (no longer renewed, marked
    lost, left to run out): a cancelled task should not start new I/O. Pass
    ``release_on_cancel=True`` to release it in a shielded call instead. As in
    `hold`, the keeper's connection is taken before claiming.
    """
    timing = Timing.of(ttl, interval, margin)
    if keeper is None:
        keeper = AsyncKeeper.for_store(store, clock or SYSTEM_CLOCK)
    _same_clock(keeper.clock, clock)
    await keeper.connect()
    claim, requested_at = await _acquire_async(
        store, resource_type, key, owner, timing.ttl, timeout, fair, use_watcher, keeper.clock
    )
    lease = keeper.add(claim, timing, requested_at)
    if on_lost is not None:
        lease.on_lost(on_lost)
    cancelled = False
    body_error: BaseException | None = None
    try:
        yield lease
    except BaseException as exc:
        body_error = exc
        cancelled = isinstance(exc, asyncio.CancelledError)
        raise
    finally:
        keeper.remove(lease)
        expired = lease._expire_if_due()  # see `hold`
        if cancelled and not release_on_cancel:
            lease._lose(
                "the holding task was cancelled; left to expire (release_on_cancel=False)",
                cause="abandoned",
                abandoned=True,
            )
        elif lease.lost_error is None or expired:
            await asyncio.shield(asyncio.ensure_future(_release_async(store, lease)))
        lost = lease._exit_error(body_error)
        if lost is not None:
            raise lost


async def _release_async(store: AsyncLeaseStore, lease: AsyncHeldLease) -> None:
    try:
        await store.release(lease.claim)
    except LeaseLostError as exc:
        lease._lose(f"the database no longer had it at release ({exc})", cause="not_current")
    except PgleaseError as exc:
        log.warning("could not release %s (it expires by itself): %s", lease.resource_id, exc)
    lease._close("released on exit")
