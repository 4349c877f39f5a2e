"""The writer handle on a PostgreSQL session, asyncio source of `pg_handle`.

A handle holds the session's writer lease (`pg_lease`: the store's keeper
renews it) and fences every commit with it: one `mutate` of the store per
commit, the session rows, the revision bump and the `session.commit` event
in one transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from .._compat_async import Event, Lock, thread_lock
from ..errors import LeaseLostError, LockTimeoutError, PgleaseError, StaleResourceError
from ..runtime import AsyncHeldLease
from ..types import Claim, Owner, Permit
from ._conveniences_async import AsyncConvenienceWrites
from .branch_index import BranchQuery
from .branch_index import scan_branch as _scan_branch
from .errors import (
    SessionClosedError,
    SessionCorruptError,
    SessionNotFoundError,
    UnknownEntryError,
    WriterLeaseLostError,
)
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
    load_json,
)
from .pg_core import (
    SeqMoved,
    cause_of,
    check_scan_args,
    entry_from_row,
    first_page_for,
    register_from_row,
    usage_from_row,
)
from .pg_io_async import (
    Conn,
    _fetch_all,
    _index,
    _mutation_error,
    _read_consistent,
    _replay,
    _write_commit,
    log,
)
from .pg_lease_async import AsyncWriterLease
from .writes import prepare_writes

if TYPE_CHECKING:
    from .pg_base_async import AsyncRepositoryBase


class AsyncPostgresSession(AsyncConvenienceWrites):
    """A writer handle on a session in PostgreSQL, holding its writer lease.

    Created by the repository's `create/open/fork/import_file`. Same API as
    the file sessions' handles; once the lease is lost every call but
    `close()` raises `WriterLeaseLostError`.
    """

    def __init__(
        self,
        *,
        repository: AsyncRepositoryBase,
        session_id: str,
        lease: AsyncWriterLease,
        revision: int,
        next_seq: int,
    ) -> None:
        self._repo = repository
        self._store = repository.store
        self._q = repository._q
        self._id = session_id
        self._lease = lease
        self._rid = lease.claim.resource_id
        self._revision = revision
        self._next_seq = next_seq
        self._lock = Lock()  # one commit, renew or close at a time
        self._lost_guard = thread_lock()  # the keeper and a commit may both find it lost
        self._closed = False
        self._lost_reason = ""
        self.lost = Event()
        # The keeper holds the lease, not the handle: a dropped handle's lease runs out.
        lease.watch(self, AsyncPostgresSession._keeper_lost)

    # -- identity --

    @property
    def id(self) -> str:
        return self._id

    @property
    def resource_id(self) -> str:
        """The pglease resource `("session", id)` carrying the writer lease."""
        return self._rid

    @property
    def _claim(self) -> Claim:
        """The claim the handle writes with."""
        return self._lease.claim

    @property
    def held(self) -> AsyncHeldLease | None:
        """The store keeper's held lease (None with `renew_interval=None`)."""
        return self._lease.held

    @property
    def owner_id(self) -> str:
        return self._claim.owner.id

    @property
    def owner(self) -> Owner:
        return self._claim.owner

    @property
    def fence(self) -> int:
        """The lease generation: the fencing token."""
        return self._claim.generation

    @property
    def revision(self) -> int:
        """The resource revision after this handle's last renew or commit."""
        return self._revision

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"<{name} {self._id} fence={self.fence} owner={self.owner_id}>"

    async def __aenter__(self) -> AsyncPostgresSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lease --

    def _usable(self) -> None:
        if self._closed:
            raise SessionClosedError(f"session {self._id} handle is closed")
        self._lease.check()  # a trust window that closed unnoticed: lost now
        if self.lost.is_set():
            raise WriterLeaseLostError(
                f"session {self._id}: writer lease was lost (fence {self.fence}"
                f" {self._lost_reason}); this handle refuses further work"
            )

    def _mark_lost(self, why: str = "no longer current") -> WriterLeaseLostError:
        with self._lost_guard:
            first = not self.lost.is_set() and not self._closed
            if first:
                self._lost_reason = why
            self.lost.set()
        self._lease.stop(f"the session handle found it lost: {why}")
        if first and self._repo.on_lost is not None:
            try:
                self._repo.on_lost(self)
            except Exception:
                log.exception("on_lost callback of session %s failed", self._id)
        return WriterLeaseLostError(
            f"session {self._id}: writer lease was lost (owner {self.owner}, "
            f"fence {self.fence} {why})"
        )

    def _keeper_lost(self, error: LeaseLostError) -> None:
        """The keeper lost the lease (its verdict, or the trust window closed)."""
        if self._lease.window_closed():
            self._mark_lost(f"its lease could not be renewed before it ran out: {error}")
        else:
            self._mark_lost(f"no longer current: {error}")

    def trust_expired(self) -> bool:
        """True once the lease may have run out by our own monotonic clock."""
        return self._lease.trust_expired()

    def give_up(self, why: str) -> None:
        """Stop trusting the lease: the handle is lost from now on."""
        self._mark_lost(why)

    async def renew(self) -> None:
        """Extend the lease by `lease_seconds` now (the keeper does it every
        `renew_interval` anyway): a heartbeat, no revision bump, no event.
        A lost lease -> `WriterLeaseLostError`."""
        async with self._lock:
            self._usable()
            status = await self._lease.renew()
            if status == "busy":
                # The lease row is locked by a write in flight: nothing changed.
                raise LockTimeoutError(
                    f"session {self._id}: the writer lease row was locked during renewal"
                )
            if status != "renewed":
                raise self._mark_lost(f"no longer current: the heartbeat found it {status}")

    async def close(self) -> None:
        """Stop renewing, release the lease (if still ours); the handle is done."""
        async with self._lock:
            if self._closed:
                return
            self._lease.stop("released: the session handle was closed")
            try:
                if not self.lost.is_set():
                    await self._store.release(self._claim)
            except PgleaseError as exc:
                # A stale holder cannot release its successor's lease, and one we
                # cannot reach runs out by itself: close() never raises for it.
                log.warning("session %s: releasing the lease failed: %s", self._id, exc)
            finally:
                self._closed = True
                self._repo._forget(self)

    # -- writes --

    async def _commit(
        self, writes: Sequence[Write]
    ) -> tuple[CommitResult, list[Entry], list[UsageRow]]:
        prepared = prepare_writes(writes)
        counts = {"entries": 0, "usage": 0, "registers": 0}
        for item in prepared:
            if isinstance(item.write, AppendEntry):
                counts["entries"] += 1
            elif isinstance(item.write, AddUsage):
                counts["usage"] += 1
            else:
                counts["registers"] += 1
        fixed_now = None if self._repo.now_ms is None else self._repo.now_ms()
        async with self._lock:
            self._usable()
            # After an ambiguous failure (connection lost around COMMIT) both the
            # revision and next_seq can be stale: each may be resynced once.
            resynced_revision = resynced_seq = False
            while True:
                first = self._next_seq
                payload = {
                    "session": self._id,
                    "first_seq": first,
                    "next_seq": first + len(prepared),
                    **counts,
                }

                async def apply(conn: Conn, first: int = first) -> Any:
                    return await _write_commit(conn, self._q, self._id, prepared, first, fixed_now)

                try:
                    result = await self._store.mutate(
                        Permit(self._rid, self._revision, self._claim),
                        "session.commit",
                        apply,
                        payload,
                    )
                except LeaseLostError as exc:
                    raise self._mark_lost(f"no longer current: {exc}") from None
                except StaleResourceError as exc:
                    # The lease was checked first and is ours: the revision moved
                    # under us (a renew whose reply we missed). Adopt it and retry.
                    if resynced_revision or exc.actual is None:
                        raise
                    resynced_revision = True
                    self._revision = exc.actual
                    continue
                except SeqMoved as exc:
                    if resynced_seq:
                        raise SessionCorruptError(
                            f"session {self._id}: next_seq moved under the writer lease"
                        ) from None
                    resynced_seq = True
                    self._next_seq = exc.next_seq
                    continue
                except psycopg.Error as exc:
                    error = _mutation_error(self._store, exc)
                    raise error from cause_of(error, exc)
                self._revision = result.revision
                value: tuple[CommitResult, list[Entry], list[UsageRow]] = result.value
                self._next_seq = value[0].next_seq
                return value

    async def commit(self, writes: Sequence[Write]) -> CommitResult:
        """Apply `writes` atomically, fenced by the writer lease: seqs next_seq..,
        one timestamp, one `session.commit` event."""
        return (await self._commit(writes))[0]

    async def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry:
        _, entries, _ = await self._commit(
            [AppendEntry(type, parent_id, payload or {}, custom_type, id)]
        )
        return entries[0]

    async def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow:
        _, _, rows = await self._commit([AddUsage(usage, entry_id, adjustment, details, id)])
        return rows[0]

    # -- reads --

    async def _rows(self, query: bytes, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        async with self._lock:
            self._usable()
        return await _fetch_all(self._store, query, params)

    async def get_entry(self, entry_id: str) -> Entry | None:
        rows = await self._rows(self._q.get_entry, (self._id, entry_id))
        return entry_from_row(rows[0]) if rows else None

    async def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]:
        """Entries with `seq > after_seq` in seq order, optionally of some types."""
        wanted = check_scan_args(after_seq, limit, types)
        rows = await self._rows(self._q.scan_entries, (self._id, after_seq, wanted, wanted, limit))
        return [entry_from_row(r) for r in rows]

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
        """The path from `leaf_id` to the root through the branch index, in one
        consistent read. See `BranchQuery` for the options."""
        query = BranchQuery(
            newest_first=newest_first,
            stop_type=stop_type,
            stop_id=stop_id,
            types=None if types is None else frozenset(types),
            custom_type=custom_type,
            cursor=cursor,
            limit=limit,
        )
        async with self._lock:
            self._usable()

        async def scan(conn: Conn) -> list[Entry]:
            row = await (await conn.execute(self._q.get_entry, (self._id, leaf_id))).fetchone()
            if row is None:
                raise UnknownEntryError(f"entry {leaf_id!r} does not exist")
            leaf = entry_from_row(row)
            index = _index(
                conn, self._q, self._id, load_entries=True, first_page=first_page_for(query)
            )
            # Read-only: a replay reuses every page fetched before.
            return await _replay(conn, index, lambda: _scan_branch(index, leaf, query, index.load))

        return await _read_consistent(self._store, self._q, scan)

    async def get_register(self, namespace: str, key: str) -> Register | None:
        rows = await self._rows(self._q.get_register, (self._id, namespace, key))
        return register_from_row(rows[0]) if rows else None

    async def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        """Registers of `namespace` whose key starts with `prefix`, ordered by key."""
        rows = await self._rows(self._q.list_registers, (self._id, namespace, prefix, prefix))
        return [register_from_row(r) for r in rows]

    async def usage_rows(self) -> list[UsageRow]:
        return [usage_from_row(r) for r in await self._rows(self._q.usage_rows, (self._id,))]

    async def stats(self) -> SessionStats:
        async with self._lock:
            self._usable()

        async def read(conn: Conn) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
            row = await (await conn.execute(self._q.session_row, (self._id,))).fetchone()
            if row is None:
                raise SessionNotFoundError(f"session {self._id} does not exist")
            return row, await (await conn.execute(self._q.entry_count, (self._id,))).fetchone()

        row, count = await _read_consistent(self._store, self._q, read)
        assert count is not None
        return SessionStats(
            created_at=int(row[0]),
            parent_session_id=row[1],
            message_count=int(row[3]),
            usage=load_json(row[4]),
            next_seq=int(row[5]),
            entry_count=int(count[0]),
        )

    async def snapshot(self) -> SessionSnapshot:
        async with self._lock:
            self._usable()
        return await self._repo.snapshot(self._id)
