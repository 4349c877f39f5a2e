"""What every PostgreSQL session repository does first, asyncio source of
`pg_base`: its settings, claiming a writer lease (at once, or waiting through
the runtime's acquire), and handing the claim to a new handle whose lease the
store's keeper renews.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Self

from .._compat_async import thread_lock
from ..clock import SYSTEM_CLOCK, Clock
from ..errors import AcquireTimeoutError, PgleaseError
from ..postgres import AsyncPostgresStore
from ..runtime import AsyncKeeper, Timing
from ..runtime.acquire import _acquire_async
from ..types import Claim, Owner
from .errors import InvalidSessionWriteError, SessionAlreadyClaimedError
from .model import SessionSnapshot
from .pg_core import (
    IMPORT_CHUNK,
    IMPORT_STALE_AFTER,
    OWNER_TYPE,
    RESOURCE_TYPE,
    Sql,
    check_chunk_size,
    check_stale_after,
    new_owner_id,
)
from .pg_handle_async import AsyncPostgresSession
from .pg_io_async import Conn, NowMs, _fetch_all, _read_consistent, _read_snapshot, log
from .pg_lease_async import AsyncWriterLease, connected_keeper, writer_timing
from .repository import check_session_id


class AsyncRepositoryBase:
    """Settings, lease claims and handles of a PostgreSQL session repository
    (`AsyncPostgresSessionRepository` is the whole of it)."""

    def __init__(
        self,
        store: AsyncPostgresStore,
        *,
        lease_seconds: float = 30.0,
        renew_interval: float | None = 15.0,
        now_ms: NowMs | None = None,
        on_lost: Callable[[AsyncPostgresSession], None] | None = None,
        import_chunk_entries: int = IMPORT_CHUNK,
        import_stale_after: float = IMPORT_STALE_AFTER,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not lease_seconds > 0:
            raise InvalidSessionWriteError(f"lease_seconds must be > 0, got {lease_seconds!r}")
        if renew_interval is not None and not 0 < renew_interval < lease_seconds:
            raise InvalidSessionWriteError(
                f"renew_interval must be between 0 and lease_seconds, got {renew_interval!r}"
            )
        self.store = store
        self.lease_seconds = lease_seconds
        self.renew_interval = renew_interval
        self._timing: Timing | None = (
            None if renew_interval is None else writer_timing(lease_seconds, renew_interval)
        )
        self.clock = clock
        self.now_ms = now_ms
        self.on_lost = on_lost
        self.import_chunk_entries = check_chunk_size(import_chunk_entries, "import_chunk_entries")
        self.import_stale_after = check_stale_after(import_stale_after)
        self._q = Sql(store.schema)
        self._lock = thread_lock()  # handles found lost by the keeper's thread close too
        self._open: weakref.WeakSet[AsyncPostgresSession] = weakref.WeakSet()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every handle this repository opened (the store stays open)."""
        with self._lock:
            handles = list(self._open)
        for handle in handles:
            await handle.close()

    def _forget(self, handle: AsyncPostgresSession) -> None:
        with self._lock:
            self._open.discard(handle)

    async def exists(self, session_id: str) -> bool:
        """True when the session exists (and is not a hidden import)."""
        check_session_id(session_id)
        return bool(await self._fetch(self._q.session_exists, (session_id,)))

    async def _fetch(self, query: bytes, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return await _fetch_all(self.store, query, params)

    async def _held_error(self, session_id: str, rid: str) -> SessionAlreadyClaimedError:
        lease = (await self.store.get(rid)).lease
        holder = lease.owner.id if lease.owner else "(released meanwhile)"
        until = lease.expires_at.isoformat() if lease.expires_at else "-"
        return SessionAlreadyClaimedError(
            f"session {session_id} is already claimed by writer {holder}: the lease is "
            f"already held by {lease.owner} (generation {lease.generation}) until {until}"
        )

    async def _claim(self, session_id: str, rid: str, wait: float | None) -> tuple[Claim, float]:
        """Claim the writer lease for a new handle: (claim, monotonic start of the
        request that won it). Held by another: `SessionAlreadyClaimedError`, at
        once or, with `wait`, after waiting that long through the fleet runtime's
        acquire (woken by the holder's release or expiry, not a poll)."""
        owner = Owner(OWNER_TYPE, new_owner_id())
        if self._timing is not None:
            # Before claiming, as `hold` does: no lease this host cannot renew.
            await connected_keeper(self.store, self.clock)
        if wait is None:
            started = self.clock.monotonic()
            claim = await self.store.claim(rid, owner, self.lease_seconds)
            if claim is None:
                raise await self._held_error(session_id, rid)
            return claim, started
        try:
            return await _acquire_async(
                self.store,
                RESOURCE_TYPE,
                session_id,
                owner,
                self.lease_seconds,
                wait,
                fair=False,
                use_watcher=True,
                clock=self.clock,
            )
        except AcquireTimeoutError:
            raise await self._held_error(session_id, rid) from None

    def _handle(
        self, session_id: str, claim: Claim, started: float, revision: int, next_seq: int
    ) -> AsyncPostgresSession:
        """A handle on a claimed lease, which the store's keeper renews from now on."""
        keeper = None if self._timing is None else AsyncKeeper.for_store(self.store, self.clock)
        lease = AsyncWriterLease(
            self.store, claim, started, self.lease_seconds, self.clock, keeper, self._timing
        )
        handle = AsyncPostgresSession(
            repository=self,
            session_id=session_id,
            lease=lease,
            revision=revision,
            next_seq=next_seq,
        )
        with self._lock:
            self._open.add(handle)
        return handle

    async def _release_quietly(self, claim: Claim) -> None:
        try:
            await self.store.release(claim)
        except PgleaseError as exc:  # the lease runs out by itself
            log.warning("releasing %s failed: %s", claim.resource_id, exc)

    async def snapshot(self, session_id: str) -> SessionSnapshot:
        """Entries (seq order) and registers in one consistent read, without
        touching the writer lease."""
        check_session_id(session_id)

        async def read(conn: Conn) -> SessionSnapshot:
            return await _read_snapshot(conn, self._q, session_id)

        return await _read_consistent(self.store, self._q, read)
