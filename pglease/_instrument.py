"""The instrumentation seam: what the store, keepers, acquire, the watch hub, the
reaper and prune report, with no metrics library behind it.

Each hook is a method of `recorder`, a module-level `Recorder` whose methods do
nothing: a call costs one attribute lookup and an empty call, and nothing here
imports prometheus_client. `pglease.metrics.enable()` swaps in a recorder that
updates Prometheus collectors (`install`). Call sites read `recorder` at call
time (``_instrument.recorder.claim(...)``), never bind it at import, so the
swap reaches them.

Label values passed here are closed sets (see `pglease.metrics` for the list):
never a resource key, an owner or an error text.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sized
from typing import TYPE_CHECKING

from .errors import AcquireTimeoutError, LeaseLostError, LockTimeoutError, ValidationError

if TYPE_CHECKING:
    from .types import Event


class Recorder:
    """The no-op recorder; `pglease.metrics` subclasses it."""

    def claim(self, outcome: str) -> None:
        """A claim attempt: claimed, held, busy or error."""

    def renewal(self, source: str, outcome: str) -> None:
        """A renewal by the store API or a keeper: renewed, busy, lost or error."""

    def release(self, outcome: str) -> None:
        """A release through the store API: released, lost or error."""

    def heartbeat(self, seconds: float) -> None:
        """A keeper beat answered after `seconds` (real time)."""

    def heartbeat_failed(self) -> None:
        """A keeper beat failed (it is retried)."""

    def heartbeat_lateness(self, seconds: float) -> None:
        """A keeper beat started `seconds` after the earliest lease in it was due."""

    def lease_lost(self, cause: str) -> None:
        """A held lease was lost (counted once per lease)."""

    def acquire_wait(self, seconds: float, outcome: str) -> None:
        """A blocking acquire ended after `seconds`: acquired, timeout, cancelled or error."""

    def hub_read(self, mode: str, events: list[Event]) -> None:
        """A watch hub read the log (`events`, possibly none)."""

    def hub_reconnect(self, mode: str) -> None:
        """A watch hub opened a connection again after losing one."""

    def reaped(self, leases: int) -> None:
        """A reaper pass wrote `leases` lease.expired events."""

    def pruned(self, events: int, payloads: int) -> None:
        """A prune deleted `events` events and `payloads` payloads."""


#: The recorder every hook calls; a no-op until `install` replaces it.
recorder: Recorder = Recorder()


def install(new: Recorder) -> None:
    """Make `new` the recorder of the process (`pglease.metrics.enable` calls this)."""
    global recorder
    recorder = new


# Keepers' lease tables, for the leases-held gauge: read when it is scraped, so
# holding a lease costs nothing extra. Weak: a keeper that is gone drops out.
_keepers: weakref.WeakSet[Sized] = weakref.WeakSet()
_keepers_lock = threading.Lock()


class _Table:
    """A keeper's lease dict, wrapped: a dict cannot be weakly referenced."""

    __slots__ = ("__weakref__", "leases")

    def __init__(self, leases: Sized) -> None:
        self.leases = leases

    def __len__(self) -> int:
        return len(self.leases)


def track_keeper(leases: Sized) -> Sized:
    """Count `leases` (a keeper's table) in the leases-held gauge; return the handle
    to pass to `untrack_keeper`. The keeper must keep the handle alive."""
    table = _Table(leases)
    with _keepers_lock:
        _keepers.add(table)
    return table


def untrack_keeper(handle: Sized) -> None:
    """A closed keeper renews nothing: stop counting its leases."""
    with _keepers_lock:
        _keepers.discard(handle)


def leases_held() -> int:
    """Leases the process's live keepers are renewing now."""
    with _keepers_lock:
        tables = list(_keepers)
    return sum(len(table) for table in tables)


def claim_error(exc: BaseException) -> str:
    """The claims_total outcome of a claim that raised."""
    return "busy" if isinstance(exc, LockTimeoutError) else "error"


def lease_error(exc: BaseException) -> str:
    """The outcome of a renewal or release that raised."""
    return "lost" if isinstance(exc, LeaseLostError) else "error"


def acquire_outcome(exc: BaseException) -> str | None:
    """The acquire_wait outcome of an acquire that raised; None for bad input
    (it never waited)."""
    if isinstance(exc, ValidationError):
        return None
    if isinstance(exc, AcquireTimeoutError):
        return "timeout"
    if isinstance(exc, Exception):
        return "error"
    return "cancelled"  # CancelledError, KeyboardInterrupt, SystemExit
