# Generated from pglease/runtime/_election_async.py by tools/async_to_sync.py: do not edit.
"""Leader election, asyncio source: `_election` is its generated blocking twin.

What an election is (campaign, term, deposition, resignation) is told in
`pglease.runtime.election`, the public module. The flavours differ in where
the campaign runs: a daemon thread for `Election`, a task on the running loop
for `AsyncElection`, which `stop` may also cancel while it is still
campaigning (the acquire cleans up after itself).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from .._compat import Event
from ..clock import SYSTEM_CLOCK, Clock
from ..driver.runtime_api import Leader
from ..errors import AcquireTimeoutError, LeaseLostError, PgleaseError, UnknownResourceError
from ..ids import resource_id
from ..types import Owner
from ._acquire import LeaseStore, _acquire
from ._acquire_core import _same_clock
from ._election_core import _RETRY, ELECTION_TYPE, _call, _leader_of
from ._timing import Timing, real_wait
from .keeper import Keeper
from .lease import HeldLease

log = logging.getLogger("pglease.runtime")


def leader(store: Any, name: str) -> Leader | None:
    """The current leader of election `name` by the database clock, or None."""
    try:
        return _leader_of(store.get(resource_id(ELECTION_TYPE, name)))
    except UnknownResourceError:
        return None


def _wait(event: Event, timeout: float | None) -> bool:
    """Wait for `event` at most `timeout` real seconds (None: no end); True if set."""
    return event.wait(timeout)


class Election:
    """One candidate in election `name`, campaigning on its own thread (asyncio:
    in a task on the loop that starts it).

    `on_elected(lease)` runs when it becomes leader, `on_deposed(lease)` when it
    stops being leader (loss or resignation); both on the election thread
    (asyncio: on the loop). On resignation `on_deposed` runs before the lease
    is released, so no other candidate is elected until it returns.
    """

    def __init__(
        self,
        store: LeaseStore,
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
        if keeper is not None:
            _same_clock(keeper.clock, clock)
        self._clock = clock or SYSTEM_CLOCK
        # An asyncio keeper belongs to the running loop, which may not exist yet:
        # the shared one is looked up when the campaign starts. A blocking one is
        # taken at once, so a store that cannot have one fails here, not in the thread.
        self._keeper = keeper
        if keeper is None:
            self._keeper = Keeper.for_store(store, self._clock)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._fair = fair
        self._stop = Event()
        # Set by `stop` and by the lease's loss: the leader's wait ends.
        self._wake = Event()
        self._elected = Event()
        self._resign = True
        self._lease: HeldLease | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.name = f"pglease-elect-{name}"

    def start(self) -> Election:
        """Start campaigning (once); returns the election."""
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def __enter__(self) -> Election:
        return self.start()

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
        """Wait until this candidate is leader (True) or `timeout` passes (False)."""
        return _wait(self._elected, timeout) and self.is_leader

    def stop(self, resign: bool = True, timeout: float = 15.0) -> None:
        """Stop campaigning; with `resign`, release the lease if leader. Waits at
        most `timeout` seconds for the campaign to end (asyncio: then cancels it)."""
        self._resign = resign
        self._stop.set()
        self._wake.set()
        thread, here = self._thread, threading.current_thread()
        if thread.is_alive() and thread is not here:
            thread.join(timeout)

    def _run(self) -> None:
        keeper = self._keeper
        if keeper is None:
            keeper = self._keeper = Keeper.for_store(self._store, self._clock)
        clock = keeper.clock
        while not self._stop.is_set():
            try:
                keeper.connect()  # no claim it could not renew
                claim, requested_at = _acquire(
                    self._store, ELECTION_TYPE, self.name, self.candidate, self.timing.ttl,
                    None, self._fair, True, stop=self._stop, clock=clock,
                    trust=self.timing.ttl - self.timing.margin, on_late=keeper.release_later,
                )  # fmt: skip
            except AcquireTimeoutError:
                break  # stopped (the acquire has no timeout of its own)
            except (PgleaseError, OSError) as exc:
                log.warning("election %s: campaign failed, retrying: %s", self.name, exc)
                _wait(self._stop, _RETRY)
                continue
            lease = keeper.add(claim, self.timing, requested_at)
            self._wake.clear()
            lease.on_lost(lambda _e: self._wake.set())
            self._lease = lease
            self._elected.set()
            _call(self._on_elected, lease, "on_elected")
            # `_stop` too: a stop between the acquire and the clear above.
            while not self._stop.is_set() and not _wait(
                self._wake, real_wait(clock, lease.time_left())
            ):
                with contextlib.suppress(LeaseLostError):
                    lease.check()  # the clock decides even if the watchdog is late
            self._elected.clear()
            deposed = False
            if self._stop.is_set():
                keeper.remove(lease)
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
    store: LeaseStore,
    name: str,
    candidate: Owner,
    *,
    ttl: float = 10.0,
    on_elected: Callable[[HeldLease], object] | None = None,
    on_deposed: Callable[[HeldLease], object] | None = None,
    **kwargs: Any,
) -> Election:
    """Start campaigning in election `name` as `candidate`; returns the running
    election (use it as a context manager, or call `stop()`; asyncio: await both)."""
    return Election(
        store, name, candidate, ttl=ttl, on_elected=on_elected, on_deposed=on_deposed, **kwargs
    ).start()
