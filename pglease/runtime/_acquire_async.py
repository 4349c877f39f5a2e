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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from .. import _instrument
from .._compat_async import sleep
from ..clock import SYSTEM_CLOCK, Clock
from ..driver import AsyncRuntimeDriver, ClaimAttempt
from ..errors import AcquireTimeoutError, LeaseLostError, PgleaseError
from ..types import Claim, Owner
from ..validation import check_ttl
from ._acquire_core import (
    _NO_LOCK,
    BUSY_PAUSE,
    _check_timeout,
    _claim_outcome,
    _left,
    _Outcome,
    _Pause,
    _Plan,
    _same_clock,
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
) -> tuple[Claim, float]:
    """(claim, start on `clock` of the request that won it); a set `stop` event
    ends the wait with `AcquireTimeoutError` (an election that stops)."""
    with _waiting(clock):
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
                # A fair waiter's first attempt creates its queue entry: one at a
                # time per room, so local wake-up order is the database's order.
                enqueue = room.enqueue if room is not None and fair and first else _NO_LOCK
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
                if stop is not None and stop.is_set():
                    raise AcquireTimeoutError("acquire stopped")
                poll = room is None or room.broken
                pause = _Pause(clock, deadline, outcome.wake_in, poll, stop)
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


async def _attempt_async(driver: AsyncRuntimeDriver, plan: _Plan) -> ClaimAttempt | None:
    """One claim round trip: its answer, or None when the lease row stayed locked."""
    try:
        answer = await driver.attempt_claim(plan.request)
    except PgleaseError:
        _instrument.recorder.claim("error")
        raise
    _instrument.recorder.claim(_claim_outcome(answer))
    return answer


async def _leave_queue_async(driver: AsyncRuntimeDriver, plan: _Plan, won: bool) -> None:
    """Delete a fair waiter's queue entry unless it won."""
    leave = plan.leave()
    if leave is None or won:
        return
    try:
        await driver.leave_queue(leave)
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
    lock_timeout counts as held. Returns a plain `Claim` (not renewed: use
    `hold` for that). Raises only `PgleaseError`s.

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
    raises `DatabaseUnavailableError` at once and claims nothing. Raises only
    `PgleaseError`s (and the body's own exceptions).

    asyncio: when the body is cancelled the lease is by default only abandoned
    (no longer renewed, marked lost, left to run out): a cancelled task should
    not start new I/O. ``release_on_cancel=True`` releases it in a shielded
    call instead.
    """
    timing = Timing.of(ttl, interval, margin)  # bad settings fail before any claim
    # Not `keeper or ...`: a keeper with no leases yet is falsy (it has __len__).
    keeper = keeper if keeper is not None else AsyncKeeper.for_store(store, clock or SYSTEM_CLOCK)
    _same_clock(keeper.clock, clock)
    await keeper.connect()
    claim, requested_at = await _acquire_async(
        store, resource_type, key, owner, timing.ttl, timeout, fair, use_watcher,
        clock=keeper.clock,
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
