"""Leader election on top of leases: the leader is whoever holds the lease on
(``election``, name); its generation is the leader's fencing token (a term).

A candidate campaigns with a blocking acquire (woken by release/expiry events
and the known expiry, not a poll), then keeps the lease with the keeper. It
is deposed the moment the lease is lost (taken over, or its trust window
closed) and then campaigns again. Stopping with ``resign=True`` releases the
lease so another candidate is elected at once.

A candidate takes its keeper's connection before each campaign: while none can
be had it does not claim, it logs and tries again. ``clock=`` (default: the
keeper's, else the system clock) decides the trust window, as for `hold`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..clock import SYSTEM_CLOCK, Clock
from ..driver.runtime_api import Leader as Leader
from ..errors import AcquireTimeoutError, LeaseLostError, PgleaseError, UnknownResourceError
from ..ids import resource_id
from ..types import Owner, ResourceState
from ._timing import Timing, real_wait
from .acquire import AsyncLeaseStore, SyncLeaseStore, _acquire, _acquire_async, _same_clock
from .keeper import AsyncKeeper, Keeper
from .lease import AsyncHeldLease, HeldLease

log = logging.getLogger("pglease.fleet")

#: The resource type elections use; the election name is the key.
ELECTION_TYPE = "election"
_RETRY = 0.5


def _leader_of(state: ResourceState) -> Leader | None:
    lease = state.lease
    if not lease.held or lease.owner is None or lease.expires_at is None:
        return None
    return Leader(lease.owner, lease.generation, lease.expires_at)


def leader(store: Any, name: str) -> Leader | None:
    """The current leader of election `name` by the database clock, or None."""
    try:
        return _leader_of(store.get(resource_id(ELECTION_TYPE, name)))
    except UnknownResourceError:
        return None


async def leader_async(store: Any, name: str) -> Leader | None:
    """Asyncio twin of `leader`."""
    try:
        return _leader_of(await store.get(resource_id(ELECTION_TYPE, name)))
    except UnknownResourceError:
        return None


def _call(callback: Callable[[Any], object] | None, lease: Any, what: str) -> None:
    if callback is not None:
        try:
            callback(lease)
        except Exception:
            log.exception("%s callback failed", what)


class Election:
    """One candidate in election `name`, campaigning on its own thread.

    `on_elected(lease)` runs when it becomes leader, `on_deposed(lease)` when it
    stops being leader (loss or resignation); both on the election thread. On
    resignation `on_deposed` runs before the lease is released, so no other
    candidate is elected until it returns.
    """

    def __init__(
        self,
        store: SyncLeaseStore,
        name: str,
        candidate: Owner,
        *,
        ttl: float = 10.0,
        interval: float | None = None,
        margin: float | None = None,
        on_elected: Callable[[HeldLease], object] | None = None,
        on_deposed: Callable[[HeldLease], object] | None = None,
        keeper: Keeper | None = None,
        fair: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.timing = Timing.of(ttl, interval, margin)
        resource_id(ELECTION_TYPE, name)  # validate the name now
        self.name = name
        self.candidate = candidate
        self._store = store
        # Not `keeper or ...`: a keeper with no leases yet is falsy (it has __len__).
        self._keeper = (
            keeper if keeper is not None else Keeper.for_store(store, clock or SYSTEM_CLOCK)
        )
        _same_clock(self._keeper.clock, clock)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._fair = fair
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._elected = threading.Event()
        self._resign = True
        self._lease: HeldLease | None = None
        self._thread = threading.Thread(target=self._run, name=f"pglease-elect-{name}", daemon=True)

    def start(self) -> Election:
        self._thread.start()
        return self

    def __enter__(self) -> Election:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def is_leader(self) -> bool:
        lease = self._lease
        return lease is not None and lease.lost_error is None and lease.time_left() > 0

    @property
    def lease(self) -> HeldLease | None:
        """The lease while leader (its `generation` is the term)."""
        return self._lease if self.is_leader else None

    def wait_elected(self, timeout: float | None = None) -> bool:
        """Block until this candidate is leader (True) or `timeout` passes (False)."""
        return self._elected.wait(timeout) and self.is_leader

    def stop(self, resign: bool = True, timeout: float = 15.0) -> None:
        """Stop campaigning; with `resign`, release the lease if leader."""
        self._resign = resign
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            clock = self._keeper.clock
            try:
                self._keeper.connect()  # no claim it could not renew
                claim, requested_at = _acquire(
                    self._store, ELECTION_TYPE, self.name, self.candidate, self.timing.ttl,
                    None, self._fair, True, stop=self._stop, clock=clock,
                )  # fmt: skip
            except AcquireTimeoutError:
                break
            except (PgleaseError, OSError) as exc:
                log.warning("election %s: campaign failed, retrying: %s", self.name, exc)
                self._stop.wait(_RETRY)
                continue
            lease = self._keeper.add(claim, self.timing, requested_at)
            self._wake.clear()
            lease.on_lost(lambda _e: self._wake.set())
            self._lease = lease
            self._elected.set()
            _call(self._on_elected, lease, "on_elected")
            while not self._wake.wait(real_wait(clock, lease.time_left())):
                with contextlib.suppress(LeaseLostError):
                    lease.check()  # the clock decides even if the watchdog is late
            self._elected.clear()
            deposed = False
            if self._stop.is_set():
                self._keeper.remove(lease)
                if self._resign and lease.lost_error is None:
                    # Deposed before the release: the leader's work ends before
                    # another candidate can be elected.
                    _call(self._on_deposed, lease, "on_deposed")
                    deposed = True
                    with contextlib.suppress(LeaseLostError, PgleaseError):
                        self._store.release(lease.claim)
                lease._close("resigned")
            if not deposed:
                _call(self._on_deposed, lease, "on_deposed")
            self._lease = None


def elect(
    store: SyncLeaseStore,
    name: str,
    candidate: Owner,
    *,
    ttl: float = 10.0,
    on_elected: Callable[[HeldLease], object] | None = None,
    on_deposed: Callable[[HeldLease], object] | None = None,
    **kwargs: Any,
) -> Election:
    """Start campaigning in election `name` as `candidate`; returns the running
    `Election` (use it as a context manager, or call `stop()`)."""
    return Election(
        store, name, candidate, ttl=ttl, on_elected=on_elected, on_deposed=on_deposed, **kwargs
    ).start()


class AsyncElection:
    """Asyncio twin of `Election`: campaigns in a task; callbacks run on the loop."""

    def __init__(
        self,
        store: AsyncLeaseStore,
        name: str,
        candidate: Owner,
        *,
        ttl: float = 10.0,
        interval: float | None = None,
        margin: float | None = None,
        on_elected: Callable[[AsyncHeldLease], object] | None = None,
        on_deposed: Callable[[AsyncHeldLease], object] | None = None,
        keeper: AsyncKeeper | None = None,
        fair: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.timing = Timing.of(ttl, interval, margin)
        resource_id(ELECTION_TYPE, name)
        self.name = name
        self.candidate = candidate
        self._store = store
        self._keeper = keeper
        if keeper is not None:
            _same_clock(keeper.clock, clock)
        self._clock = clock or SYSTEM_CLOCK
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._fair = fair
        self._stop = asyncio.Event()
        self._elected = asyncio.Event()
        self._resign = True
        self._lease: AsyncHeldLease | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> AsyncElection:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aenter__(self) -> AsyncElection:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def is_leader(self) -> bool:
        lease = self._lease
        return lease is not None and lease.lost_error is None and lease.time_left() > 0

    @property
    def lease(self) -> AsyncHeldLease | None:
        return self._lease if self.is_leader else None

    async def wait_elected(self, timeout: float | None = None) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._elected.wait()
        except TimeoutError:
            return False
        return self.is_leader

    async def stop(self, resign: bool = True) -> None:
        """Stop campaigning; with `resign`, release the lease if leader."""
        self._resign = resign
        self._stop.set()
        task = self._task
        if task is None:
            return
        if self._lease is None:
            task.cancel()  # still campaigning: the acquire cleans up after itself
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        keeper = self._keeper
        if keeper is None:
            keeper = AsyncKeeper.for_store(self._store, self._clock)
        while not self._stop.is_set():
            try:
                await keeper.connect()  # no claim it could not renew
                claim, requested_at = await _acquire_async(
                    self._store, ELECTION_TYPE, self.name, self.candidate, self.timing.ttl,
                    None, self._fair, True, clock=keeper.clock,
                )  # fmt: skip
            except (PgleaseError, OSError) as exc:
                log.warning("election %s: campaign failed, retrying: %s", self.name, exc)
                await asyncio.sleep(_RETRY)
                continue
            lease = keeper.add(claim, self.timing, requested_at)
            self._lease = lease
            self._elected.set()
            _call(self._on_elected, lease, "on_elected")
            stop_wait = asyncio.ensure_future(self._stop.wait())
            lost_wait = asyncio.ensure_future(lease.lost.wait())
            try:
                await asyncio.wait({stop_wait, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
                lost_wait.cancel()
            self._elected.clear()
            deposed = False
            if self._stop.is_set():
                keeper.remove(lease)
                if self._resign and lease.lost_error is None:
                    # Deposed before the release, as in the sync twin.
                    _call(self._on_deposed, lease, "on_deposed")
                    deposed = True
                    with contextlib.suppress(LeaseLostError, PgleaseError):
                        await self._store.release(lease.claim)
                lease._close("resigned")
            if not deposed:
                _call(self._on_deposed, lease, "on_deposed")
            self._lease = None


async def elect_async(
    store: AsyncLeaseStore,
    name: str,
    candidate: Owner,
    *,
    ttl: float = 10.0,
    on_elected: Callable[[AsyncHeldLease], object] | None = None,
    on_deposed: Callable[[AsyncHeldLease], object] | None = None,
    **kwargs: Any,
) -> AsyncElection:
    """Asyncio twin of `elect`: the running `AsyncElection` (``await e.stop()``)."""
    election = AsyncElection(
        store, name, candidate, ttl=ttl, on_elected=on_elected, on_deposed=on_deposed, **kwargs
    )
    return await election.start()
