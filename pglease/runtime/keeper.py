"""Keepers: one per host (per store), renewing every lease it holds in one round
trip per beat, from a dedicated thread (`Keeper`) or asyncio task (`AsyncKeeper`).

A beat sends all due leases at once through the store's runtime driver
(`pglease.driver`: on PostgreSQL the `heartbeat` SQL function of migration
0005, on SQLite one write transaction). A heartbeat extends `expires_at` only:
no revision bump, no event, so holders' cached revisions stay valid. Each
keeper has its own line to the database (`HeartbeatChannel`; on PostgreSQL a
dedicated connection, never a pooled one): application work that exhausts the
pool cannot starve the heartbeat.

Loss is signalled three ways, the moment it is known: the lease's `lost` event,
its `on_lost` callbacks, and `check()` raising `LeaseLostError`. It is known
when a beat reports the lease gone (generation or token changed, released,
expired: immediate, no retry), or when the local trust window closes without a
successful renewal. The sync keeper's watchdog thread does no I/O, so a beat
stuck on a dead connection cannot delay that; the async twin arms one loop
timer per lease, and `check()` consults the clock itself in any case.

Dead connections: a beat may take at most half the time left until its first
trust window closes (`KeeperCore.beat_limit`); then the channel is told to
abort (by the watchdog thread, or a loop timer in the async twin: PostgreSQL
shuts the socket down, SQLite interrupts the statement), the call fails, and
the beat is retried on a new connection, in time to keep the lease.
That covers a peer that acknowledges bytes but never answers (a frozen server,
a half-open proxy), which neither `statement_timeout` (server side) nor TCP
keepalives notice; keepalives and ``tcp_user_timeout`` are set as well, so a
dead TCP peer is noticed between beats too.

Connection: a keeper opens its line when a lease is about to be held
(`connect`, which `hold`, `hold_async`, elections and `pglease hold` call
before claiming), so a host that cannot get one fails at once with a
`PgleaseError` instead of claiming a lease it cannot renew (how the
PostgreSQL line is set up, also in pooler mode: `pglease.postgres.runtime`).
Afterwards a broken connection is replaced at the next beat; its errors never
reach the holder, only the loss they may cause.

Clock: due times, lateness, trust windows and the beat limit's size read the
keeper's `pglease.clock.Clock` (``clock=``, the system clock by default).
Waits stay real: under any other clock (a test's `FakeClock`) the threads (the
task) wake at least every `FAKE_CLOCK_TICK` to re-read it, so advancing a fake
clock takes effect within that, and the cut-off of a stuck statement stays a
real-time bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from .. import _instrument
from ..clock import SYSTEM_CLOCK, Clock
from ..driver import (
    AsyncHeartbeatChannel,
    HeartbeatChannel,
)
from ..errors import LeaseLostError, PgleaseError
from ..types import Claim
from ._keeper_core import SUPERSEDED, TRUST_CLOSED, KeeperCore, KeeperStats
from ._timing import Timing, real_wait
from .lease import AsyncHeldLease, HeldLease

log = logging.getLogger("pglease.runtime")

T = TypeVar("T")

#: A best-effort release on the keeper's line is abandoned after this.
RELEASE_LIMIT = 5.0


class HeartbeatSource(Protocol):
    """The part of a runtime driver a keeper uses (any `RuntimeDriver` is one):
    so leases that are not a store's (session files) can be kept too."""

    def heartbeat_channel(self, connect_timeout: float) -> HeartbeatChannel: ...


class AsyncHeartbeatSource(Protocol):
    """The part of an `AsyncRuntimeDriver` an asyncio keeper uses."""

    def heartbeat_channel(self, connect_timeout: float) -> AsyncHeartbeatChannel: ...


class StoreInfo(Protocol):
    """What a keeper needs from a store: its runtime driver."""

    def runtime_driver(self) -> HeartbeatSource: ...


class AsyncStoreInfo(Protocol):
    """What an asyncio keeper needs from a store: its runtime driver."""

    def runtime_driver(self) -> AsyncHeartbeatSource: ...


@dataclass
class _InFlight:
    """A call running on the sync keeper's line, and when to give up on it."""

    #: Real `time.monotonic()` instant: a bound on a real wait, whatever the clock.
    until: float
    aborted: bool = False


class Keeper:
    """Renews every lease added to it, in one round trip per beat, on its own thread.

    Normally you do not create one: `hold` uses `Keeper.for_store(store)`, one
    per store object (that is, per host process) and clock. Close it to stop
    renewing (held leases then run out; they are not released). `clock`
    decides due times and trust windows (see the module docstring).
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[Any, dict[Clock, Keeper]]] = (
        weakref.WeakKeyDictionary()
    )
    _shared_lock = threading.Lock()

    def __init__(
        self, store: StoreInfo, *, connect_timeout: float = 5.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._channel: HeartbeatChannel = store.runtime_driver().heartbeat_channel(connect_timeout)
        self.clock = clock
        self._core: KeeperCore[HeldLease] = KeeperCore(clock)
        self._cond = threading.Condition()
        self._closed = False
        self._inflight: _InFlight | None = None
        self._beater = threading.Thread(target=self._run, name="pglease-keeper", daemon=True)
        self._watchdog = threading.Thread(
            target=self._watch, name="pglease-keeper-watchdog", daemon=True
        )
        self._beater.start()
        self._watchdog.start()

    @classmethod
    def for_store(cls, store: StoreInfo, clock: Clock = SYSTEM_CLOCK) -> Keeper:
        """The shared keeper of `store` on `clock` (created on first use)."""
        with cls._shared_lock:
            per_clock = cls._shared.setdefault(store, {})
            keeper = per_clock.get(clock)
            if keeper is None or keeper._closed:
                keeper = per_clock[clock] = cls(store, clock=clock)
            return keeper

    @property
    def stats(self) -> KeeperStats:
        return self._core.stats

    def __len__(self) -> int:
        with self._cond:
            return len(self._core.leases)

    def __enter__(self) -> Keeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop both threads and close the connection (leases are not released)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        _instrument.untrack_keeper(self._core.tracked)
        for thread in (self._beater, self._watchdog):
            if thread is not threading.current_thread():
                thread.join(timeout=15)
        self._channel.close()

    def connect(self, timeout: float | None = None) -> None:
        """Open the keeper's connection now unless it has a live one.

        `hold` calls this before claiming: a host that cannot get a connection
        (server down, no free connection slot, bad credentials) fails at once
        with `DatabaseUnavailableError` (a `PgleaseError`) instead of holding a
        lease it cannot renew. No round trip when a connection is open.
        `timeout` (seconds) shortens the keeper's connect timeout (`hold`
        passes what is left of its own).
        """
        if self._closed:
            raise PgleaseError("the keeper is closed")
        self._channel.connect(timeout)

    def release_later(self, claim: Claim) -> None:
        """Release `claim` from the keeper's thread, best effort (a claim won too
        late to be trusted: nobody holds it here, others need not wait for it)."""
        with self._cond:
            if self._closed:
                return  # it runs out by itself
            self._core.give_back.append(claim)
            self._cond.notify_all()

    def add(self, claim: Claim, timing: Timing, requested_at: float) -> HeldLease:
        """Keep `claim` alive; `requested_at` is the instant (on the keeper's clock)
        its claim request started. No I/O: call `connect` first to learn early
        that the keeper cannot reach the database."""
        lease = HeldLease(claim, timing, requested_at, self.clock)
        with self._cond:
            if self._closed:
                raise PgleaseError("the keeper is closed")
            old = self._core.add(lease)
            self._cond.notify_all()
        if old is not None:
            old._lose(SUPERSEDED, cause="superseded")
        return lease

    def remove(self, lease: HeldLease) -> None:
        """Stop renewing `lease` (before releasing it)."""
        with self._cond:
            self._core.remove(lease)

    # --- threads -------------------------------------------------------------------

    def _watch(self) -> None:
        """Close trust windows on time, and cut off a statement stuck on a dead
        connection; no database I/O here, so nothing can block it."""
        clock = self.clock
        while True:
            with self._cond:
                if self._closed:
                    return
                lost = self._core.sweep(clock.monotonic())
                inflight = self._inflight
                real_now = time.monotonic()
                if inflight is not None and not inflight.aborted and inflight.until <= real_now:
                    inflight.aborted = True
                    self._core.stats.aborted += 1
                    log.warning(
                        "keeper statement outlasted its limit (dead connection?); reconnecting"
                    )
                    self._channel.abort()
                deadline = self._core.next_deadline()
                wait = real_wait(clock, None if deadline is None else deadline - clock.monotonic())
                if inflight is not None and not inflight.aborted:
                    cut_off = max(0.0, inflight.until - time.monotonic())
                    wait = cut_off if wait is None else min(wait, cut_off)
                if lost:
                    self._cond.notify_all()  # the beater releases them
                else:
                    self._cond.wait(wait)
            for lease in lost:
                lease._lose(TRUST_CLOSED, cause="trust_window")

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self.clock.monotonic()
                # Lost leases are never renewed again. Whichever thread sweeps a
                # lease first must signal its loss: the watchdog will not see it.
                lost = self._core.sweep(now)
                to_release = self._core.take_releases()
                batch = self._core.due_batch(now)
                if not batch and not to_release:
                    due = self._core.next_due()
                    self._cond.wait(real_wait(self.clock, None if due is None else due - now))
                    continue
            for lease in lost:
                lease._lose(TRUST_CLOSED, cause="trust_window")
            for claim in to_release:
                self._release_quietly(claim)
            if batch:
                self._beat(batch)

    def _execute(self, limit: float, call: Callable[..., T], *args: Any) -> T:
        """Run one call on the keeper's line; the watchdog aborts it after
        `limit` seconds (blocking driver calls have no client timeout)."""
        with self._cond:
            self._inflight = _InFlight(time.monotonic() + limit)
            self._cond.notify_all()  # the watchdog re-arms for the limit
        try:
            return call(*args)
        finally:
            with self._cond:
                self._inflight = None

    def _beat(self, batch: list[HeldLease]) -> None:
        started = self.clock.monotonic()
        real_start = time.monotonic()
        try:
            rows = self._execute(
                self._core.beat_limit(batch, started),
                self._channel.heartbeat,
                self._core.items(batch),
            )
        except (PgleaseError, OSError) as exc:
            self._channel.close()  # the next beat reconnects
            with self._cond:
                self._core.on_error(batch, exc)
            return
        with self._cond:
            gone = self._core.on_rows(batch, rows, started, time.monotonic() - real_start)
        for lease, reason, cause in gone:
            lease._lose(reason, cause=cause)

    def _release_quietly(self, claim: Claim) -> None:
        """Best effort: a lease lost by the local clock may still be current in the database."""
        try:
            self._execute(RELEASE_LIMIT, self._channel.release, claim)
        except LeaseLostError:
            pass  # already gone in the database: nothing to give back
        except (PgleaseError, OSError):
            self._channel.close()


class AsyncKeeper:
    """The asyncio twin of `Keeper`: one task per event loop and store.

    Use `AsyncKeeper.for_store(store)` (inside a running loop) or create one
    and `await keeper.aclose()` when done.
    """

    _shared: ClassVar[
        weakref.WeakKeyDictionary[Any, dict[tuple[asyncio.AbstractEventLoop, Clock], AsyncKeeper]]
    ] = weakref.WeakKeyDictionary()

    def __init__(
        self, store: AsyncStoreInfo, *, connect_timeout: float = 5.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._channel: AsyncHeartbeatChannel = store.runtime_driver().heartbeat_channel(
            connect_timeout
        )
        self._connect_timeout = connect_timeout
        self.clock = clock
        self._core: KeeperCore[AsyncHeldLease] = KeeperCore(clock)
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._closed = False
        self._task = self._loop.create_task(self._run(), name="pglease-keeper")

    @classmethod
    def for_store(cls, store: AsyncStoreInfo, clock: Clock = SYSTEM_CLOCK) -> AsyncKeeper:
        """The shared keeper of `store` on the running loop and `clock` (created on first use)."""
        loop = asyncio.get_running_loop()
        per_loop = cls._shared.setdefault(store, {})
        keeper = per_loop.get((loop, clock))
        if keeper is None or keeper._closed or keeper._task.done():
            keeper = per_loop[(loop, clock)] = cls(store, clock=clock)
        return keeper

    @property
    def stats(self) -> KeeperStats:
        return self._core.stats

    def __len__(self) -> int:
        return len(self._core.leases)

    async def __aenter__(self) -> AsyncKeeper:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the task and close the connection (leases are not released)."""
        self._closed = True
        _instrument.untrack_keeper(self._core.tracked)
        self._changed.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._channel.close()

    async def connect(self, timeout: float | None = None) -> None:
        """Open the keeper's connection now unless it has a live one; see `Keeper.connect`."""
        if self._closed:
            raise PgleaseError("the keeper is closed")
        await self._channel.connect(timeout)

    def release_later(self, claim: Claim) -> None:
        """Release `claim` from the keeper's task, best effort; see `Keeper.release_later`."""
        if self._closed:
            return
        self._core.give_back.append(claim)
        self._changed.set()

    def add(self, claim: Claim, timing: Timing, requested_at: float) -> AsyncHeldLease:
        """Keep `claim` alive; `requested_at` is the instant (on the keeper's clock)
        its claim request started. No I/O (see `connect`)."""
        if self._closed:
            raise PgleaseError("the keeper is closed")
        lease = AsyncHeldLease(claim, timing, requested_at, self._loop, self.clock)
        old = self._core.add(lease)
        # The timer closes the trust window; wake the task so it drops the lease.
        lease.on_lost(lambda _e: self._changed.set())
        self._changed.set()
        if old is not None:
            old._lose(SUPERSEDED, cause="superseded")
        return lease

    def remove(self, lease: AsyncHeldLease) -> None:
        """Stop renewing `lease` (before releasing it)."""
        self._core.remove(lease)

    async def _run(self) -> None:
        clock = self.clock
        while not self._closed:
            now = clock.monotonic()
            for lease in self._core.sweep(now):  # signal it whoever noticed first
                lease._lose(TRUST_CLOSED, cause="trust_window")
            for claim in self._core.take_releases():
                await self._release_quietly(claim)
            batch = self._core.due_batch(now)
            if batch:
                await self._beat(batch)
                continue
            due = self._core.next_due()
            self._changed.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
            # cancellation that races with the event being set.
            wait = real_wait(clock, None if due is None else due - clock.monotonic())
            try:
                async with asyncio.timeout(wait):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def _execute(self, limit: float, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run one call on the keeper's line; after `limit` seconds the channel
        is told to abort it (a loop timer: nothing here waits for the network)."""

        def stuck() -> None:
            self._core.stats.aborted += 1
            log.warning("keeper statement outlasted its limit (dead connection?); reconnecting")
            self._channel.abort()

        timer = self._loop.call_later(limit, stuck)
        try:
            return await call(*args)
        finally:
            timer.cancel()

    async def _beat(self, batch: list[AsyncHeldLease]) -> None:
        started = self.clock.monotonic()
        real_start = time.monotonic()
        # A client-side bound too: a beat hung on a dead connection is abandoned
        # and retried on a new one before the trust windows close.
        limit = self._core.beat_limit(batch, started)
        try:
            async with asyncio.timeout(limit + self._connect_timeout):
                await self._channel.connect()
            rows = await self._execute(limit, self._channel.heartbeat, self._core.items(batch))
        except (PgleaseError, OSError, TimeoutError) as exc:
            await self._channel.close()
            self._core.on_error(batch, exc)
            return
        round_trip = time.monotonic() - real_start
        for lease, reason, cause in self._core.on_rows(batch, rows, started, round_trip):
            lease._lose(reason, cause=cause)

    async def _release_quietly(self, claim: Claim) -> None:
        try:
            async with asyncio.timeout(RELEASE_LIMIT + self._connect_timeout):
                await self._channel.connect()
            await self._execute(RELEASE_LIMIT, self._channel.release, claim)
        except LeaseLostError:
            pass  # already gone in the database: nothing to give back
        except (PgleaseError, OSError, TimeoutError):
            await self._channel.close()  # best effort: the lease runs out by itself


__all__ = ["AsyncKeeper", "AsyncStoreInfo", "Keeper", "LeaseLostError", "StoreInfo"]
