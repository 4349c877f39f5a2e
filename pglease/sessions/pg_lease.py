# Generated from pglease/sessions/pg_lease_async.py by tools/async_to_sync.py: do not edit.
"""The writer lease of a PostgreSQL session handle, asyncio source of `pg_lease`.

A handle's lease is the pglease lease on ``("session", id)``. With background
renewal (the repository's `renew_interval`, 15 s by default) it is a held
lease of the store's keeper (`pglease.runtime.keeper`): the same
`Keeper.for_store(store, clock)` that `hold()` uses, so one store renews every
lease of the process, sessions and holds alike, in one batch heartbeat per
beat on the keeper's own connection. A heartbeat extends the expiry only: no
revision bump, no event. Without background renewal (`renew_interval=None`)
the lease is renewed only by `renew()` and the handle keeps its own trust
window.

Timing: the keeper renews every `renew_interval` seconds, as the session API
has always promised, and trusts the lease until ``request start +
lease_seconds - margin`` (margin ``min(lease_seconds / 10, renew_interval /
2)``, 3 s for 30 s). `hold()` refuses intervals above ttl/3
(`Timing.of`); sessions accept any interval below `lease_seconds` and keep
15 of 30 by default. That is sparser than ttl/3 but still safe: a failed beat is retried
(50 ms, doubling, at most a quarter interval apart) until the trust window
closes, 12 s after the beat was due with the defaults. ``renew_interval=10``
gives `hold()`'s cadence.

A handle that is dropped without `close()` stops being renewed (a finalizer
takes its lease out of the keeper), so its lease runs out as before: nothing
the keeper holds refers to the handle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..clock import Clock
from ..driver.protocol import HeartbeatItem
from ..errors import LeaseLostError
from ..postgres import PostgresStore
from ..runtime import HeldLease, Keeper, Timing
from ..types import Claim


def writer_timing(lease_seconds: float, renew_interval: float) -> Timing:
    """The keeper's `Timing` for a session lease (see the module docstring).

    Built directly, not by `Timing.of`, which refuses an interval above ttl/3:
    the repository has checked ``0 < renew_interval < lease_seconds``, and the
    margin stays below the interval, so the keeper's rules hold.
    """
    return Timing(lease_seconds, renew_interval, min(lease_seconds / 10, renew_interval / 2))


def connected_keeper(store: PostgresStore, clock: Clock) -> Keeper:
    """The store's shared keeper on `clock`, its connection open: called before
    claiming, so a host that cannot get one fails at once (as `hold` does)."""
    keeper = Keeper.for_store(store, clock)
    keeper.connect()
    return keeper


def _drop(keeper: Keeper, held: HeldLease) -> None:
    """Finalizer of a handle dropped unclosed: stop renewing its lease (it runs out).

    It may run inside any thread's garbage collection, even in the middle of
    the keeper's own bookkeeping, so the removal is handed over to the
    keeper's loop (the twin: a short thread) instead of being done here.
    """
    with contextlib.suppress(RuntimeError):  # loop closed, or shutting down: nothing renews
        threading.Thread(target=keeper.remove, args=(held,), daemon=True).start()


class WriterLease:
    """One handle's writer lease: its claim, trust window and keeper registration."""

    def __init__(
        self,
        store: PostgresStore,
        claim: Claim,
        claimed_at: float,
        lease_seconds: float,
        clock: Clock,
        keeper: Keeper | None,
        timing: Timing | None,
    ) -> None:
        self._store = store
        #: The claim the handle writes with (fencing: owner, generation, token).
        self.claim = claim
        self._ttl = lease_seconds
        self.clock = clock
        self.keeper = keeper
        #: The keeper's held lease, or None without background renewal.
        self.held: HeldLease | None = None
        if keeper is not None:
            assert timing is not None
            self.held = keeper.add(claim, timing, claimed_at)
        # Without a keeper: trust until `request start + ttl` on `clock`.
        self._trusted_until = claimed_at + lease_seconds
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def watch(self, handle: object, lost: Callable[[Any, LeaseLostError], None]) -> None:
        """Call ``lost(handle, error)`` when the keeper loses the lease, and stop
        renewing it once `handle` is garbage. Only weak references to `handle`
        are kept, and `lost` must not be bound to it."""
        held, keeper = self.held, self.keeper
        if held is None or keeper is None:
            return
        ref = weakref.ref(handle)

        def on_lost(error: LeaseLostError) -> None:
            target = ref()
            if target is not None:
                lost(target, error)

        held.on_lost(on_lost)
        self._finalizer = weakref.finalize(handle, _drop, keeper, held)
        self._finalizer.atexit = False  # at exit nothing renews anyway

    def trust_expired(self) -> bool:
        """True once the lease may have run out by the local clock."""
        if self.held is not None:
            return self.held.time_left() <= 0
        return self.clock.monotonic() >= self._trusted_until

    def window_closed(self) -> bool:
        """True when a loss was the trust window closing (not the database's verdict)."""
        return self.held is not None and self.held.time_left() <= 0

    def check(self) -> None:
        """A trust window that closed unnoticed is a loss now (the keeper's
        `on_lost` runs); without a keeper the database judges at the next call."""
        if self.held is not None:
            self.held.expire_if_due()

    def renew(self) -> str:
        """One heartbeat now; the status ("renewed", "busy", "lost", "expired", ...)."""
        started = self.clock.monotonic()
        item = HeartbeatItem(self.claim, self._ttl)
        [beat] = self._store.runtime_driver().heartbeat([item])
        if beat.status != "renewed" or beat.expires_at is None:
            return beat.status
        self.claim = dataclasses.replace(self.claim, expires_at=beat.expires_at)
        if self.held is None:
            self._trusted_until = started + self._ttl
        elif not self.held.record_renewal(started, beat.expires_at):
            self.held.expire_if_due()
            return "lost"  # the trust window had closed before the answer came
        return "renewed"

    def stop(self, reason: str) -> None:
        """Take the lease out of the keeper (before releasing or abandoning it);
        a beat in flight then changes nothing and signals no loss."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if self.held is not None and self.keeper is not None:
            self.keeper.remove(self.held)
            self.held.end(reason)
