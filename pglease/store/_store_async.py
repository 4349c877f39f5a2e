"""The lease store, written once above the store drivers.

`AsyncLeaseStore` is the asyncio source; `LeaseStore` in
`pglease/store/_store.py` is its generated blocking twin. What every backend
shares lives here, once: the argument checks (`pglease._common`, before
anything reaches a driver), the metrics (`_instrument.recorder`), building the
driver's parameter objects (`pglease.driver.ops`), and the facade methods
that hand the store to the runtime (`hold`, `acquire`, `elect`, `leader`,
`watch`, through `pglease.driver.runtime_api`). The backends' stores
(`PostgresStore`, `SqliteStore` and their asyncio twins) are thin
constructors: a subclass that builds its driver.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from .. import _common, _instrument
from ..driver.runtime_api import Leader, runtime
from ..errors import LeaseLostError, PgleaseError
from ..types import Claim, Event, MutationResult, Owner, Permit, ResourceState
from ..validation import check_apply

if TYPE_CHECKING:
    from .._watch_common import HubTuning
    from ..clock import Clock
    from ..driver import AsyncRuntimeDriver
    from ..driver.store_async import AsyncStoreDriver
    from ..runtime import AsyncElection, AsyncHeldLease

C = TypeVar("C")
W = TypeVar("W")
T = TypeVar("T")


class AsyncLeaseStore(ABC, Generic[C, W]):
    """Leases, revisions and the event log over one store driver.

    `C` is the driver's connection type (what `connection()` lends and a
    mutation's `apply` receives), `W` the type of the backend's watchers.
    """

    def __init__(self, driver: AsyncStoreDriver[C]) -> None:
        self._driver = driver

    # async-only: begin
    @classmethod
    async def open(cls, *args: Any, **kwargs: Any) -> Self:
        """An open store: the constructor's arguments, then connect."""
        store = cls(*args, **kwargs)
        await store._open()
        return store

    # async-only: end
    async def _open(self) -> None:
        await self._driver.open()

    async def __aenter__(self) -> Self:
        await self._open()  # sync: -
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the store's connections; closing twice is harmless."""
        await self._driver.close()

    def connection(self) -> AbstractAsyncContextManager[C]:
        """Borrow one of the driver's own connections (autocommit).

        Errors of the SQL run on it are the driver library's (the caller's own
        statements), as are those of checking it out of a PostgreSQL pool.
        """
        return self._driver.connection()

    async def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""
        return await self._driver.migrate()

    async def ensure_resource(self, resource_type: str, key: str) -> str:
        """Create the resource if needed and return its deterministic id (no event)."""
        return await self._driver.ensure_resource(_common.ensure_op(resource_type, key))

    async def claim(
        self,
        resource_id: str,
        owner: Owner,
        ttl: float,
        expected_revision: int | None = None,
        *,
        now: datetime | None = None,
    ) -> Claim | None:
        """Take the lease, or return None while another holder's lease is unexpired."""
        op = _common.claim_op(resource_id, owner, ttl, expected_revision, now)
        try:
            claim = await self._driver.claim(op)
        except PgleaseError as exc:
            _instrument.recorder.claim(_instrument.claim_error(exc))
            raise
        _instrument.recorder.claim("held" if claim is None else "claimed")
        return claim

    async def renew(
        self,
        claim: Claim,
        ttl: float,
        expected_revision: int | None = None,
        *,
        now: datetime | None = None,
    ) -> Claim:
        """Extend a current, unexpired lease; return the updated claim."""
        op = _common.renew_op(claim, ttl, expected_revision, now)
        try:
            renewed = await self._driver.renew(op)
        except PgleaseError as exc:
            _instrument.recorder.renewal("store", _instrument.lease_error(exc))
            raise
        _instrument.recorder.renewal("store", "renewed")
        return renewed

    async def release(
        self, claim: Claim, expected_revision: int | None = None, *, now: datetime | None = None
    ) -> int:
        """Give up a current lease (expired or not); return the new revision."""
        op = _common.release_op(claim, expected_revision, now)
        try:
            revision = await self._driver.release(op)
        except PgleaseError as exc:
            _instrument.recorder.release(_instrument.lease_error(exc))
            raise
        _instrument.recorder.release("released")
        return revision

    async def claim_many(
        self,
        resource_ids: Sequence[str],
        owner: Owner,
        ttl: float,
        *,
        now: datetime | None = None,
    ) -> list[Claim | None]:
        """Claim several leases in one round trip and one transaction.

        Returns, in the order of `resource_ids`, each item's result exactly as
        `claim` would return it: the new `Claim` (its own generation, token,
        revision and `lease.claimed` event), or None while another holder's
        lease is live. Per-item results, not all-or-nothing: the leases that
        were free are taken even when others are held. The whole batch is
        refused, before anything changes, for bad input (an empty or too
        large batch, see `MAX_BATCH`; a resource named twice; a malformed id,
        owner or ttl: `ValidationError`s) and for an unknown resource
        (`UnknownResourceError`). Locks are taken in resource-id order, so
        concurrent batches never deadlock whatever order they name the
        resources in. Every claim is trusted from the call's start
        (`Claim.trusted_until`). A connection lost after the batch was sent
        raises `BatchOutcomeUnknownError`: all items committed or none did.
        """
        op = _common.claim_many_op(resource_ids, owner, ttl, now)
        try:
            claims = await self._driver.claim_many(op)
        except PgleaseError as exc:
            outcome = _instrument.claim_error(exc)
            for _ in op.resource_ids:
                _instrument.recorder.claim(outcome)
            raise
        for claim in claims:
            _instrument.recorder.claim("held" if claim is None else "claimed")
        return claims

    async def renew_many(
        self, claims: Sequence[Claim], ttl: float, *, now: datetime | None = None
    ) -> list[Claim | LeaseLostError]:
        """Renew several leases in one round trip and one transaction.

        Returns, in the order of `claims`, each item's renewed `Claim` (a
        `lease.renewed` event and a new revision each), or the
        `LeaseLostError` (`LeaseExpiredError` for an expired one) that
        `renew` would have raised for it; the other items are renewed all the
        same. The whole batch is refused, changing nothing, for bad input
        (as `claim_many`) and an unknown resource, and raises as a single
        call would for any other error. A connection lost after the batch was
        sent raises `BatchOutcomeUnknownError`.
        """
        op = _common.renew_many_op(claims, ttl, now)
        try:
            results = await self._driver.renew_many(op)
        except PgleaseError as exc:
            for _ in op.claims:
                _instrument.recorder.renewal("store", _instrument.lease_error(exc))
            raise
        for result in results:
            outcome = "lost" if isinstance(result, LeaseLostError) else "renewed"
            _instrument.recorder.renewal("store", outcome)
        return results

    async def release_many(
        self, claims: Sequence[Claim], *, now: datetime | None = None
    ) -> list[int | LeaseLostError]:
        """Release several leases in one round trip and one transaction.

        Returns, in the order of `claims`, each item's new revision (a
        `lease.released` event each), or the `LeaseLostError` that `release`
        would have raised for it; the other items are released all the same.
        Refused as a whole as `renew_many` is.
        """
        op = _common.release_many_op(claims, now)
        try:
            results = await self._driver.release_many(op)
        except PgleaseError as exc:
            for _ in op.claims:
                _instrument.recorder.release(_instrument.lease_error(exc))
            raise
        for result in results:
            outcome = "lost" if isinstance(result, LeaseLostError) else "released"
            _instrument.recorder.release(outcome)
        return results

    async def mutate(
        self,
        permit: Permit,
        event_type: str,
        apply: Callable[[C], Awaitable[T]] | None = None,
        payload: Any = None,
        *,
        actor: Owner | None = None,
        now: datetime | None = None,
    ) -> MutationResult:
        """Check the permit, run `apply(conn)` and append the event, all in one transaction.

        `apply` gets the driver's own connection inside the transaction and must
        not commit or roll back. Any exception (a stale permit, a lost lease, or
        one raised by `apply`) rolls everything back: no revision bump, no
        event, no payload. What `apply` raises propagates unchanged, its SQL's
        own errors too (say a UniqueViolation or an IntegrityError); only what
        pglease causes is mapped: a lost connection, the store's time limits,
        pglease's own errors, trouble with a SQLite file. Never retried:
        `apply` runs once. With a lease, the transaction cannot outlast it: a
        write committing after the expiry is refused, and on PostgreSQL the
        server ends a transaction still open just past the expiry (both
        `LeaseExpiredError`, nothing committed).
        """
        check_apply(apply)
        op = _common.mutate_op(permit, event_type, payload, actor, now)
        return await self._driver.mutate(op, apply)

    async def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        """The resource with its lease state, judged by the store's clock (or `now`)."""
        return await self._driver.get(_common.get_op(resource_id, now))

    async def list_resources(
        self, resource_type: str | None = None, *, now: datetime | None = None
    ) -> list[ResourceState]:
        """All resources (or those of one type), ordered by type and key."""
        return await self._driver.list_resources(_common.list_op(resource_type, now))

    async def events(
        self, resource_id: str, after_revision: int = 0, limit: int = 1000
    ) -> list[Event]:
        """A resource's events in revision order, after `after_revision`."""
        return await self._driver.events(_common.events_op(resource_id, after_revision, limit))

    async def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        """Committed events after `cursor` (None or "start": from the beginning).

        Pass the last event's `cursor` to get the next page; no event is ever
        skipped or repeated, even when transactions commit out of id order.
        """
        return await self._driver.read_log(_common.read_log_op(cursor, limit))

    # --- fleet runtime (see pglease.runtime) -------------------------------------------

    @abstractmethod
    def runtime_driver(self) -> AsyncRuntimeDriver:
        """The runtime driver (`pglease.driver`) that hold, acquire and elect use."""

    def hold(
        self, resource_type: str, key: str, owner: Owner, ttl: float, **options: Any
    ) -> AbstractAsyncContextManager[AsyncHeldLease]:
        """Hold a lease for a block, renewed by a keeper: ``(async) with
        store.hold(type, key, owner, ttl) as lease:``; see `pglease.runtime.hold`
        (and `hold_async`)."""
        hold = runtime().hold_async  # sync: hold = runtime().hold
        return hold(self, resource_type, key, owner, ttl, **options)

    async def acquire(
        self,
        resource_type: str,
        key: str,
        owner: Owner,
        ttl: float,
        timeout: float | None = None,
        **options: Any,
    ) -> Claim:
        """Wait for the lease and claim it (``fair=True``: in arrival order); see
        `pglease.runtime.acquire` (and `acquire_async`)."""
        acquire = runtime().acquire_async  # sync: acquire = runtime().acquire
        return await acquire(self, resource_type, key, owner, ttl, timeout, **options)

    async def elect(self, name: str, candidate: Owner, **options: Any) -> AsyncElection:
        """Campaign for leadership of `name`; see `pglease.runtime.elect` (and `elect_async`)."""
        elect = runtime().elect_async  # sync: elect = runtime().elect
        election: AsyncElection = await elect(self, name, candidate, **options)
        return election

    async def leader(self, name: str) -> Leader | None:
        """The current leader of election `name` and its generation, if any."""
        leader = runtime().leader_async  # sync: leader = runtime().leader
        return await leader(self, name)

    def watch(
        self,
        *,
        after: str | None = "now",
        types: Iterable[str] | str | None = None,
        resources: Iterable[str] | str | None = None,
        event_types: Iterable[str] | str | None = None,
        mode: str | None = None,
        interval: float | None = None,
        max_pending: int = 10_000,
        retry_window: float = 30.0,
        clock: Clock | None = None,
        tuning: HubTuning | None = None,
        stall_timeout: float = 5.0,
    ) -> W:
        """Stream committed events gap-free from `after` (a cursor, "now" or "start").

        A watcher more than `max_pending` events behind the stream reads the
        missed span from the log itself (bounded memory, nothing lost). Errors
        that cannot heal, or that last `retry_window` seconds, reach the consumer
        as `WatchFailedError`; `watcher.health` tells the last error and the lag.
        On PostgreSQL a round trip unanswered for `stall_timeout` seconds (a
        stalled path, a hung server) is such an error, and the stream reads at
        least that often; SQLite checks and ignores it (a local file).
        On PostgreSQL `mode` defaults to "listen", or "poll" in pooler mode
        (where "listen" is refused: a pooler does not keep a LISTEN's session);
        SQLite polls the event table every `interval` seconds (50 ms default),
        refuses "listen" and ignores `tuning` (no hub). See
        `pglease.watch.Watcher` and `pglease.sqlite.watch`."""
        return self._watcher(
            after=after,
            types=types,
            resources=resources,
            event_types=event_types,
            mode=mode,
            interval=interval,
            max_pending=max_pending,
            retry_window=retry_window,
            clock=clock,
            tuning=tuning,
            stall_timeout=stall_timeout,
        )

    @abstractmethod
    def _watcher(self, **options: Any) -> W:
        """The backend's watcher over this store (`watch`'s arguments, checked there)."""
