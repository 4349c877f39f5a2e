"""Parameters, results and operations of log maintenance: the reaper and prune.

A sibling of the runtime driver protocol (`protocol`): the same runtime
driver objects (``store.runtime_driver()``) implement it on both backends, so
`pglease.watch.reaper` and `pglease.watch.prune` need no backend of their own.
Arguments arrive validated (`pglease.watch`); every operation raises only
`PgleaseError`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ReapRequest:
    """Record the expiry of up to `limit` leases whose ttl ran out without a
    release and whose expiry is not recorded yet, one lease per transaction."""

    limit: int


@dataclass(frozen=True, slots=True)
class ReapReport:
    """The resources whose `lease.expired` event this reap wrote, in the order
    it wrote them (a lease a writer was busy with is left for the next reap)."""

    resource_ids: tuple[str, ...]

    @property
    def reaped(self) -> int:
        return len(self.resource_ids)


@dataclass(frozen=True, slots=True)
class PruneRequest:
    """Delete the prefix of the log (in read order) created more than
    `older_than` seconds ago by the backend's clock, `chunk` events per
    transaction, raising the prune horizon with each chunk; then the payloads
    of the deleted events that no remaining event references.

    `respect_ttl`: refuse (`ValidationError`, nothing deleted) an `older_than`
    shorter than the longest ttl of a lease held now, from its last renewal.
    """

    older_than: float
    chunk: int
    respect_ttl: bool = False


def ttl_refusal(older_than: float, longest: float | None) -> str | None:
    """Why a `respect_ttl` prune is refused (None: it is not), the same words
    on every backend."""
    if longest is None or older_than >= longest:
        return None
    return (
        f"older_than {older_than:g}s is shorter than the longest TTL in use ({longest:g}s,"
        " a held lease): it would delete the history of leases still running"
    )


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What a prune deleted."""

    events: int
    payloads: int


class MaintenanceDriver(Protocol):
    """What the reaper and prune need from a backend (blocking)."""

    def reap(self, request: ReapRequest) -> ReapReport:
        """Write the `lease.expired` events `request` asks for."""

    def prune(self, request: PruneRequest) -> PruneReport:
        """Delete old events and their unreferenced payloads, in chunks."""


class AsyncMaintenanceDriver(Protocol):
    """The asyncio twin of `MaintenanceDriver`."""

    async def reap(self, request: ReapRequest) -> ReapReport:
        """Asyncio twin of `MaintenanceDriver.reap`."""

    async def prune(self, request: PruneRequest) -> PruneReport:
        """Asyncio twin of `MaintenanceDriver.prune`."""
