"""The writer handle on one session file: `AsyncSqliteSession` (the source) and
`SqliteSession`, generated from it into `_handle.py`.

SQLite has no asyncio driver: every call of the asyncio handle runs the
blocking work (`SessionFile`) in a worker thread, so the event loop never
waits on a file lock; the blocking twin calls it directly. A call already
running in its thread finishes even when the awaiting task is cancelled: a
cancelled commit may still have committed (read the session to find out).
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._compat_async import to_thread
from ..errors import LeaseLostError
from ..runtime import AsyncHeldLease, AsyncKeeper, Timing
from ._conveniences_async import AsyncConvenienceWrites
from ._file_leases import FileLeases, file_claim
from ._file_ops import SessionFile
from .branch_index import BranchQuery
from .model import (
    AddUsage,
    AppendEntry,
    CommitResult,
    Entry,
    Register,
    SessionSnapshot,
    SessionStats,
    UsageRow,
    Write,
)


@dataclass
class AsyncLeaseKeeping:
    """Who renews the writer leases of a repository's handles: its keeper, the
    open files the keeper's beats renew, and the timing of every lease."""

    keeper: AsyncKeeper
    leases: FileLeases
    timing: Timing
    # async-only: begin
    #: The event loop the keeper's task runs on.
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    # async-only: end


def _keeper_lost(ref: weakref.ref[SessionFile], error: LeaseLostError) -> None:
    """The keeper lost the lease: the handle refuses further work from now on."""
    file = ref()
    if file is not None and not file.closing:
        file.mark_lost(f"no longer held: {error}")


def _lost_hook(
    ref: weakref.ref[AsyncSqliteSession],
    on_lost: Callable[[AsyncSqliteSession], None] | None,
) -> Callable[[], None]:
    """What the file runs on loss: the caller's callback with the handle, held
    weakly (the file must not keep a dropped handle alive)."""

    def hook() -> None:
        handle = ref()
        if handle is not None and on_lost is not None:
            on_lost(handle)

    return hook


class AsyncSqliteSession(AsyncConvenienceWrites):
    """A writer handle on one session file, holding its writer lease.

    Created by the repository's `create/open/fork` over the file it claimed.
    The lease is renewed by the repository's keeper (`keeping`; none: no
    background renewal) and inside every commit's own transaction, where the
    fence is checked. Once the lease is lost the handle raises
    `WriterLeaseLostError` for everything but `close()`.
    """

    def __init__(
        self,
        file: SessionFile,
        *,
        keeping: AsyncLeaseKeeping | None = None,
        requested_at: float = 0.0,
        on_close: Callable[[AsyncSqliteSession], None] | None = None,
        on_lost: Callable[[AsyncSqliteSession], None] | None = None,
    ) -> None:
        self._file = file
        file.on_lost = _lost_hook(weakref.ref(self), on_lost)
        self._on_close = on_close
        #: Set once the writer lease is known lost (from any thread).
        self.lost: threading.Event = self._file.lost
        self._keeping = keeping
        self._held: AsyncHeldLease | None = None
        if keeping is not None:
            # The keeper holds the file only weakly: a dropped handle's lease runs out.
            keeping.leases.add(self._file)
            self._held = keeping.keeper.add(file_claim(self._file), keeping.timing, requested_at)
            self._held.on_lost(functools.partial(_keeper_lost, weakref.ref(self._file)))

    # -- identity --

    @property
    def id(self) -> str:
        return self._file.id

    @property
    def path(self) -> Path:
        return self._file.path

    @property
    def owner_id(self) -> str:
        return self._file.owner_id

    @property
    def fence(self) -> int:
        """The writer lease's fencing generation: every claim of the session
        (after a close, a crash or an expiry takeover) gets a higher one, and it
        never goes back, so it can fence writes downstream."""
        return self._file.fence

    @property
    def closed(self) -> bool:
        return self._file.closed

    @property
    def _conn(self) -> sqlite3.Connection:
        return self._file.conn

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} fence={self.fence} owner={self.owner_id}>"

    async def __aenter__(self) -> AsyncSqliteSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lease --

    async def renew(self) -> None:
        """Extend the lease by the lease length; lost lease -> `WriterLeaseLostError`."""
        await to_thread(self._file.renew)

    async def close(self) -> None:
        """Stop renewing, release the lease (if still ours) and close the file."""
        if self._file.closed:
            return
        self._file.closing = True  # what the keeper reports from now on is no loss
        if self._keeping is not None and self._held is not None:
            self._keeping.keeper.remove(self._held)
        if await to_thread(self._file.close) and self._on_close is not None:
            self._on_close(self)

    # -- writes --

    async def commit(self, writes: Sequence[Write]) -> CommitResult:
        """Apply `writes` in one transaction: seqs next_seq.., one timestamp."""
        return await to_thread(self._file.commit, list(writes))

    async def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry:
        result = await self.commit([AppendEntry(type, parent_id, payload or {}, custom_type, id)])
        entry = await self.get_entry(result.ids[0] or "")
        assert entry is not None
        return entry

    async def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow:
        result = await self.commit([AddUsage(usage, entry_id, adjustment, details, id)])
        return await to_thread(self._file.usage_row, result.ids[0])

    # -- reads --

    async def get_entry(self, entry_id: str) -> Entry | None:
        return await to_thread(self._file.get_entry, entry_id)

    async def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]:
        """Entries with `seq > after_seq` in seq order, optionally of some types."""
        wanted = None if types is None else list(types)
        return await to_thread(self._file.scan_entries, after_seq, limit, wanted)

    async def scan_branch(
        self,
        leaf_id: str,
        *,
        newest_first: bool = True,
        stop_type: str | None = None,
        stop_id: str | None = None,
        types: Iterable[str] | None = None,
        custom_type: str | None = None,
        cursor: int | None = None,
        limit: int | None = None,
    ) -> list[Entry]:
        """The path from `leaf_id` to the root, read through the branch index.

        See `BranchQuery` for the meaning of the options."""
        query = BranchQuery(
            newest_first=newest_first,
            stop_type=stop_type,
            stop_id=stop_id,
            types=None if types is None else frozenset(types),
            custom_type=custom_type,
            cursor=cursor,
            limit=limit,
        )
        return await to_thread(self._file.scan_branch, leaf_id, query)

    async def get_register(self, namespace: str, key: str) -> Register | None:
        return await to_thread(self._file.get_register, namespace, key)

    async def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        """Registers of `namespace` whose key starts with `prefix`, ordered by key."""
        return await to_thread(self._file.list_registers, namespace, prefix)

    async def usage_rows(self) -> list[UsageRow]:
        return await to_thread(self._file.usage_rows)

    async def stats(self) -> SessionStats:
        return await to_thread(self._file.stats)

    async def snapshot(self) -> SessionSnapshot:
        return await to_thread(self._file.snapshot)
