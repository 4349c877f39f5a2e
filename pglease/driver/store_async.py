"""The store driver protocol: what the one lease store (`pglease.store`) needs
from a backend, one operation per frozen parameter type (`pglease.driver.ops`).

`AsyncStoreDriver` is the asyncio source; `StoreDriver` in
`pglease/driver/store.py` is its generated blocking twin. A driver is generic
in its own connection type `C`, the one `connection()` lends and a mutation's
`apply` receives. The store has checked every argument before a driver sees
it; a driver raises only `PgleaseError`s (its library's errors are mapped in
one place, in the driver), except what the caller's own `apply` raises.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

from ..errors import LeaseLostError
from ..types import Claim, Event, MutationResult, ResourceState
from .ops import (
    ClaimManyOp,
    ClaimOp,
    EnsureOp,
    EventsOp,
    GetOp,
    ListOp,
    MutateOp,
    ReadLogOp,
    ReleaseManyOp,
    ReleaseOp,
    RenewManyOp,
    RenewOp,
)

#: Covariant: a driver lends its connections and hands them to `apply`.
C = TypeVar("C", covariant=True)


class AsyncStoreDriver(Protocol[C]):
    """A backend's lease-store operations (PostgreSQL: `pglease.postgres`,
    SQLite: `pglease.sqlite`)."""

    async def open(self) -> None:
        """Connect (and migrate, if asked to); opening twice is harmless."""
        ...

    async def close(self) -> None:
        """Release every connection; closing twice is harmless."""
        ...

    async def migrate(self) -> list[str]:
        """Apply pending migrations; the names of those applied."""
        ...

    def connection(self) -> AbstractAsyncContextManager[C]:
        """Lend one of the driver's own connections (its errors are the library's)."""
        ...

    async def ensure_resource(self, op: EnsureOp) -> str:
        """The resource's deterministic id, created if needed."""
        ...

    async def claim(self, op: ClaimOp) -> Claim | None:
        """The new claim, or None while another holder's lease is live."""
        ...

    async def renew(self, op: RenewOp) -> Claim:
        """The renewed claim (new expiry and revision)."""
        ...

    async def release(self, op: ReleaseOp) -> int:
        """The resource's new revision."""
        ...

    async def claim_many(self, op: ClaimManyOp) -> list[Claim | None]:
        """Per item, in `op`'s order, what `claim` returns; one transaction."""
        ...

    async def renew_many(self, op: RenewManyOp) -> list[Claim | LeaseLostError]:
        """Per item, in `op`'s order, the renewed claim or why it is not current;
        one transaction."""
        ...

    async def release_many(self, op: ReleaseManyOp) -> list[int | LeaseLostError]:
        """Per item, in `op`'s order, the new revision or why it is not current;
        one transaction."""
        ...

    async def mutate(
        self, op: MutateOp, apply: Callable[[C], Awaitable[Any]] | None
    ) -> MutationResult:
        """Check the permit, run `apply(conn)` (its exceptions propagate) and append
        the event, in one transaction."""
        ...

    async def get(self, op: GetOp) -> ResourceState:
        """One resource (UnknownResourceError if there is none)."""
        ...

    async def list_resources(self, op: ListOp) -> list[ResourceState]:
        """Resources ordered by type and key."""
        ...

    async def events(self, op: EventsOp) -> list[Event]:
        """A resource's events in revision order (UnknownResourceError if none such)."""
        ...

    async def read_log(self, op: ReadLogOp) -> list[Event]:
        """The log's committed events after the cursor, which is checked against this log."""
        ...
