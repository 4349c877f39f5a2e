"""`AsyncSqliteStore`: the asyncio twin of `SqliteStore` (same names and semantics).

sqlite3 blocks, so every call runs the `SqliteStore` method in a worker thread
and the event loop stays free while a call waits for the file's write lock.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from ..driver.runtime_api import Leader, runtime
from ..errors import StoreClosedError
from ..types import Claim, Event, MutationResult, Owner, Permit, ResourceState
from ._db import DEFAULT_BUSY_TIMEOUT, check_busy_timeout, check_path
from .runtime import AsyncSqliteRuntime
from .store import SqliteStore

T = TypeVar("T")
AsyncApply = Callable[[sqlite3.Connection], Awaitable[T]]


if TYPE_CHECKING:
    from .._watch_common import HubTuning
    from ..clock import Clock
    from ..runtime import AsyncElection, AsyncHeldLease
    from .watch import AsyncSqliteWatcher


class AsyncSqliteStore:
    """Asyncio lease store on one SQLite file. Open with
    ``await AsyncSqliteStore.open(path)`` or ``async with AsyncSqliteStore(path) as store``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        auto_migrate: bool = True,
    ) -> None:
        self.path = check_path(path)
        self.busy_timeout = check_busy_timeout(busy_timeout)
        self._auto_migrate = auto_migrate
        self._sync: SqliteStore | None = None
        self._runtime = AsyncSqliteRuntime(self)

    @classmethod
    async def open(cls, path: str | os.PathLike[str], **kwargs: Any) -> AsyncSqliteStore:
        store = cls(path, **kwargs)
        await store._open()
        return store

    async def _open(self) -> None:
        if self._sync is None:
            self._sync = await asyncio.to_thread(
                SqliteStore,
                self.path,
                busy_timeout=self.busy_timeout,
                auto_migrate=self._auto_migrate,
            )

    async def __aenter__(self) -> AsyncSqliteStore:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every pooled connection."""
        if self._sync is not None:
            store, self._sync = self._sync, None
            await asyncio.to_thread(store.close)

    @property
    def sync_store(self) -> SqliteStore:
        """The blocking store doing the work (raises if the store is not open)."""
        if self._sync is None:
            raise StoreClosedError("the store is not open (use `await AsyncSqliteStore.open()`)")
        return self._sync

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[sqlite3.Connection]:
        """Borrow an autocommit connection; its calls block, keep them short."""
        with self.sync_store.connection() as conn:
            yield conn

    async def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""
        return await asyncio.to_thread(self.sync_store.migrate)

    async def ensure_resource(self, resource_type: str, key: str) -> str:
        """Create the resource if needed and return its deterministic id (no event)."""
        return await asyncio.to_thread(self.sync_store.ensure_resource, resource_type, key)

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
        return await asyncio.to_thread(
            self.sync_store.claim, resource_id, owner, ttl, expected_revision, now=now
        )

    async def renew(
        self,
        claim: Claim,
        ttl: float,
        expected_revision: int | None = None,
        *,
        now: datetime | None = None,
    ) -> Claim:
        """Extend a current, unexpired lease; return the updated claim."""
        return await asyncio.to_thread(
            self.sync_store.renew, claim, ttl, expected_revision, now=now
        )

    async def release(
        self, claim: Claim, expected_revision: int | None = None, *, now: datetime | None = None
    ) -> int:
        """Give up a current lease (expired or not); return the new revision."""
        return await asyncio.to_thread(self.sync_store.release, claim, expected_revision, now=now)

    async def mutate(
        self,
        permit: Permit,
        event_type: str,
        apply: AsyncApply[T] | None = None,
        payload: Any = None,
        *,
        actor: Owner | None = None,
        now: datetime | None = None,
    ) -> MutationResult:
        """Like `SqliteStore.mutate`; `apply` is ``async def apply(conn)``.

        The transaction runs in a worker thread; `apply` runs on this event loop
        with the same connection while the thread waits, so its SQL commits
        atomically with the revision bump and the event. Cancelling the call
        before `apply` has finished rolls the transaction back; once COMMIT has
        started it completes and the caller just does not see the result.
        """
        store = self.sync_store
        if apply is None:
            return await asyncio.to_thread(
                store.mutate, permit, event_type, None, payload, actor=actor, now=now
            )
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()
        running: list[Future[T]] = []
        run_apply = apply

        def bridge(conn: sqlite3.Connection) -> T:
            if cancelled.is_set():
                raise asyncio.CancelledError
            future = asyncio.run_coroutine_threadsafe(_call(run_apply, conn), loop)
            running.append(future)
            # Checked after the append: a cancellation that set the flag before it
            # did not see this future in `running`, so cancel it here.
            if cancelled.is_set():
                future.cancel()
            return future.result()

        try:
            return await asyncio.to_thread(
                store.mutate, permit, event_type, bridge, payload, actor=actor, now=now
            )
        except asyncio.CancelledError:
            # The worker thread cannot be interrupted, but it can be told to roll back:
            # set the flag first, then cancel whatever apply already runs.
            cancelled.set()
            for future in list(running):
                future.cancel()
            raise

    async def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        """The resource with its lease state, judged by the host clock (or `now`)."""
        return await asyncio.to_thread(self.sync_store.get, resource_id, now=now)

    async def list_resources(
        self, resource_type: str | None = None, *, now: datetime | None = None
    ) -> list[ResourceState]:
        """All resources (or those of one type), ordered by type and key."""
        return await asyncio.to_thread(self.sync_store.list_resources, resource_type, now=now)

    async def events(
        self, resource_id: str, after_revision: int = 0, limit: int = 1000
    ) -> list[Event]:
        """A resource's events in revision order, after `after_revision`."""
        return await asyncio.to_thread(self.sync_store.events, resource_id, after_revision, limit)

    async def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        """Committed events after `cursor`, as `SqliteStore.events_after`."""
        return await asyncio.to_thread(self.sync_store.events_after, cursor, limit)

    # --- fleet runtime (see pglease.runtime) -------------------------------------------

    def runtime_driver(self) -> AsyncSqliteRuntime:
        """The runtime driver (`pglease.driver`) that hold, acquire and elect use."""
        return self._runtime

    def hold(
        self, resource_type: str, key: str, owner: Owner, ttl: float, **options: Any
    ) -> AbstractAsyncContextManager[AsyncHeldLease]:
        """Hold a lease for a block, renewed by the loop's keeper task: ``async with
        store.hold(type, key, owner, ttl) as lease:``; see `pglease.runtime.hold_async`."""
        return runtime().hold_async(self, resource_type, key, owner, ttl, **options)

    async def acquire(
        self,
        resource_type: str,
        key: str,
        owner: Owner,
        ttl: float,
        timeout: float | None = None,
        **options: Any,
    ) -> Claim:
        """Wait for the lease and claim it; see `pglease.runtime.acquire_async`."""
        return await runtime().acquire_async(
            self, resource_type, key, owner, ttl, timeout, **options
        )

    async def elect(self, name: str, candidate: Owner, **options: Any) -> AsyncElection:
        """Campaign for leadership of `name` (a running `pglease.runtime.AsyncElection`);
        see `pglease.runtime.elect_async`."""
        election: AsyncElection = await runtime().elect_async(self, name, candidate, **options)
        return election

    async def leader(self, name: str) -> Leader | None:
        """The current leader of election `name` and its generation, if any."""
        return await runtime().leader_async(self, name)

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
    ) -> AsyncSqliteWatcher:
        """Stream committed events from `after` (a cursor, "now" or "start") by polling
        the event table every `interval` seconds (50 ms default).

        The arguments are `PostgresStore.watch`'s: `mode` None or "poll" (SQLite
        has no LISTEN: "listen" is refused), at most `max_pending` events read
        and not handed out (a watcher further behind reads the rest later,
        nothing is lost), `tuning` accepted and unused (no hub). See
        `pglease.sqlite.watch`."""
        from .watch import AsyncSqliteWatcher

        return AsyncSqliteWatcher(
            self,
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
        )


async def _call(apply: AsyncApply[T], conn: sqlite3.Connection) -> T:
    return await apply(conn)
