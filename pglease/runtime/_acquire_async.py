"""Blocking acquire and `hold`, asyncio source: `_acquire` is its generated twin.

What the waiting means (wake-ups, fairness, busy rows, errors, clock) is told
in `pglease.runtime.acquire`, the public module; what does not wait is shared
in `_acquire_core`. The flavours differ only where asyncio must shield work
from a cancellation (a fair waiter's queue entry, the release on exit) and in
`release_on_cancel`, which only a task can need.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from .. import _instrument
from .._common import ensure_op
from .._compat_async import sleep
from ..clock import SYSTEM_CLOCK, Clock
from ..driver import AsyncRuntimeDriver, ClaimAttempt
from ..errors import AcquireTimeoutError, LeaseLostError, PgleaseError
from ..types import Claim, Owner
from ..validation import check_ttl
from ._acquire_core import (
    _NO_LOCK,
    BUSY_PAUSE,
    LEAVE_LIMIT,
    _Budget,
    _check_timeout,
    _claim_outcome,
    _Outcome,
    _Pause,
    _Plan,
    _same_clock,
    _trust,
    _waiting,
)
from ._rooms import AsyncRoom, Member, join_async
from ._timing import Timing
from .keeper import AsyncKeeper
from .lease import AsyncHeldLease, LostCallback

log = logging.getLogger("pglease.runtime")


class AsyncLeaseStore(Protocol):
    """What the runtime uses of a store: the store API and its driver."""

    def runtime_driver(self) -> AsyncRuntimeDriver: ...
    async def ensure_resource(self, resource_type: str, key: str) -> str: ...
    async def release(self, claim: Claim) -> int: ...


async def _acquire_async(
    store: AsyncLeaseStore,
    resource_type: str,
    key: str,
    owner: Owner,
    ttl: float,
    timeout: float | None,
    fair: bool,
    use_watcher: bool,
    stop: Any = None,
    clock: Clock = SYSTEM_CLOCK,
    *,
    budget: _Budget | None = None,
    trust: float | None = None,
    on_late: Callable[[Claim], object] | None = None,
) -> tuple[Claim, float]:
    """(claim, start on `clock` of the request that won it); a set `stop` event
    ends the wait with `AcquireTimeoutError` (an election that stops).

    `budget`: the timeout already running (`hold` spent some on its keeper's
    connect), else one starts here. A claim answered more than `trust` seconds
    after its request (default: `_trust`) is a loss, never returned: it goes
    to `on_late` (`hold`: its keeper releases it) or runs out by itself, and
    the wait goes on."""
    with _waiting(clock):
        if budget is None:
            budget = _Budget(clock, _check_timeout(timeout))
        timeout = budget.timeout
        ttl = check_ttl(ttl)  # bad input changes nothing: checked before the resource is made
        trusted = _trust(ttl, trust)
        op = ensure_op(resource_type, key)
        driver = store.runtime_driver()
        try:
            rid = await driver.ensure_resource(op, budget.step())
        except PgleaseError as exc:
            error = budget.step_failed(exc, f"{resource_type}/{key} for {owner}")
            if error is exc:
                raise
            raise error from exc
        plan = _Plan(rid, owner, ttl, fair)
        room: AsyncRoom | None = None
        member: Member | None = None
        if use_watcher and timeout != 0:
            room, member = join_async(store, rid, fair, clock)
        won = False
        try:
            if room is not None:
                await room.await_ready(budget.left())
            first = True
            while True:
                if member is not None:
                    member.consume()
                # A fair waiter's first attempt creates its queue entry: one at a
                # time per room, so local wake-up order is the database's order.
                enqueue = room.enqueue if room is not None and fair and first else _NO_LOCK
                async with enqueue:
                    started = clock.monotonic()
                    answer = await _attempt_async(driver, plan, budget)
                    if first and room is not None and member is not None:
                        room.rank(member)
                first = False
                outcome = _Outcome(None, BUSY_PAUSE) if answer is None else plan.outcome(answer)
                if outcome.claim is not None:
                    took = clock.monotonic() - started
                    if took < trusted:
                        won = True
                        return outcome.claim, started
                    # Won, but the answer came after the trust window closed: the
                    # holder could not trust it for a moment. A loss, not a lease.
                    plan.late(outcome.claim, took, trusted)
                    if on_late is not None:
                        on_late(outcome.claim)
                    outcome = _Outcome(None, 0.0)  # look again at once
                if budget.over():
                    raise plan.timeout_error(timeout)
                if stop is not None and stop.is_set():
                    raise AcquireTimeoutError("acquire stopped")
                poll = room is None or room.broken
                pause = _Pause(clock, budget.deadline, outcome.wake_in, poll, stop)
                while (wait := pause.next_wait()) is None or wait > 0:
                    if room is not None and member is not None:
                        if await room.wait(member, wait):
                            break
                    elif wait is not None:
                        await sleep(wait)
        finally:
            if room is not None and member is not None:
                room.leave(member, won)  # synchronous: done even when cancelled
            # Shielded: a cancelled waiter still takes its queue entry with it.
            cleanup = asyncio.ensure_future(_leave_queue_async(driver, plan, won))  # sync: -
            await asyncio.shield(cleanup)  # sync: _leave_queue(driver, plan, won)


async def _attempt_async(
    driver: AsyncRuntimeDriver, plan: _Plan, budget: _Budget | None = None
) -> ClaimAttempt | None:
    """One claim round trip: its answer, or None when the lease row stayed locked.

    With a `budget`, the round trip ends by its deadline (plus `STEP_GRACE`):
    a claim sent and unanswered by then is a `CommitOutcomeUnknownError` with
    the plan's token; nothing sent and the time up, an `AcquireTimeoutError`."""
    try:
        answer = await driver.attempt_claim(plan.request, None if budget is None else budget.step())
    except PgleaseError as exc:
        _instrument.recorder.claim("error")
        error = exc if budget is None else budget.step_failed(exc, f"{plan.rid} for {plan.owner}")
        if error is exc:
            raise
        raise error from exc
    _instrument.recorder.claim(_claim_outcome(answer))
    return answer


async def _leave_queue_async(driver: AsyncRuntimeDriver, plan: _Plan, won: bool) -> None:
    """Delete a fair waiter's queue entry unless it won (within `LEAVE_LIMIT`)."""
    leave = plan.leave()
    if leave is None or won:
        return
    try:
        await driver.leave_queue(leave, LEAVE_LIMIT)
    except PgleaseError as exc:
        # Unreachable database: the entry runs out by itself within waiter_ttl.
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
    """Claim the lease on (type, key), waiting while another holder has it.

    Waits at most `timeout` seconds on `clock` (None: forever; 0: one
    attempt), then raises `AcquireTimeoutError`, leaving nothing behind (a fair
    waiter's queue entry is deleted); a lease row locked past the store's
    lock_timeout counts as held. The timeout covers every step (ensuring the
    resource, the waiting room, each claim round trip): a step may outlast it
    by `STEP_GRACE` (1 s) for an answer on its way, then its connection is shut
    down; a claim sent and unanswered by then raises `CommitOutcomeUnknownError`
    (its `.token` releases the lease if the claim committed). A claim answered
    after its trust window (``ttl - ttl/10`` after its request) is never
    returned: it is left to run out and the wait goes on. Returns a plain
    `Claim` (not renewed: use `hold` for that). Raises only `PgleaseError`s.

    asyncio (`acquire_async`): cancelling it removes a fair waiter's queue
    entry; a claim whose request was in flight when cancelled may be won
    unseen and then simply runs out after `ttl`.
    """
    claim, _ = await _acquire_async(
        store, resource_type, key, owner, ttl, timeout, fair, use_watcher, None, clock
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
    release_on_cancel: bool = False,  # sync: -
    use_watcher: bool = True,
    clock: Clock | None = None,
) -> AsyncIterator[AsyncHeldLease]:
    """``with hold(store, type, key, owner, ttl) as lease:`` (asyncio: ``async with
    hold_async(...)``) acquire (waiting up to `timeout`), keep the lease alive from
    the store's keeper (a thread; asyncio: the loop's `AsyncKeeper` task), release
    on exit.

    Inside, call `lease.check()` before side effects, pass `lease.generation`
    downstream, write with `store.mutate(lease.permit(revision), ...)`, or wait
    on `lease.lost`. Timing: renew every `interval` (default ttl/3), trust until
    ``request start + ttl - margin``; see `Timing`. `clock` (default: the
    keeper's, else the system clock) decides the timeout and the trust window.

    The keeper's connection is taken before claiming: if none can be had, this
    raises `DatabaseUnavailableError` at once and claims nothing. `timeout`
    covers that connect too, and every step after it, as in `acquire`; a claim
    answered after the lease's trust window is never handed out (the keeper
    releases it, and the wait goes on). Raises only `PgleaseError`s (and the
    body's own exceptions).

    asyncio: when the body is cancelled the lease is by default only abandoned
    (no longer renewed, marked lost, left to run out): a cancelled task should
    not start new I/O. ``release_on_cancel=True`` releases it in a shielded
    call instead.
    """
    timing = Timing.of(ttl, interval, margin)  # bad settings fail before any claim
    # Not `keeper or ...`: a keeper with no leases yet is falsy (it has __len__).
    keeper = keeper if keeper is not None else AsyncKeeper.for_store(store, clock or SYSTEM_CLOCK)
    _same_clock(keeper.clock, clock)
    # One timeout for every step: the keeper's connect, ensure, the room, the claim.
    budget = _Budget(keeper.clock, _check_timeout(timeout))
    try:
        await keeper.connect(budget.step())
    except PgleaseError as exc:
        error = budget.step_failed(exc, f"{resource_type}/{key} for {owner}")
        if error is exc:
            raise
        raise error from exc
    claim, requested_at = await _acquire_async(
        store, resource_type, key, owner, timing.ttl, timeout, fair, use_watcher,
        clock=keeper.clock, budget=budget, trust=timing.ttl - timing.margin,
        on_late=keeper.release_later,
    )  # fmt: skip
    lease = keeper.add(claim, timing, requested_at)
    if on_lost is not None:
        lease.on_lost(on_lost)
    cancelled = False  # sync: -
    body_error: BaseException | None = None
    try:
        yield lease
    except BaseException as exc:
        body_error = exc
        cancelled = isinstance(exc, asyncio.CancelledError)  # sync: -
        raise
    finally:
        keeper.remove(lease)
        # A trust window that closed unnoticed is a loss too; the database may
        # still have the lease, so it is released all the same.
        expired = lease._expire_if_due()
        # async-only: begin
        if cancelled and not release_on_cancel:
            lease._lose(
                "the holding task was cancelled; left to expire (release_on_cancel=False)",
                cause="abandoned",
                abandoned=True,
            )
        # async-only: end
        elif lease.lost_error is None or expired:  # sync: if lease.lost_error is None or expired:
            release = asyncio.ensure_future(_release_async(store, lease))  # sync: -
            await asyncio.shield(release)  # sync: _release(store, lease)
        # Leaving the block after the loss must not look like success.
        lost = lease._exit_error(body_error)
        if lost is not None:
            raise lost


async def _release_async(store: AsyncLeaseStore, lease: AsyncHeldLease) -> None:
    """Give the lease back on leaving `hold`; a failure is logged (it runs out)."""
    try:
        await store.release(lease.claim)
    except LeaseLostError as exc:
        # Ended in the database before we gave it back: that is a loss.
        lease._lose(f"the database no longer had it at release ({exc})", cause="not_current")
    except PgleaseError as exc:
        log.warning("could not release %s (it expires by itself): %s", lease.resource_id, exc)
    lease._close("released on exit")
