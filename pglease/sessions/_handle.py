# Generated from pglease/sessions/_handle_async.py by tools/async_to_sync.py: do not edit.
"""The writer handle on one session file: `AsyncSqliteSession` (the source) and
`SqliteSession`, generated from it into `_handle.py`.

SQLite has no asyncio driver: every call of the asyncio handle runs the
blocking work (`SessionFile`) in a worker thread, so the event loop never
waits on a file lock; the blocking twin calls it directly. A call already
running in its thread finishes even when the awaiting task is cancelled: a
cancelled commit may still have committed (read the session to find out).
"""

from __future__ import annotations

import functools
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._compat import to_thread
from ..errors import LeaseLostError
from ..runtime import HeldLease, Keeper, Timing
from ._conveniences import ConvenienceWrites
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
class LeaseKeeping:
    """Who renews the writer leases of a repository's handles: its keeper, the
    open files the keeper's beats renew, and the timing of every lease."""

    keeper: Keeper
    leases: FileLeases
    timing: Timing


def _keeper_lost(ref: weakref.ref[SessionFile], error: LeaseLostError) -> None:
    """The keeper lost the lease: the handle refuses further work from now on."""
    file = ref()
    if file is not None and not file.closing:
        file.mark_lost(f"no longer held: {error}")


def _lost_hook(
    ref: weakref.ref[SqliteSession],
    on_lost: Callable[[SqliteSession], None] | None,
) -> Callable[[], None]:
    """What the file runs on loss: the caller's callback with the handle, held
    weakly (the file must not keep a dropped handle alive)."""

    def hook() -> None:
        handle = ref()
        if handle is not None and on_lost is not None:
            on_lost(handle)

    return hook


class SqliteSession(ConvenienceWrites):
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
        keeping: LeaseKeeping | None = None,
        requested_at: float = 0.0,
        on_close: Callable[[SqliteSession], None] | None = None,
        on_lost: Callable[[SqliteSession], None] | None = None,
    ) -> None:
        self._file = file
        file.on_lost = _lost_hook(weakref.ref(self), on_lost)
        self._on_close = on_close
        #: Set once the writer lease is known lost (from any thread).
        self.lost: threading.Event = self._file.lost
        self._keeping = keeping
        self._held: HeldLease | None = None
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

    def __enter__(self) -> SqliteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lease --

    def renew(self) -> None:
        """Extend the lease by the lease length; lost lease -> `WriterLeaseLostError`."""
        to_thread(self._file.renew)

    def close(self) -> None:
        """Stop renewing, release the lease (if still ours) and close the file."""
        if self._file.closed:
            return
        self._file.closing = True  # what the keeper reports from now on is no loss
        if self._keeping is not None and self._held is not None:
            self._keeping.keeper.remove(self._held)
        if to_thread(self._file.close) and self._on_close is not None:
            self._on_close(self)

    # -- writes --

    def commit(self, writes: Sequence[Write]) -> CommitResult:
        """Apply `writes` in one transaction: seqs next_seq.., one timestamp."""
        return to_thread(self._file.commit, list(writes))

    def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry:
        result = self.commit([AppendEntry(type, parent_id, payload or {}, custom_type, id)])
        entry = self.get_entry(result.ids[0] or "")
        assert entry is not None
        return entry

    def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow:
        result = self.commit([AddUsage(usage, entry_id, adjustment, details, id)])
        return to_thread(self._file.usage_row, result.ids[0])

    # -- reads --

    def get_entry(self, entry_id: str) -> Entry | None:
        return to_thread(self._file.get_entry, entry_id)

    def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]:
        """Entries with `seq > after_seq` in seq order, optionally of some types."""
        wanted = None if types is None else list(types)
        return to_thread(self._file.scan_entries, after_seq, limit, wanted)

    def scan_branch(
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
        return to_thread(self._file.scan_branch, leaf_id, query)

    def get_register(self, namespace: str, key: str) -> Register | None:
        return to_thread(self._file.get_register, namespace, key)

    def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        """Registers of `namespace` whose key starts with `prefix`, ordered by key."""
        return to_thread(self._file.list_registers, namespace, prefix)

    def usage_rows(self) -> list[UsageRow]:
        return to_thread(self._file.usage_rows)

    def stats(self) -> SessionStats:
        return to_thread(self._file.stats)

    def snapshot(self) -> SessionSnapshot:
        return to_thread(self._file.snapshot)
