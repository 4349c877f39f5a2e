"""Asyncio twin of `pglease.sessions.postgres`, on `AsyncPostgresStore`.

Same tables, same SQL, same lease and commit semantics (see that module); the
blocking calls become coroutines and the heartbeat is an asyncio task. The
branch-index algorithm is shared too: it runs against a `ReplayIndex` and this
module fetches whatever a step asks for, then runs the step again.

Session files are local SQLite: `fork_to_file`, `export_to_file` and the file
side of `import_file` run in a worker thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from ..errors import (
    LeaseLostError,
    PgleaseError,
    ResourceLeasedError,
    StaleResourceError,
)
from ..ids import resource_id
from ..postgres import AsyncPostgresStore
from ..types import Claim, Owner, Permit
from .branch_index import BranchQuery
from .branch_index import scan_branch as _scan_branch
from .errors import (
    InvalidSessionWriteError,
    SessionAlreadyClaimedError,
    SessionBusyError,
    SessionClosedError,
    SessionCorruptError,
    SessionError,
    SessionExistsError,
    SessionNotFoundError,
    UnknownEntryError,
    WriterLeaseLostError,
)
from .fork import (
    ForkPlan,
    ForkPosition,
    ForkScope,
    ForkStream,
    checked_path,
    checked_seq_order,
    plan_fork,
    resolve_fork,
    resolve_fork_lookups,
)
from .ids import uuid7
from .model import (
    AddUsage,
    AppendEntry,
    CommitResult,
    DeleteRegister,
    Entry,
    LeaseInfo,
    Register,
    SessionInfo,
    SessionSnapshot,
    SessionStats,
    SetRegister,
    UsageRow,
    Write,
    load_json,
)
from .pg_core import (
    IMPORT_CHUNK,
    IMPORT_CLAIM_WAIT,
    IMPORT_STALE_AFTER,
    OWNER_TYPE,
    PURGE_CHUNK,
    RESOURCE_TYPE,
    Batch,
    ChunkBuilder,
    ChunkIndex,
    ChunkSizer,
    CommitBuilder,
    Miss,
    PlanBuilder,
    ReplayIndex,
    Row,
    SeqMoved,
    Sql,
    cause_of,
    check_chunk_size,
    check_scan_args,
    check_stale_after,
    check_version,
    chunks,
    delete_interrupted,
    driver_error,
    entry_from_row,
    first_page_for,
    import_gone,
    import_refusal,
    new_owner_id,
    new_session_plan,
    pooler_limits,
    register_from_row,
    registers_call,
    sized_chunks,
    stale_import_problem,
    translate_unique,
    usage_from_row,
)
from .repository import (
    SUFFIX,
    SessionListing,
    SessionProblem,
    SessionRepository,
    check_session_id,
)
from .schema import EMPTY_USAGE_JSON, STORAGE_VERSION
from .sqlite_file import STREAM_FETCH, file_fork_source
from .writes import prepare_writes

log = logging.getLogger("pglease.sessions")

AConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")
NowMs = Callable[[], int]


async def _replay(conn: AConn, index: ReplayIndex, step: Callable[[], T]) -> T:
    """Run a synchronous step of the branch-index algorithm, fetching what it misses."""
    while True:
        try:
            return step()
        except Miss as miss:
            await _send(conn, index.pending())  # the read must see every buffered write
            cur = await conn.execute(miss.query, miss.params)
            index.supply(miss, await cur.fetchall())


async def _send(conn: AConn, batches: Sequence[Batch]) -> None:
    if batches:
        async with conn.cursor() as cur:
            for query, rows in batches:
                await cur.executemany(query, rows)


async def _write_commit(
    conn: AConn,
    q: Sql,
    session_id: str,
    prepared: Sequence[Any],
    expected_seq: int,
    fixed_now: int | None,
) -> tuple[CommitResult, list[Entry], list[UsageRow]]:
    index = ReplayIndex(q, session_id)
    build = CommitBuilder(q, session_id, prepared, expected_seq, fixed_now, index)
    async with conn.pipeline():
        cursors = {
            name: await conn.execute(query, params)
            for name, (query, params) in build.lookups().items()
        }
        results = {name: await cur.fetchall() for name, cur in cursors.items()}
    build.start(results)
    for i in range(len(prepared)):
        await _replay(conn, index, functools.partial(build.step, i))
    async with conn.pipeline():
        await _send(conn, build.batches())
    return build.result()


async def write_plan_rows_async(
    conn: AConn, q: Sql, session_id: str, plan: ForkPlan, created_at: int | None
) -> None:
    """Asyncio twin of `postgres.write_plan_rows`."""
    index = ReplayIndex(q, session_id)
    build = PlanBuilder(q, session_id, plan, created_at, index)
    query, params = build.session_insert()
    cur = await conn.execute(query, params)
    if cur.rowcount != 1:
        raise SessionExistsError(f"session {session_id} already exists")
    for i in range(len(build.entries)):
        await _replay(conn, index, functools.partial(build.step, i))
    async with conn.pipeline():
        await _send(conn, build.batches())


async def _write_chunk(
    conn: AConn, q: Sql, session_id: str, token: str, entries: list[Entry], limits: bytes | None
) -> float:
    """Asyncio twin of `postgres._write_chunk`."""
    index = ChunkIndex(q, session_id)
    build = ChunkBuilder(q, session_id, token, entries, index)
    lookups = build.lookups()
    results: dict[str, list[Row]] = {}
    if lookups:
        async with conn.pipeline():
            cursors = {name: await conn.execute(*read) for name, read in lookups.items()}
            results = {name: await cur.fetchall() for name, cur in cursors.items()}
    try:
        build.start(results)
        for i in range(len(entries)):
            await _read_into(conn, index, functools.partial(build.step, i))
    except PgleaseError:
        # A missing parent may mean a cleanup took the import over: say so.
        build.checked(await (await conn.execute(*build.alive())).fetchall())
        raise
    began = time.monotonic()
    await _call(conn, build.call(), limits)
    return time.monotonic() - began


async def _read_into(conn: AConn, index: ChunkIndex, step: Callable[[], T]) -> T:
    """Run a step of an import chunk's branch index, fetching the reads it
    misses (nothing is written before the chunk's one call)."""
    while True:
        try:
            return step()
        except Miss as miss:
            cur = await conn.execute(miss.query, miss.params)
            index.supply(miss, await cur.fetchall())


async def _write_registers(
    conn: AConn,
    q: Sql,
    session_id: str,
    token: str,
    registers: list[Register],
    limits: bytes | None,
) -> None:
    await _call(conn, registers_call(q, session_id, token, registers), limits)


async def _call(conn: AConn, call: tuple[bytes, Row], limits: bytes | None) -> None:
    """Asyncio twin of `postgres._call`."""
    if limits is None:
        await conn.execute(*call)
        return
    async with conn.pipeline(), conn.transaction():
        await conn.execute(limits)
        await conn.execute(*call)


#: How long the file-writing thread of a fork waits for one fetch of the
#: source (the store's statement timeout usually ends a stuck one first).
FETCH_WAIT = 300.0


def _bridged(
    loop: asyncio.AbstractEventLoop,
    fetch: Callable[[], Coroutine[Any, Any, list[tuple[Any, ...]]]],
) -> Iterator[Entry]:
    """Entries of an async server-side cursor, for a consumer in a worker thread:
    each fetch runs on the event loop (free while it awaits the thread)."""
    while True:
        future = asyncio.run_coroutine_threadsafe(fetch(), loop)
        try:
            rows = future.result(FETCH_WAIT)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SessionError(
                f"reading the source session stalled: no rows within {FETCH_WAIT:g} s"
            ) from None
        if not rows:
            return
        for row in rows:
            yield entry_from_row(row)


async def _read(
    store: AsyncPostgresStore, fn: Callable[[AConn], Awaitable[T]], bounded: bool = True
) -> T:
    """Run a read on a store connection; once more on a fresh one when the
    connection breaks under it (a read is safe to repeat). Driver errors come
    out as PgleaseErrors, as from the store's own reads. In pooler mode it runs
    in a transaction that sets the store's limits first (pipelined with it)."""
    for attempt in (1, 2):
        conn: AConn | None = None
        try:
            async with store.connection() as conn:
                if not bounded or (limits := pooler_limits(store)) is None:
                    return await fn(conn)
                async with conn.pipeline(), conn.transaction():
                    await conn.execute(limits)
                    return await fn(conn)
        except psycopg.Error as exc:
            broken = conn is not None and conn.broken
            if broken and attempt == 1:
                continue
            error = driver_error(store, exc, broken)
            raise error from cause_of(error, exc)
    raise AssertionError("unreachable")


async def _read_consistent(
    store: AsyncPostgresStore, q: Sql, fn: Callable[[AConn], Awaitable[T]]
) -> T:
    """`_read` in a repeatable-read, read-only transaction: one consistent view."""

    async def run(conn: AConn) -> T:
        async with conn.transaction():
            await conn.execute(q.read_only)  # first: it must precede any query
            if (limits := pooler_limits(store)) is not None:
                await conn.execute(limits)
            return await fn(conn)

    return await _read(store, run, bounded=False)


async def _fetch_all(
    store: AsyncPostgresStore, query: bytes, params: tuple[Any, ...]
) -> list[tuple[Any, ...]]:
    async def run(conn: AConn) -> list[tuple[Any, ...]]:
        return await (await conn.execute(query, params)).fetchall()

    return await _read(store, run)


def _mutation_error(store: AsyncPostgresStore, exc: psycopg.Error) -> PgleaseError:
    """A driver error `mutate` let through from our `apply` (the session SQL is
    ours, so none reaches the caller raw); the transaction was rolled back."""
    if isinstance(exc, psycopg.errors.UniqueViolation):
        return translate_unique(exc)
    return driver_error(store, exc)


async def _read_snapshot(conn: AConn, q: Sql, session_id: str) -> SessionSnapshot:
    row = await (await conn.execute(q.session_row, (session_id,))).fetchone()
    if row is None:
        raise SessionNotFoundError(f"session {session_id} does not exist")
    check_version(session_id, int(row[2]))
    entries = await (await conn.execute(q.all_entries, (session_id,))).fetchall()
    registers = await (await conn.execute(q.all_registers, (session_id,))).fetchall()
    return SessionSnapshot(
        tuple(entry_from_row(r) for r in entries),
        tuple(register_from_row(r) for r in registers),
        row[1],
    )


async def _renew_loop(ref: weakref.ref[AsyncPostgresSession], interval: float) -> None:
    """The heartbeat task; holds the handle weakly, like the threaded one."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        handle = ref()
        if handle is None:
            return
        try:
            await handle.renew()
            now = time.monotonic()
            if now - last > interval * 1.5:
                log.warning(
                    "session %s: lease renewal came %.3f s late", handle.id, now - last - interval
                )
            last = now
        except (WriterLeaseLostError, SessionClosedError):
            return
        except PgleaseError as exc:  # unreachable, a time limit: retry while trusted
            log.warning("session %s: lease renewal failed, will retry: %s", handle.id, exc)
            if handle.trust_expired():
                handle.give_up("its lease could not be renewed before it ran out")
                return
        finally:
            del handle


class AsyncPostgresSession:
    """Asyncio twin of `PostgresSession` (same methods, as coroutines)."""

    def __init__(
        self,
        *,
        repository: AsyncPostgresSessionRepository,
        session_id: str,
        claim: Claim,
        claimed_at: float,
        revision: int,
        next_seq: int,
    ) -> None:
        self._repo = repository
        self._store = repository.store
        self._q = repository._q
        self._id = session_id
        self._rid = claim.resource_id
        self._claim = claim
        self._revision = revision
        self._next_seq = next_seq
        self._lease_seconds = repository.lease_seconds
        self._trusted_until = claimed_at + repository.lease_seconds
        self._lock = asyncio.Lock()
        self._closed = False
        self._lost_reason = ""
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        if repository.renew_interval is not None:
            self._task = asyncio.get_running_loop().create_task(
                _renew_loop(weakref.ref(self), repository.renew_interval),
                name=f"pglease-session-renew-{session_id}",
            )

    @property
    def id(self) -> str:
        return self._id

    @property
    def resource_id(self) -> str:
        return self._rid

    @property
    def owner_id(self) -> str:
        return self._claim.owner.id

    @property
    def owner(self) -> Owner:
        return self._claim.owner

    @property
    def fence(self) -> int:
        return self._claim.generation

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<AsyncPostgresSession {self._id} fence={self.fence} owner={self.owner_id}>"

    async def __aenter__(self) -> AsyncPostgresSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lease --

    def _usable(self) -> None:
        if self._closed:
            raise SessionClosedError(f"session {self._id} handle is closed")
        if self.lost.is_set():
            raise WriterLeaseLostError(
                f"session {self._id}: writer lease was lost (fence {self.fence}"
                f" {self._lost_reason}); this handle refuses further work"
            )

    def _mark_lost(self, why: str = "no longer current") -> WriterLeaseLostError:
        first = not self.lost.is_set()
        if first:
            self._lost_reason = why
        self.lost.set()
        if first and self._repo.on_lost is not None:
            try:
                self._repo.on_lost(self)
            except Exception:
                log.exception("on_lost callback of session %s failed", self._id)
        return WriterLeaseLostError(
            f"session {self._id}: writer lease was lost (owner {self.owner}, "
            f"fence {self.fence} {why})"
        )

    def trust_expired(self) -> bool:
        return time.monotonic() >= self._trusted_until

    def give_up(self, why: str) -> None:
        self._mark_lost(why)

    async def renew(self) -> None:
        """Extend the lease by `lease_seconds`; a lost lease -> `WriterLeaseLostError`."""
        async with self._lock:
            self._usable()
            started = time.monotonic()
            try:
                claim = await self._store.renew(self._claim, self._lease_seconds)
            except LeaseLostError as exc:
                raise self._mark_lost(f"no longer current: {exc}") from None
            self._claim = claim
            self._revision = claim.revision
            self._trusted_until = started + self._lease_seconds

    async def close(self) -> None:
        """Stop the heartbeat, release the lease (if still ours)."""
        if self._closed:
            return
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._lock:
            if self._closed:
                return
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
            resynced_revision = resynced_seq = False
            while True:
                first = self._next_seq
                payload = {
                    "session": self._id,
                    "first_seq": first,
                    "next_seq": first + len(prepared),
                    **counts,
                }

                async def apply(conn: AConn, first: int = first) -> Any:
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
        """Apply `writes` atomically, fenced by the writer lease."""
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

    async def append_message(
        self,
        parent_id: str | None,
        message: Any,
        *,
        terminate: bool | None = None,
        id: str | None = None,
    ) -> Entry:
        payload: dict[str, Any] = {"message": message}
        if terminate is not None:
            payload["terminate"] = terminate
        return await self.append_entry("message", parent_id, payload, id=id)

    async def set_register(self, namespace: str, key: str, value: Any) -> int:
        return (await self.commit([SetRegister(namespace, key, value)])).first_seq

    async def delete_register(self, namespace: str, key: str) -> int:
        return (await self.commit([DeleteRegister(namespace, key)])).first_seq

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
        """The path from `leaf_id` to the root, in one consistent read."""
        query = BranchQuery(
            newest_first=newest_first,
            stop_type=stop_type,
            stop_id=stop_id,
            types=None if types is None else frozenset(types),
            custom_type=custom_type,
            cursor=cursor,
            limit=limit,
        )
        self._usable()

        async def scan(conn: AConn) -> list[Entry]:
            row = await (await conn.execute(self._q.get_entry, (self._id, leaf_id))).fetchone()
            if row is None:
                raise UnknownEntryError(f"entry {leaf_id!r} does not exist")
            leaf = entry_from_row(row)
            index = ReplayIndex(
                self._q, self._id, load_entries=True, first_page=first_page_for(query)
            )
            # A read-only replay: each run reuses every page fetched before.
            return await _replay(conn, index, lambda: _scan_branch(index, leaf, query, index.load))

        return await _read_consistent(self._store, self._q, scan)

    async def get_register(self, namespace: str, key: str) -> Register | None:
        rows = await self._rows(self._q.get_register, (self._id, namespace, key))
        return register_from_row(rows[0]) if rows else None

    async def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        rows = await self._rows(self._q.list_registers, (self._id, namespace, prefix, prefix))
        return [register_from_row(r) for r in rows]

    async def usage_rows(self) -> list[UsageRow]:
        return [usage_from_row(r) for r in await self._rows(self._q.usage_rows, (self._id,))]

    async def stats(self) -> SessionStats:
        self._usable()

        async def read(conn: AConn) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
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
        self._usable()
        return await self._repo.snapshot(self._id)


class AsyncPostgresSessionRepository:
    """Asyncio twin of `PostgresSessionRepository` on an open `AsyncPostgresStore`."""

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
        self.now_ms = now_ms
        self.on_lost = on_lost
        self.import_chunk_entries = check_chunk_size(import_chunk_entries, "import_chunk_entries")
        self.import_stale_after = check_stale_after(import_stale_after)
        self._q = Sql(store.schema)
        self._open: weakref.WeakSet[AsyncPostgresSession] = weakref.WeakSet()

    async def __aenter__(self) -> AsyncPostgresSessionRepository:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every handle this repository opened (the store stays open)."""
        for handle in list(self._open):
            await handle.close()

    def _forget(self, handle: AsyncPostgresSession) -> None:
        self._open.discard(handle)

    async def _fetch(self, query: bytes, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return await _fetch_all(self.store, query, params)

    async def exists(self, session_id: str) -> bool:
        check_session_id(session_id)
        return bool(await self._fetch(self._q.session_exists, (session_id,)))

    async def _held_error(self, session_id: str, rid: str) -> SessionAlreadyClaimedError:
        lease = (await self.store.get(rid)).lease
        holder = lease.owner.id if lease.owner else "(released meanwhile)"
        until = lease.expires_at.isoformat() if lease.expires_at else "-"
        return SessionAlreadyClaimedError(
            f"session {session_id} is already claimed by writer {holder}: the lease is "
            f"already held by {lease.owner} (generation {lease.generation}) until {until}"
        )

    async def _claim(self, session_id: str, rid: str, wait: float | None) -> tuple[Claim, float]:
        owner = Owner(OWNER_TYPE, new_owner_id())
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            started = time.monotonic()
            claim = await self.store.claim(rid, owner, self.lease_seconds)
            if claim is not None:
                return claim, started
            if deadline is None or started >= deadline:
                raise await self._held_error(session_id, rid)
            await asyncio.sleep(max(0.0, min(0.05, deadline - time.monotonic())))

    def _handle(
        self, session_id: str, claim: Claim, started: float, revision: int, next_seq: int
    ) -> AsyncPostgresSession:
        handle = AsyncPostgresSession(
            repository=self,
            session_id=session_id,
            claim=claim,
            claimed_at=started,
            revision=revision,
            next_seq=next_seq,
        )
        self._open.add(handle)
        return handle

    async def _release_quietly(self, claim: Claim) -> None:
        try:
            await self.store.release(claim)
        except PgleaseError as exc:  # the lease runs out by itself
            log.warning("releasing %s failed: %s", claim.resource_id, exc)

    async def open(self, session_id: str, *, wait: float | None = None) -> AsyncPostgresSession:
        """Open an existing session and claim its writer lease (see the sync twin)."""
        check_session_id(session_id)
        rows = await self._fetch(self._q.session_exists, (session_id,))
        if not rows:
            raise SessionNotFoundError(f"session {session_id} does not exist")
        check_version(session_id, int(rows[0][0]))
        rid = resource_id(RESOURCE_TYPE, session_id)
        claim, started = await self._claim(session_id, rid, wait)
        try:
            found = await self._fetch(self._q.session_row, (session_id,))
            if not found:
                raise SessionNotFoundError(f"session {session_id} was deleted")
        except BaseException:
            await self._release_quietly(claim)
            raise
        return self._handle(session_id, claim, started, claim.revision, int(found[0][5]))

    async def _create_from_plan(
        self, session_id: str, plan: ForkPlan, event: str
    ) -> AsyncPostgresSession:
        rid = await self.store.ensure_resource(RESOURCE_TYPE, session_id)
        if await self.exists(session_id):
            raise SessionExistsError(f"session {session_id} already exists")
        claim, started = await self._claim(session_id, rid, None)
        created_at = None if self.now_ms is None else self.now_ms()
        payload = {
            "session": session_id,
            "parent_session_id": plan.parent_session_id,
            "entries": len(plan.entries),
            "next_seq": plan.next_seq,
        }

        async def apply(conn: AConn) -> None:
            await write_plan_rows_async(conn, self._q, session_id, plan, created_at)

        try:
            result = await self.store.mutate(
                Permit(rid, claim.revision, claim), event, apply, payload
            )
        except psycopg.Error as exc:
            await self._release_quietly(claim)
            error = _mutation_error(self.store, exc)
            raise error from cause_of(error, exc)
        except BaseException:
            await self._release_quietly(claim)
            raise
        return self._handle(session_id, claim, started, result.revision, plan.next_seq)

    async def create(
        self, id: str | None = None, parent_session_id: str | None = None
    ) -> AsyncPostgresSession:
        """Create a new empty session and claim its lease."""
        session_id = check_session_id(id) if id is not None else uuid7()
        if parent_session_id is not None and not isinstance(parent_session_id, str):
            raise InvalidSessionWriteError("parent_session_id must be a string or None")
        return await self._create_from_plan(
            session_id, new_session_plan(parent_session_id), "session.created"
        )

    async def create_from_plan(self, plan: ForkPlan, id: str | None = None) -> AsyncPostgresSession:
        session_id = check_session_id(id) if id is not None else uuid7()
        return await self._create_from_plan(session_id, plan, "session.forked")

    async def fork(
        self,
        source_id: str,
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> AsyncPostgresSession:
        """Streamed when the pool has two connections (see the sync twin)."""
        source_id = check_session_id(source_id)
        new_id = check_session_id(id) if id is not None else uuid7()
        if self.store.limits.max_size < 2:
            plan = plan_fork(await self.snapshot(source_id), source_id, scope, entry_id, position)
            return await self.create_from_plan(plan, new_id)
        q = self._q
        handle: AsyncPostgresSession | None = None
        try:
            async with self.store.connection() as conn, conn.transaction():
                await conn.execute(q.read_only)
                row = await (await conn.execute(q.session_row, (source_id,))).fetchone()
                if row is None:
                    raise SessionNotFoundError(f"session {source_id} does not exist")
                check_version(source_id, int(row[2]))
                rows = await (await conn.execute(q.all_registers, (source_id,))).fetchall()
                registers = tuple(register_from_row(r) for r in rows)
                wanted = resolve_fork_lookups(registers, entry_id)
                cur = await conn.execute(q.entries_by_ids, (source_id, wanted))
                found = {r[0]: entry_from_row(r) for r in await cur.fetchall()}
                shape = resolve_fork(registers, lambda ids: found, scope, entry_id, position)
                size = self.import_chunk_entries
                if shape.scope == "branch" and shape.tip is None:
                    stream = ForkStream((), shape.lanes, registers, source_id, shape.scope)
                    handle = await self._write_stream(new_id, stream, size, None)
                    return handle
                params: tuple[Any, ...]
                if shape.scope == "tree":
                    query, params = q.all_entries, (source_id,)
                else:
                    assert shape.tip is not None
                    query, params = q.path_entries, (source_id, shape.tip, source_id, source_id)
                await conn.execute(q.read_whole_cursor)
                loop = asyncio.get_running_loop()
                async with conn.cursor(name="pglease_session_fork") as server_cursor:
                    await server_cursor.execute(query, params)
                    # _write_stream pulls its chunks in a worker thread: the
                    # bridge fetches on this loop, which is free meanwhile.
                    raw = _bridged(loop, functools.partial(server_cursor.fetchmany, STREAM_FETCH))
                    entries = (
                        checked_seq_order(raw)
                        if shape.scope == "tree"
                        else checked_path(raw, shape.tip or "")
                    )
                    stream = ForkStream(entries, shape.lanes, registers, source_id, shape.scope)
                    try:
                        handle = await self._write_stream(new_id, stream, size, None)
                    finally:
                        stream.close()
        except psycopg.Error as exc:
            if handle is not None:  # the fork is complete; ending the source's snapshot failed
                return handle
            error = driver_error(self.store, exc)
            raise error from cause_of(error, exc)
        assert handle is not None
        return handle

    async def fork_to_file(
        self,
        source_id: str,
        directory: str | os.PathLike[str],
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> Path:
        """Streamed, as the sync twin's: the file is written in a worker thread
        that pulls the rows of a server-side cursor through the event loop."""
        source_id = check_session_id(source_id)
        new_id = check_session_id(id) if id is not None else uuid7()
        target = Path(directory) / (new_id + SUFFIX)
        if target.exists():
            raise SessionExistsError(f"session {new_id} already exists ({target})")
        q = self._q
        loop = asyncio.get_running_loop()

        async def run(conn: AConn) -> Path:
            row = await (await conn.execute(q.session_row, (source_id,))).fetchone()
            if row is None:
                raise SessionNotFoundError(f"session {source_id} does not exist")
            check_version(source_id, int(row[2]))
            rows = await (await conn.execute(q.all_registers, (source_id,))).fetchall()
            registers = tuple(register_from_row(r) for r in rows)
            wanted = resolve_fork_lookups(registers, entry_id)
            found_rows = await (
                await conn.execute(q.entries_by_ids, (source_id, wanted))
            ).fetchall()
            found = {r[0]: entry_from_row(r) for r in found_rows}
            shape = resolve_fork(registers, lambda ids: found, scope, entry_id, position)
            # Only now, with the source read and the fork valid: a missing
            # directory is created on demand; a refused fork leaves none.
            files = await asyncio.to_thread(SessionRepository, directory, renew_interval=None)
            if shape.scope == "branch" and shape.tip is None:
                stream = ForkStream((), shape.lanes, registers, source_id, shape.scope)
                return await asyncio.to_thread(files.write_stream, stream, new_id)
            params: tuple[Any, ...]
            if shape.scope == "tree":
                query, params = q.all_entries, (source_id,)
            else:
                assert shape.tip is not None
                query, params = q.path_entries, (source_id, shape.tip, source_id, source_id)
            await conn.execute(q.read_whole_cursor)
            async with conn.cursor(name="pglease_session_fork") as cur:
                await cur.execute(query, params)
                raw = _bridged(loop, functools.partial(cur.fetchmany, STREAM_FETCH))
                entries = (
                    checked_seq_order(raw)
                    if shape.scope == "tree"
                    else checked_path(raw, shape.tip or "")
                )
                stream = ForkStream(entries, shape.lanes, registers, source_id, shape.scope)
                try:
                    return await asyncio.to_thread(files.write_stream, stream, new_id)
                finally:
                    stream.close()

        return await _read_consistent(self.store, q, run)

    async def export_to_file(
        self, source_id: str, directory: str | os.PathLike[str], id: str | None = None
    ) -> Path:
        return await self.fork_to_file(source_id, directory, "tree", id=id)

    async def import_file(
        self,
        path: str | os.PathLike[str],
        id: str | None = None,
        *,
        chunk_entries: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> AsyncPostgresSession:
        """Streamed and chunked, as the sync twin's (the file is read in a
        worker thread, one chunk at a time)."""
        file_path = Path(path)
        if file_path.suffix != ".sqlite":
            raise InvalidSessionWriteError(f"{file_path} is not a .sqlite session file")
        file_id = check_session_id(file_path.name[: -len(".sqlite")])
        session_id = check_session_id(id) if id is not None else uuid7()
        size = check_chunk_size(
            self.import_chunk_entries if chunk_entries is None else chunk_entries
        )
        if not file_path.is_file():
            raise SessionNotFoundError(f"session file {file_path} does not exist")
        opened = file_fork_source(file_path)
        source = await asyncio.to_thread(opened.__enter__)
        try:
            shape = await asyncio.to_thread(resolve_fork, source.registers, source.lookup, "tree")
            stream = ForkStream(
                checked_seq_order(source.entries()), shape.lanes, source.registers, file_id,
                shape.scope,
            )
            try:
                return await self._write_stream(session_id, stream, size, on_progress)
            finally:
                await asyncio.to_thread(stream.close)
        finally:
            await asyncio.to_thread(opened.__exit__, None, None, None)

    # -- chunked imports (see the sync twin) --

    async def _in_transaction(
        self, fn: Callable[[AConn], Awaitable[T]], transaction: bool = True
    ) -> T:
        conn: AConn | None = None
        try:
            async with self.store.connection() as conn:
                if not transaction:
                    return await fn(conn)
                async with conn.transaction():
                    if (limits := pooler_limits(self.store)) is not None:
                        await conn.execute(limits)  # no session SET bounds it behind a pooler
                    return await fn(conn)
        except psycopg.Error as exc:
            error = import_refusal(exc) or (
                translate_unique(exc)
                if isinstance(exc, psycopg.errors.UniqueViolation)
                else driver_error(self.store, exc, conn is not None and conn.broken)
            )
            raise error from cause_of(error, exc)

    async def _begin_import(
        self, session_id: str, rid: str, token: str, parent: str | None
    ) -> None:
        params = (session_id, rid, parent, STORAGE_VERSION, EMPTY_USAGE_JSON, token)

        async def insert(conn: AConn) -> int:
            return (await conn.execute(self._q.begin_import, params)).rowcount

        for _ in range(3):
            if await self._in_transaction(insert):
                return
            rows = await self._fetch(self._q.import_state, (session_id,))
            if not rows:
                continue
            hidden, age = rows[0]
            if not hidden:
                raise SessionExistsError(f"session {session_id} already exists")
            if await self._take_and_purge(session_id, self.import_stale_after):
                log.warning(
                    "session %s: removed the hidden partial of an interrupted import", session_id
                )
                continue
            raise SessionBusyError(
                f"session {session_id}: another import of this id is in progress (last chunk"
                f" {float(age):.1f} s ago; a partial counts as abandoned after"
                f" {self.import_stale_after:g} s)"
            )
        raise SessionExistsError(f"session {session_id} already exists")

    async def _purge_import(
        self,
        session_id: str,
        token: str,
        size: int = PURGE_CHUNK,
        on_progress: Callable[[int], None] | None = None,
    ) -> bool:
        async def purge_some(conn: AConn) -> int:
            touched = await conn.execute(self._q.touch_import, (session_id, token))
            if not await touched.fetchall():
                return -1
            for query in self._q.purge_rows:
                deleted = (await conn.execute(query, (session_id, sizer.size))).rowcount
                if deleted:
                    return deleted
            await conn.execute(self._q.drop_import, (session_id, token))
            return 0

        removed = 0
        sizer = ChunkSizer(size)
        while True:
            began = time.monotonic()
            done = await self._in_transaction(purge_some)
            sizer.record(time.monotonic() - began)
            if done <= 0:
                return done == 0
            removed += done
            if on_progress is not None:
                on_progress(removed)

    async def _take_and_purge(self, session_id: str, stale_after: float) -> bool:
        token = uuid7()

        async def take(conn: AConn) -> list[tuple[Any, ...]]:
            cur = await conn.execute(self._q.take_import, (token, session_id, stale_after))
            return await cur.fetchall()

        return bool(await self._in_transaction(take)) and await self._purge_import(
            session_id, token
        )

    async def _discard_import(self, session_id: str, token: str) -> None:
        try:
            await self._purge_import(session_id, token)
        except PgleaseError as exc:
            log.warning("session %s: removing a failed import failed: %s", session_id, exc)

    async def cleanup_imports(self, stale_after: float | None = None) -> list[str]:
        """Remove stale hidden partial imports; return their ids (see the sync twin)."""
        limit = self.import_stale_after if stale_after is None else check_stale_after(stale_after)
        removed = []
        for sid, _age in await self._fetch(self._q.stale_imports, (limit, None, None)):
            if await self._take_and_purge(sid, limit):
                removed.append(sid)
        return removed

    async def _copied_ids(self, session_id: str, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(ids), 1000):
            part = list(ids[start : start + 1000])
            rows = await self._fetch(self._q.known_entries, (session_id, part))
            found.update(r[0] for r in rows)
        return found

    async def _write_stream(
        self,
        session_id: str,
        stream: ForkStream,
        size: int,
        on_progress: Callable[[int], None] | None,
    ) -> AsyncPostgresSession:
        q = self._q
        rid = await self.store.ensure_resource(RESOURCE_TYPE, session_id)
        token = uuid7()
        await self._begin_import(session_id, rid, token, stream.parent_session_id)
        try:
            written = messages = last_seq = 0
            limits = pooler_limits(self.store)
            sizer = ChunkSizer(size)
            parts = sized_chunks(stream.entries, sizer)
            while (part := await asyncio.to_thread(next, parts, None)) is not None:
                seconds = await self._in_transaction(
                    functools.partial(
                        _write_chunk,
                        q=q,
                        session_id=session_id,
                        token=token,
                        entries=part,
                        limits=limits,
                    ),
                    transaction=False,
                )
                sizer.record(seconds)
                written += len(part)
                messages += sum(1 for e in part if e.type == "message")
                last_seq = max(last_seq, part[-1].seq)
                if on_progress is not None:
                    on_progress(written)
            copied = await self._copied_ids(session_id, stream.label_keys())
            registers, next_seq = stream.registers(last_seq, copied)
            for regs in chunks(registers, size):
                await self._in_transaction(
                    functools.partial(
                        _write_registers,
                        q=q,
                        session_id=session_id,
                        token=token,
                        registers=regs,
                        limits=limits,
                    ),
                    transaction=False,
                )
            claim, started = await self._claim(session_id, rid, IMPORT_CLAIM_WAIT)
            created_at = None if self.now_ms is None else self.now_ms()
            payload = {
                "session": session_id,
                "parent_session_id": stream.parent_session_id,
                "entries": written,
                "next_seq": next_seq,
            }

            async def apply(conn: AConn) -> None:
                finish = (created_at, messages, next_seq, session_id, token)
                if (await conn.execute(q.finish_import, finish)).rowcount != 1:
                    raise import_gone(session_id)

            try:
                result = await self.store.mutate(
                    Permit(rid, claim.revision, claim), "session.forked", apply, payload
                )
            except psycopg.Error as exc:
                await self._release_quietly(claim)
                error = _mutation_error(self.store, exc)
                raise error from cause_of(error, exc)
            except BaseException:
                await self._release_quietly(claim)
                raise
        except BaseException:
            await self._discard_import(session_id, token)
            raise
        return self._handle(session_id, claim, started, result.revision, next_seq)

    async def snapshot(self, session_id: str) -> SessionSnapshot:
        check_session_id(session_id)

        async def read(conn: AConn) -> SessionSnapshot:
            return await _read_snapshot(conn, self._q, session_id)

        return await _read_consistent(self.store, self._q, read)

    async def _infos(self, session_id: str | None) -> SessionListing:
        rows = await self._fetch(self._q.list_sessions, (session_id, session_id))
        listing = SessionListing()
        for r in rows:
            sid = r[0]
            location = f"{self.store.schema}.sessions/{sid}"
            try:
                check_version(sid, int(r[3]))
                usage = json.loads(r[5])
            except (SessionError, ValueError) as exc:
                error = (
                    exc
                    if isinstance(exc, SessionError)
                    else SessionCorruptError(f"session {sid} has invalid usage_payload")
                )
                listing.problems.append(SessionProblem(sid, location, error))
                continue
            lease = None if r[7] is None else LeaseInfo(r[7], int(r[8]), int(r[9]))
            listing.sessions.append(
                SessionInfo(
                    id=sid,
                    path=location,
                    created_at=int(r[1]),
                    parent_session_id=r[2],
                    storage_version=int(r[3]),
                    message_count=int(r[4]),
                    usage=usage,
                    next_seq=int(r[6]),
                    lease=lease,
                )
            )
        if session_id is None:
            stale = await self._fetch(self._q.stale_imports, (self.import_stale_after, None, None))
            for sid, age in stale:
                location = f"{self.store.schema}.sessions/{sid}"
                listing.problems.append(
                    SessionProblem(sid, location, stale_import_problem(sid, float(age)))
                )
        listing.sessions.sort(key=lambda s: (-s.created_at, s.id))
        return listing

    async def list(self) -> SessionListing:
        return await self._infos(None)

    async def info(self, session_id: str) -> SessionInfo:
        check_session_id(session_id)
        listing = await self._infos(session_id)
        if listing.problems:
            raise listing.problems[0].error
        if not listing.sessions:
            raise SessionNotFoundError(f"session {session_id} does not exist")
        return listing.sessions[0]

    async def delete(
        self,
        session_id: str,
        *,
        chunk_rows: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        """Delete a session, its rows in short transactions (see the sync twin)."""
        check_session_id(session_id)
        size = check_chunk_size(PURGE_CHUNK if chunk_rows is None else chunk_rows, "chunk_rows")
        if not await self.exists(session_id):
            raise SessionNotFoundError(f"session {session_id} does not exist")
        rid = resource_id(RESOURCE_TYPE, session_id)
        token = uuid7()

        async def hide(conn: AConn) -> None:
            cur = await conn.execute(self._q.hide_session, (token, session_id))
            if not await cur.fetchall():
                raise SessionNotFoundError(f"session {session_id} does not exist")

        for attempt in (1, 2, 3):
            revision = (await self.store.get(rid)).revision
            try:
                await self.store.mutate(
                    Permit(rid, revision), "session.deleted", hide, {"session": session_id}
                )
                break
            except ResourceLeasedError as exc:
                raise SessionBusyError(f"session {session_id} is leased: {exc}") from None
            except StaleResourceError:
                if attempt == 3:
                    raise
            except psycopg.Error as exc:
                error = _mutation_error(self.store, exc)
                raise error from cause_of(error, exc)
        try:
            await self._purge_import(session_id, token, size, on_progress)
        except PgleaseError as exc:
            raise delete_interrupted(session_id, exc) from exc


__all__ = ["AsyncPostgresSession", "AsyncPostgresSessionRepository", "write_plan_rows_async"]
