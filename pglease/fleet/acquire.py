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
(`claim_fair`, migration 0005) and may claim only as the head of the live
queue, so fair waiters are served in the order they arrived, across hosts.
Besides the wake-ups above a fair waiter also wakes when the head's queue
entry would run out (a dead head), and every third of its own entry's ttl to
refresh it. On timeout, error or cancellation its entry is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg

from .._common import claim_args
from ..errors import AcquireTimeoutError, LeaseLostError, PgleaseError
from ..ids import token_hash
from ..postgres import _core
from ..types import Claim, Owner
from ..validation import check_timeout
from ._rooms import AsyncRoom, Member, SyncRoom, join_async, join_sync
from ._sql import FleetQueries
from ._timing import Timing
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


class SyncLeaseStore(Protocol):
    dsn: str
    schema: str

    def connection(self) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]: ...
    def ensure_resource(self, resource_type: str, key: str) -> str: ...
    def release(self, claim: Claim) -> int: ...


class AsyncLeaseStore(Protocol):
    dsn: str
    schema: str

    def connection(
        self,
    ) -> contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]: ...
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
    """One acquire's fixed arguments and its SQL."""

    def __init__(self, schema: str, rid: str, owner: Owner, ttl: float, fair: bool) -> None:
        self.q = FleetQueries(schema)
        self.rid = rid
        self.owner = owner
        self.token, args = claim_args(rid, owner, ttl, None, None)
        self.ttl = float(args[4])
        self.fair = fair
        self.waiter = uuid.uuid4().hex if fair else None
        self.waiter_ttl = min(max(self.ttl, MIN_WAITER_TTL), MAX_WAITER_TTL)
        self.refresh_every = self.waiter_ttl / 3

    def query(self) -> tuple[bytes, list[Any]]:
        base = [self.rid, self.owner.type, self.owner.id, token_hash(self.token), self.ttl]
        if self.fair:
            return self.q.claim_fair, [*base, self.waiter, self.waiter_ttl]
        return self.q.claim, base

    def outcome(self, row: Sequence[Any]) -> _Outcome:
        claimed, generation, expires_at, revision, _ht, _hid, position, head_exp, db_now = row
        if claimed:
            claim = Claim(self.rid, self.owner, self.token, generation, expires_at, revision)
            return _Outcome(claim, None)
        waits = []
        if expires_at is not None:
            waits.append((expires_at - db_now).total_seconds() + _EXPIRY_SLACK)
        if position and head_exp is not None:
            waits.append((head_exp - db_now).total_seconds() + _EXPIRY_SLACK)
        if self.fair:
            waits.append(self.refresh_every)
        return _Outcome(None, max(0.0, min(waits)) if waits else None)

    def timeout_error(self, timeout: float | None) -> AcquireTimeoutError:
        return AcquireTimeoutError(
            f"could not acquire {self.rid} for {self.owner} within {timeout:g}s"
            + (" (fair queue entry removed)" if self.fair else "")
        )


def _translate(exc: psycopg.Error) -> BaseException:
    return _core.translate(exc) or exc


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


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _min_wait(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


# --------------------------------------------------------------------------- sync


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
) -> tuple[Claim, float]:
    """(claim, monotonic start of the request that won it)."""
    timeout = _check_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    rid = store.ensure_resource(resource_type, key)
    plan = _Plan(store.schema, rid, owner, ttl, fair)
    room: SyncRoom | None = None
    member: Member | None = None
    if use_watcher and timeout != 0:
        room, member = join_sync(store, rid, fair)
    won = False
    try:
        if room is not None:
            room.await_ready(_left(deadline))
        first = True
        while True:
            query, args = plan.query()
            if member is not None:
                member.consume()
            # A fair waiter's first attempt creates its queue entry: one at a
            # time per room, so local wake-up order is the database's order.
            enqueue = room.enqueue if room is not None and fair and first else _NO_LOCK
            with enqueue:
                started = time.monotonic()
                try:
                    with store.connection() as conn:
                        row = conn.execute(query, args).fetchone()
                except psycopg.Error as exc:
                    raise _translate(exc) from None
                if first and room is not None and member is not None:
                    room.rank(member)
            first = False
            assert row is not None
            outcome = plan.outcome(row)
            if outcome.claim is not None:
                won = True
                return outcome.claim, started
            left = _left(deadline)
            if left is not None and left <= 0:
                raise plan.timeout_error(timeout)
            if stop is not None and stop.is_set():
                raise AcquireTimeoutError("acquire stopped")
            wait = _min_wait(outcome.wake_in, left)
            if stop is not None:
                wait = _min_wait(wait, 0.25)  # notice a stop request; not a database poll
            if room is not None and member is not None:
                room.wait(member, wait, FALLBACK_POLL)
            elif wait is None or wait > 0:
                # No watcher: a release would go unnoticed until the expiry.
                time.sleep(FALLBACK_POLL if wait is None else min(wait, FALLBACK_POLL))
    finally:
        if room is not None and member is not None:
            room.leave(member, won)
        if plan.waiter is not None and not won:
            _leave_queue(store, plan)


def _leave_queue(store: SyncLeaseStore, plan: _Plan) -> None:
    try:
        with store.connection() as conn:
            conn.execute(plan.q.leave_queue, [plan.waiter])
    except (psycopg.Error, PgleaseError) as exc:
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
) -> Claim:
    """Claim the lease on (type, key), waiting while another holder has it.

    Waits at most `timeout` seconds (None: forever; 0: one attempt), then
    raises `AcquireTimeoutError`, leaving nothing behind (a fair waiter's queue
    entry is deleted). Returns a plain `Claim` (not renewed: use `hold` for that).
    """
    return _acquire(store, resource_type, key, owner, ttl, timeout, fair, use_watcher)[0]


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
) -> Iterator[HeldLease]:
    """``with hold(store, type, key, owner, ttl) as lease:`` acquire (waiting up to
    `timeout`), keep the lease alive from the store's keeper thread, release on exit.

    Inside, call `lease.check()` before side effects, pass `lease.generation`
    downstream, write with `store.mutate(lease.permit(revision), ...)`, or wait
    on `lease.lost`. Timing: renew every `interval` (default ttl/3), trust until
    ``request start + ttl - margin``; see `Timing`.
    """
    timing = Timing.of(ttl, interval, margin)  # bad settings fail before any claim
    # Not `keeper or ...`: a keeper with no leases yet is falsy (it has __len__).
    keeper = keeper if keeper is not None else Keeper.for_store(store)
    claim, requested_at = _acquire(
        store, resource_type, key, owner, timing.ttl, timeout, fair, use_watcher
    )
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
                lease._lose(f"the database no longer had it at release ({exc})")
            except (psycopg.Error, PgleaseError) as exc:
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
) -> tuple[Claim, float]:
    timeout = _check_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    rid = await store.ensure_resource(resource_type, key)
    plan = _Plan(store.schema, rid, owner, ttl, fair)
    room: AsyncRoom | None = None
    member: Member | None = None
    if use_watcher and timeout != 0:
        room, member = join_async(store, rid, fair)
    won = False
    try:
        if room is not None:
            await room.await_ready(_left(deadline))
        first = True
        while True:
            query, args = plan.query()
            if member is not None:
                member.consume()
            enqueue = room.enqueue if room is not None and fair and first else _NO_ALOCK
            async with enqueue:
                started = time.monotonic()
                try:
                    async with store.connection() as conn:
                        cur = await conn.execute(query, args)
                        row = await cur.fetchone()
                except psycopg.Error as exc:
                    raise _translate(exc) from None
                if first and room is not None and member is not None:
                    room.rank(member)
            first = False
            assert row is not None
            outcome = plan.outcome(row)
            if outcome.claim is not None:
                won = True
                return outcome.claim, started
            left = _left(deadline)
            if left is not None and left <= 0:
                raise plan.timeout_error(timeout)
            wait = _min_wait(outcome.wake_in, left)
            if room is not None and member is not None:
                await room.wait(member, wait, FALLBACK_POLL)
            elif wait is None or wait > 0:
                await asyncio.sleep(FALLBACK_POLL if wait is None else min(wait, FALLBACK_POLL))
    finally:
        if room is not None and member is not None:
            room.leave(member, won)  # synchronous: done even when cancelled
        # Shielded: a cancelled waiter still takes its queue entry with it.
        cleanup = asyncio.ensure_future(_cleanup_async(store, plan, won))
        await asyncio.shield(cleanup)


async def _cleanup_async(store: AsyncLeaseStore, plan: _Plan, won: bool) -> None:
    if plan.waiter is None or won:
        return
    try:
        async with store.connection() as conn:
            await conn.execute(plan.q.leave_queue, [plan.waiter])
    except (psycopg.Error, PgleaseError) as exc:
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
) -> Claim:
    """Asyncio twin of `acquire`. Cancelling it removes a fair waiter's queue entry;
    a claim whose request was in flight when cancelled may be won unseen and then
    simply runs out after `ttl`."""
    claim, _ = await _acquire_async(
        store, resource_type, key, owner, ttl, timeout, fair, use_watcher
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
) -> AsyncIterator[AsyncHeldLease]:
    """``async with hold_async(store, type, key, owner, ttl) as lease:`` the asyncio
    twin of `hold`, renewed by the loop's `AsyncKeeper` task.

    On normal exit or an exception the lease is released. When the body is
    cancelled the lease is by default only abandoned (no longer renewed, marked
    lost, left to run out): a cancelled task should not start new I/O. Pass
    ``release_on_cancel=True`` to release it in a shielded call instead.
    """
    timing = Timing.of(ttl, interval, margin)
    keeper = keeper if keeper is not None else AsyncKeeper.for_store(store)
    claim, requested_at = await _acquire_async(
        store, resource_type, key, owner, timing.ttl, timeout, fair, use_watcher
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
        lease._lose(f"the database no longer had it at release ({exc})")
    except (psycopg.Error, PgleaseError) as exc:
        log.warning("could not release %s (it expires by itself): %s", lease.resource_id, exc)
    lease._close("released on exit")
