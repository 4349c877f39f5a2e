# Generated from pglease/sessions/postgres_async.py by tools/async_to_sync.py: do not edit.
"""Sessions in PostgreSQL tables (`sql/0004_sessions.sql`), shared by a fleet.

The same session model as the per-session files, stored in the `session_*`
tables of the store's schema, so any host can open any session. Two flavours:
`AsyncPostgresSessionRepository` on an `AsyncPostgresStore`, written in
`pglease/sessions/postgres_async.py`, and `PostgresSessionRepository` on a
`PostgresStore`, its blocking twin `pglease/sessions/postgres.py`, generated
by `tools/async_to_sync.py` (edit the asyncio source, then run the tool).

- The writer lease is a pglease lease on the resource `("session", id)`, held
  by `Owner("session", "<host>/<pid>/<uuid7>")`, fresh for every handle (as the
  file format's owner_id is). Its TTL is `lease_seconds` (30 s), renewed every
  `renew_interval` (15 s) by the store's keeper, the one `hold()` uses
  (`pg_lease`): a heartbeat, no revision bump, no event.
- Every commit is one `mutate` of the store with the handle's lease: the fence
  check (owner, generation, token, expiry, under the lease row lock), the
  revision bump, the `session.commit` event and the session rows commit in one
  transaction. A commit does not extend the lease; the heartbeat does. (An
  extra renew per commit would cost a round trip, a revision and an event.)
- A commit bumps the resource revision, so the handle tracks the revision it
  holds after every commit (and adopts a moved one once, after the fence check).
- Expiry is judged by the database clock. A lease that expired is lost even if
  nobody took it over: the next `open` gets a new generation.
- Timestamps (`created_at`, entry timestamps) come from the database clock, so
  hosts with skewed clocks still stamp one session consistently.

The branch-index algorithm (`pg_core`) is synchronous. On asyncio it runs
against a `ReplayIndex`: the driver fetches whatever a step misses, then runs
the step again; the blocking flavour's `PgBranchIndex` queries as it goes.
Session files are local SQLite: their side of `fork_to_file` and
`import_file` runs in a worker thread on asyncio (`to_thread`), directly in
the blocking flavour.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from .._compat import Event, Lock, fetched_in_thread, thread_lock, to_thread
from ..clock import SYSTEM_CLOCK, Clock
from ..errors import (
    AcquireTimeoutError,
    LeaseLostError,
    LockTimeoutError,
    PgleaseError,
    ResourceLeasedError,
    StaleResourceError,
)
from ..ids import resource_id
from ..postgres import PostgresStore
from ..runtime import HeldLease, Keeper, Timing
from ..runtime.acquire import _acquire
from ..types import Claim, Owner, Permit
from ..validation import check_timeout
from ._conveniences import ConvenienceWrites
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
    Entry,
    LeaseInfo,
    Register,
    SessionInfo,
    SessionSnapshot,
    SessionStats,
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
    ChunkBuilder,
    ChunkIndex,
    ChunkSizer,
    CommitBuilder,
    Miss,
    PgBranchIndex,
    PlanBuilder,
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
from .pg_core import (
    send as _send,
)
from .pg_lease import WriterLease, connected_keeper, writer_timing
from .repository import (
    SUFFIX,
    SessionListing,
    SessionProblem,
    SessionRepository,
    check_session_id,
)
from .schema import EMPTY_USAGE_JSON, STORAGE_VERSION
from .sqlite_file import STREAM_FETCH, file_fork_source
from .writes import Prepared, prepare_writes

log = logging.getLogger("pglease.sessions")

Conn = psycopg.Connection[Any]
NowMs = Callable[[], int]
T = TypeVar("T")

#: The branch index of one transaction (see the module docstring).
Index = PgBranchIndex


def _index(conn: Conn, q: Sql, sid: str, **kwargs: Any) -> Index:
    return PgBranchIndex(conn, q, sid, **kwargs)


def _replay(conn: Conn, index: Index, step: Callable[[], T]) -> T:
    """Run a step of the branch-index algorithm on `index`. On asyncio each
    read the step misses is fetched and the step runs again; a blocking
    `PgBranchIndex` reads as it goes, so the step runs once."""
    return step()


def _write_commit(
    conn: Conn,
    q: Sql,
    session_id: str,
    prepared: Sequence[Prepared],
    expected_seq: int,
    fixed_now: int | None,
) -> tuple[CommitResult, list[Entry], list[UsageRow]]:
    """The session half of a commit, inside the mutation's transaction."""
    index = _index(conn, q, session_id)
    build = CommitBuilder(q, session_id, prepared, expected_seq, fixed_now, index)
    # The reads of the whole commit in one pipelined round trip.
    with conn.pipeline():
        cursors = {
            name: conn.execute(query, params) for name, (query, params) in build.lookups().items()
        }
        results = {name: cur.fetchall() for name, cur in cursors.items()}
    build.start(results)
    for i in range(len(prepared)):
        _replay(conn, index, functools.partial(build.step, i))
    # Everything left is writes whose results we do not need: one pipeline,
    # one network round trip (errors still surface here, inside the transaction).
    with conn.pipeline():
        _send(conn, build.batches())
    return build.result()


def write_plan_rows(
    conn: Conn, q: Sql, session_id: str, plan: ForkPlan, created_at: int | None
) -> None:
    """Insert a new session built from a plan (caller's transaction). The entries
    go through the branch index in seq order; an existing id fails."""
    index = _index(conn, q, session_id)
    build = PlanBuilder(q, session_id, plan, created_at, index)
    query, params = build.session_insert()
    cur = conn.execute(query, params)
    if cur.rowcount != 1:
        raise SessionExistsError(f"session {session_id} already exists")
    for i in range(len(build.entries)):
        _replay(conn, index, functools.partial(build.step, i))
    with conn.pipeline():
        _send(conn, build.batches())


def _write_chunk(
    conn: Conn, q: Sql, session_id: str, token: str, entries: list[Entry], limits: bytes | None
) -> float:
    """One import chunk on an autocommit connection: plain reads (the lookups in
    one round trip, then what the branch index asks for), then every write in
    one `session_import_chunk` call, the chunk's only write transaction.
    Returns the seconds of that call (what the chunk sizer bounds)."""
    index = ChunkIndex(q, session_id)
    build = ChunkBuilder(q, session_id, token, entries, index)
    lookups = build.lookups()
    results: dict[str, list[Row]] = {}
    if lookups:
        with conn.pipeline():
            cursors = {name: conn.execute(*read) for name, read in lookups.items()}
            results = {name: cur.fetchall() for name, cur in cursors.items()}
    try:
        build.start(results)
        for i in range(len(entries)):
            _read_into(conn, index, functools.partial(build.step, i))
    except PgleaseError:
        # A parent missing may mean a cleanup took the import over and purged
        # it: say that rather than blame the source.
        build.checked(conn.execute(*build.alive()).fetchall())
        raise
    began = time.monotonic()
    _call(conn, build.call(), limits)
    return time.monotonic() - began


def _read_into(conn: Conn, index: ChunkIndex, step: Callable[[], T]) -> T:
    """Run a step of an import chunk's branch index, fetching the reads it
    misses (nothing is written before the chunk's one call)."""
    while True:
        try:
            return step()
        except Miss as miss:
            cur = conn.execute(miss.query, miss.params)
            index.supply(miss, cur.fetchall())


def _write_registers(
    conn: Conn,
    q: Sql,
    session_id: str,
    token: str,
    registers: list[Register],
    limits: bytes | None,
) -> None:
    _call(conn, registers_call(q, session_id, token, registers), limits)


def _call(conn: Conn, call: tuple[bytes, Row], limits: bytes | None) -> None:
    """A chunk's call: alone in autocommit; in pooler mode (`limits`, no
    session SET bounds it there) after the store's limits in one pipelined
    transaction, BEGIN to COMMIT sent at once."""
    if limits is None:
        conn.execute(*call)
        return
    with conn.pipeline(), conn.transaction():
        conn.execute(limits)
        conn.execute(*call)


#: How long a worker thread consuming a fork waits for one fetch of the source
#: (the store's statement timeout usually ends a stuck one first).
FETCH_WAIT = 300.0


def _fetch_stalled() -> SessionError:
    return SessionError(f"reading the source session stalled: no rows within {FETCH_WAIT:g} s")


@contextlib.contextmanager
def _fork_source(
    conn: Conn,
    q: Sql,
    source_id: str,
    scope: ForkScope,
    entry_id: str | None,
    position: ForkPosition,
) -> Iterator[ForkStream]:
    """A streamed fork of a PostgreSQL session (caller's read-only transaction):
    the registers and the fork's lookups now, the entries as they are read
    from a server-side cursor, `STREAM_FETCH` rows at a time (the client never
    holds more than one fetch). A branch fork reads only the branch (a
    recursive walk up from its tip). The entries may be pulled from a worker
    thread (`to_thread`), as `_write_stream` and the file writer do."""
    row = conn.execute(q.session_row, (source_id,)).fetchone()
    if row is None:
        raise SessionNotFoundError(f"session {source_id} does not exist")
    check_version(source_id, int(row[2]))
    rows = conn.execute(q.all_registers, (source_id,)).fetchall()
    registers = tuple(register_from_row(r) for r in rows)
    # Every entry the fork's shape depends on, in one round trip (a bad
    # `entry_id` is left out here: `resolve_fork` refuses it by name).
    wanted = resolve_fork_lookups(registers, entry_id if isinstance(entry_id, str) else None)
    found_rows = conn.execute(q.entries_by_ids, (source_id, wanted)).fetchall()
    found = {r[0]: entry_from_row(r) for r in found_rows}
    shape = resolve_fork(registers, lambda ids: found, scope, entry_id, position)
    tip = shape.tip
    params: tuple[Any, ...]
    if shape.scope == "tree":
        query, params = q.all_entries, (source_id,)
    elif tip is None:  # an empty branch
        yield ForkStream((), shape.lanes, registers, source_id, shape.scope)
        return
    else:
        query, params = q.path_entries, (source_id, tip, source_id, source_id)
    conn.execute(q.read_whole_cursor)
    with conn.cursor(name="pglease_session_fork") as cur:
        cur.execute(query, params)
        fetch = functools.partial(cur.fetchmany, STREAM_FETCH)
        raw = fetched_in_thread(fetch, wait=FETCH_WAIT, stalled=_fetch_stalled)
        read = (entry_from_row(r) for r in raw)
        entries = (
            checked_seq_order(read)
            if shape.scope == "tree" or tip is None
            else checked_path(read, tip)
        )
        stream = ForkStream(entries, shape.lanes, registers, source_id, shape.scope)
        try:
            yield stream
        finally:
            stream.close()


# --- reading ------------------------------------------------------------------------------


def _read(store: PostgresStore, fn: Callable[[Conn], T], bounded: bool = True) -> T:
    """Run a read on a store connection; once more on a fresh one when the
    connection breaks under it (a read is safe to repeat). Driver errors come
    out as PgleaseErrors, as from the store's own reads. In pooler mode it runs
    in a transaction that sets the store's limits first (pipelined with it)."""
    for attempt in (1, 2):
        conn: Conn | None = None
        try:
            with store.connection() as conn:
                if not bounded or (limits := pooler_limits(store)) is None:
                    return fn(conn)
                with conn.pipeline(), conn.transaction():
                    conn.execute(limits)
                    return fn(conn)
        except psycopg.Error as exc:
            broken = conn is not None and conn.broken
            if broken and attempt == 1:
                continue
            error = driver_error(store, exc, broken)
            raise error from cause_of(error, exc)
    raise AssertionError("unreachable")


def _read_consistent(store: PostgresStore, q: Sql, fn: Callable[[Conn], T]) -> T:
    """`_read` in a repeatable-read, read-only transaction: one consistent view."""

    def run(conn: Conn) -> T:
        with conn.transaction():
            conn.execute(q.read_only)  # first: it must precede any query
            if (limits := pooler_limits(store)) is not None:
                conn.execute(limits)
            return fn(conn)

    return _read(store, run, bounded=False)


def _fetch_all(
    store: PostgresStore, query: bytes, params: tuple[Any, ...]
) -> list[tuple[Any, ...]]:
    """The rows of one read (see `_read`)."""

    def run(conn: Conn) -> list[tuple[Any, ...]]:
        return conn.execute(query, params).fetchall()

    return _read(store, run)


def _mutation_error(store: PostgresStore, exc: psycopg.Error) -> PgleaseError:
    """A driver error `mutate` let through from our `apply` (the session SQL is
    ours, so none reaches the caller raw); the transaction was rolled back."""
    if isinstance(exc, psycopg.errors.UniqueViolation):
        return translate_unique(exc)
    return driver_error(store, exc)


def _read_snapshot(conn: Conn, q: Sql, session_id: str) -> SessionSnapshot:
    row = conn.execute(q.session_row, (session_id,)).fetchone()
    if row is None:
        raise SessionNotFoundError(f"session {session_id} does not exist")
    check_version(session_id, int(row[2]))
    entries = conn.execute(q.all_entries, (session_id,)).fetchall()
    registers = conn.execute(q.all_registers, (session_id,)).fetchall()
    return SessionSnapshot(
        tuple(entry_from_row(r) for r in entries),
        tuple(register_from_row(r) for r in registers),
        row[1],
    )


# --- the handle ---------------------------------------------------------------------------


class PostgresSession(ConvenienceWrites):
    """A writer handle on a session in PostgreSQL, holding its writer lease.

    Created by the repository's `create/open/fork/import_file`. Same API as
    the file sessions' handles; once the lease is lost every call but
    `close()` raises `WriterLeaseLostError`.
    """

    def __init__(
        self,
        *,
        repository: PostgresSessionRepository,
        session_id: str,
        lease: WriterLease,
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
        lease.watch(self, PostgresSession._keeper_lost)

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
    def held(self) -> HeldLease | None:
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

    def __enter__(self) -> PostgresSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    def renew(self) -> None:
        """Extend the lease by `lease_seconds` now (the keeper does it every
        `renew_interval` anyway): a heartbeat, no revision bump, no event.
        A lost lease -> `WriterLeaseLostError`."""
        with self._lock:
            self._usable()
            status = self._lease.renew()
            if status == "busy":
                # The lease row is locked by a write in flight: nothing changed.
                raise LockTimeoutError(
                    f"session {self._id}: the writer lease row was locked during renewal"
                )
            if status != "renewed":
                raise self._mark_lost(f"no longer current: the heartbeat found it {status}")

    def close(self) -> None:
        """Stop renewing, release the lease (if still ours); the handle is done."""
        with self._lock:
            if self._closed:
                return
            self._lease.stop("released: the session handle was closed")
            try:
                if not self.lost.is_set():
                    self._store.release(self._claim)
            except PgleaseError as exc:
                # A stale holder cannot release its successor's lease, and one we
                # cannot reach runs out by itself: close() never raises for it.
                log.warning("session %s: releasing the lease failed: %s", self._id, exc)
            finally:
                self._closed = True
                self._repo._forget(self)

    # -- writes --

    def _commit(self, writes: Sequence[Write]) -> tuple[CommitResult, list[Entry], list[UsageRow]]:
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
        with self._lock:
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

                def apply(conn: Conn, first: int = first) -> Any:
                    return _write_commit(conn, self._q, self._id, prepared, first, fixed_now)

                try:
                    result = self._store.mutate(
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

    def commit(self, writes: Sequence[Write]) -> CommitResult:
        """Apply `writes` atomically, fenced by the writer lease: seqs next_seq..,
        one timestamp, one `session.commit` event."""
        return self._commit(writes)[0]

    def append_entry(
        self,
        type: str,
        parent_id: str | None,
        payload: Mapping[str, Any] | None = None,
        *,
        custom_type: str | None = None,
        id: str | None = None,
    ) -> Entry:
        _, entries, _ = self._commit([AppendEntry(type, parent_id, payload or {}, custom_type, id)])
        return entries[0]

    def add_usage(
        self,
        usage: dict[str, Any],
        *,
        entry_id: str | None = None,
        adjustment: bool = False,
        details: Any = None,
        id: str | None = None,
    ) -> UsageRow:
        _, _, rows = self._commit([AddUsage(usage, entry_id, adjustment, details, id)])
        return rows[0]

    # -- reads --

    def _rows(self, query: bytes, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._lock:
            self._usable()
        return _fetch_all(self._store, query, params)

    def get_entry(self, entry_id: str) -> Entry | None:
        rows = self._rows(self._q.get_entry, (self._id, entry_id))
        return entry_from_row(rows[0]) if rows else None

    def scan_entries(
        self,
        *,
        after_seq: int = 0,
        limit: int | None = None,
        types: Iterable[str] | None = None,
    ) -> list[Entry]:
        """Entries with `seq > after_seq` in seq order, optionally of some types."""
        wanted = check_scan_args(after_seq, limit, types)
        rows = self._rows(self._q.scan_entries, (self._id, after_seq, wanted, wanted, limit))
        return [entry_from_row(r) for r in rows]

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
        with self._lock:
            self._usable()

        def scan(conn: Conn) -> list[Entry]:
            row = conn.execute(self._q.get_entry, (self._id, leaf_id)).fetchone()
            if row is None:
                raise UnknownEntryError(f"entry {leaf_id!r} does not exist")
            leaf = entry_from_row(row)
            index = _index(
                conn, self._q, self._id, load_entries=True, first_page=first_page_for(query)
            )
            # Read-only: a replay reuses every page fetched before.
            return _replay(conn, index, lambda: _scan_branch(index, leaf, query, index.load))

        return _read_consistent(self._store, self._q, scan)

    def get_register(self, namespace: str, key: str) -> Register | None:
        rows = self._rows(self._q.get_register, (self._id, namespace, key))
        return register_from_row(rows[0]) if rows else None

    def list_registers(self, namespace: str, prefix: str = "") -> list[Register]:
        """Registers of `namespace` whose key starts with `prefix`, ordered by key."""
        rows = self._rows(self._q.list_registers, (self._id, namespace, prefix, prefix))
        return [register_from_row(r) for r in rows]

    def usage_rows(self) -> list[UsageRow]:
        return [usage_from_row(r) for r in self._rows(self._q.usage_rows, (self._id,))]

    def stats(self) -> SessionStats:
        with self._lock:
            self._usable()

        def read(conn: Conn) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
            row = conn.execute(self._q.session_row, (self._id,)).fetchone()
            if row is None:
                raise SessionNotFoundError(f"session {self._id} does not exist")
            return row, conn.execute(self._q.entry_count, (self._id,)).fetchone()

        row, count = _read_consistent(self._store, self._q, read)
        assert count is not None
        return SessionStats(
            created_at=int(row[0]),
            parent_session_id=row[1],
            message_count=int(row[3]),
            usage=load_json(row[4]),
            next_seq=int(row[5]),
            entry_count=int(count[0]),
        )

    def snapshot(self) -> SessionSnapshot:
        with self._lock:
            self._usable()
        return self._repo.snapshot(self._id)


# --- the repository -------------------------------------------------------------------------


class PostgresSessionRepository:
    """Sessions in the `session_*` tables of an open store's schema.

    `lease_seconds` / `renew_interval` set the writer lease of the handles it
    opens (30 s / 15 s): the store's keeper, the one `hold()` uses, renews it
    every `renew_interval` (see `pg_lease`); `renew_interval=None` disables
    background renewal (only `handle.renew()` extends it). `clock` (a
    `pglease.clock.Clock`, the system clock by default) decides trust windows
    and renewal times, and picks the keeper (one per store and clock).
    `now_ms`, when given, replaces the database clock for timestamps (tests);
    lease expiry is always judged by the database clock. `on_lost` is called
    when a handle finds its lease lost. Imports commit `import_chunk_entries`
    entries per transaction, hidden until the last; a hidden partial with no
    progress for `import_stale_after` seconds counts as abandoned.
    """

    def __init__(
        self,
        store: PostgresStore,
        *,
        lease_seconds: float = 30.0,
        renew_interval: float | None = 15.0,
        now_ms: NowMs | None = None,
        on_lost: Callable[[PostgresSession], None] | None = None,
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
        self._open: weakref.WeakSet[PostgresSession] = weakref.WeakSet()

    def __enter__(self) -> PostgresSessionRepository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every handle this repository opened (the store stays open)."""
        with self._lock:
            handles = list(self._open)
        for handle in handles:
            handle.close()

    def _forget(self, handle: PostgresSession) -> None:
        with self._lock:
            self._open.discard(handle)

    # -- opening --

    def exists(self, session_id: str) -> bool:
        """True when the session exists (and is not a hidden import)."""
        check_session_id(session_id)
        return bool(self._fetch(self._q.session_exists, (session_id,)))

    def _fetch(self, query: bytes, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return _fetch_all(self.store, query, params)

    def _held_error(self, session_id: str, rid: str) -> SessionAlreadyClaimedError:
        lease = self.store.get(rid).lease
        holder = lease.owner.id if lease.owner else "(released meanwhile)"
        until = lease.expires_at.isoformat() if lease.expires_at else "-"
        return SessionAlreadyClaimedError(
            f"session {session_id} is already claimed by writer {holder}: the lease is "
            f"already held by {lease.owner} (generation {lease.generation}) until {until}"
        )

    def _claim(self, session_id: str, rid: str, wait: float | None) -> tuple[Claim, float]:
        """Claim the writer lease for a new handle: (claim, monotonic start of the
        request that won it). Held by another: `SessionAlreadyClaimedError`, at
        once or, with `wait`, after waiting that long through the fleet runtime's
        acquire (woken by the holder's release or expiry, not a poll)."""
        owner = Owner(OWNER_TYPE, new_owner_id())
        if self._timing is not None:
            # Before claiming, as `hold` does: no lease this host cannot renew.
            connected_keeper(self.store, self.clock)
        if wait is None:
            started = self.clock.monotonic()
            claim = self.store.claim(rid, owner, self.lease_seconds)
            if claim is None:
                raise self._held_error(session_id, rid)
            return claim, started
        try:
            return _acquire(
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
            raise self._held_error(session_id, rid) from None

    def _handle(
        self, session_id: str, claim: Claim, started: float, revision: int, next_seq: int
    ) -> PostgresSession:
        """A handle on a claimed lease, which the store's keeper renews from now on."""
        keeper = None if self._timing is None else Keeper.for_store(self.store, self.clock)
        lease = WriterLease(
            self.store, claim, started, self.lease_seconds, self.clock, keeper, self._timing
        )
        handle = PostgresSession(
            repository=self,
            session_id=session_id,
            lease=lease,
            revision=revision,
            next_seq=next_seq,
        )
        with self._lock:
            self._open.add(handle)
        return handle

    def _release_quietly(self, claim: Claim) -> None:
        try:
            self.store.release(claim)
        except PgleaseError as exc:  # the lease runs out by itself
            log.warning("releasing %s failed: %s", claim.resource_id, exc)

    def open(self, session_id: str, *, wait: float | None = None) -> PostgresSession:
        """Open an existing session and claim its writer lease.

        Another live holder -> `SessionAlreadyClaimedError` naming it, or with
        `wait` seconds, once it has not let go within them (the wait wakes when
        the holder releases the lease or it expires).
        """
        check_session_id(session_id)
        wait = check_timeout(wait, "wait")
        rows = self._fetch(self._q.session_exists, (session_id,))
        if not rows:
            raise SessionNotFoundError(f"session {session_id} does not exist")
        check_version(session_id, int(rows[0][0]))
        rid = resource_id(RESOURCE_TYPE, session_id)
        claim, started = self._claim(session_id, rid, wait)
        try:
            found = self._fetch(self._q.session_row, (session_id,))
            if not found:
                raise SessionNotFoundError(f"session {session_id} was deleted")
        except BaseException:
            self._release_quietly(claim)
            raise
        return self._handle(session_id, claim, started, claim.revision, int(found[0][5]))

    def _create_from_plan(self, session_id: str, plan: ForkPlan, event: str) -> PostgresSession:
        rid = self.store.ensure_resource(RESOURCE_TYPE, session_id)
        if self.exists(session_id):
            raise SessionExistsError(f"session {session_id} already exists")
        claim, started = self._claim(session_id, rid, None)
        created_at = None if self.now_ms is None else self.now_ms()
        payload = {
            "session": session_id,
            "parent_session_id": plan.parent_session_id,
            "entries": len(plan.entries),
            "next_seq": plan.next_seq,
        }

        def apply(conn: Conn) -> None:
            write_plan_rows(conn, self._q, session_id, plan, created_at)

        try:
            result = self.store.mutate(Permit(rid, claim.revision, claim), event, apply, payload)
        except psycopg.Error as exc:
            self._release_quietly(claim)
            error = _mutation_error(self.store, exc)
            raise error from cause_of(error, exc)
        except BaseException:
            self._release_quietly(claim)
            raise
        return self._handle(session_id, claim, started, result.revision, plan.next_seq)

    def create(
        self, id: str | None = None, parent_session_id: str | None = None
    ) -> PostgresSession:
        """Create a new empty session (lane.leaf/main = null at seq 1,
        lane.state/main idle at seq 2, next_seq 3) and claim its lease."""
        session_id = check_session_id(id) if id is not None else uuid7()
        if parent_session_id is not None and not isinstance(parent_session_id, str):
            raise InvalidSessionWriteError("parent_session_id must be a string or None")
        return self._create_from_plan(
            session_id, new_session_plan(parent_session_id), "session.created"
        )

    def create_from_plan(self, plan: ForkPlan, id: str | None = None) -> PostgresSession:
        """Write a fork plan (from any backend's snapshot) as a new session and open it."""
        session_id = check_session_id(id) if id is not None else uuid7()
        return self._create_from_plan(session_id, plan, "session.forked")

    def fork(
        self,
        source_id: str,
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> PostgresSession:
        """Copy (part of) a session into a new PostgreSQL session and open it. The
        source is read in one snapshot without touching its lease.

        Streamed like `import_file` when the pool has two connections (the
        source's read-only snapshot on one, the new session's chunks on the
        other); with a one-connection pool, one snapshot and one transaction."""
        source_id = check_session_id(source_id)
        new_id = check_session_id(id) if id is not None else uuid7()
        if self.store.limits.max_size < 2:
            plan = plan_fork(self.snapshot(source_id), source_id, scope, entry_id, position)
            return self.create_from_plan(plan, new_id)
        q = self._q
        handle: PostgresSession | None = None
        try:
            with self.store.connection() as conn, conn.transaction():
                conn.execute(q.read_only)
                with _fork_source(conn, q, source_id, scope, entry_id, position) as stream:
                    handle = self._write_stream(new_id, stream, self.import_chunk_entries, None)
        except psycopg.Error as exc:
            if handle is not None:  # the fork is complete; ending the source's snapshot failed
                return handle
            error = driver_error(self.store, exc)
            raise error from cause_of(error, exc)
        assert handle is not None
        return handle

    # -- across stores --

    def fork_to_file(
        self,
        source_id: str,
        directory: str | os.PathLike[str],
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> Path:
        """Fork a PostgreSQL session into a new `<directory>/<id>.sqlite` file in
        the session file format (closed, no writer lease); return its path.

        Streamed: entries go from a server-side cursor into the file as they
        are read (memory does not grow with the session), all in one
        read-only snapshot of the source; a branch fork reads only the branch."""
        source_id = check_session_id(source_id)
        new_id = check_session_id(id) if id is not None else uuid7()
        target = Path(directory) / (new_id + SUFFIX)
        if target.exists():
            raise SessionExistsError(f"session {new_id} already exists ({target})")
        q = self._q

        def run(conn: Conn) -> Path:
            with _fork_source(conn, q, source_id, scope, entry_id, position) as stream:
                # Only now, with the source read and the fork valid: a missing
                # directory is created on demand; a refused fork leaves none.
                files = to_thread(SessionRepository, directory, renew_interval=None)
                return to_thread(files.write_stream, stream, new_id)

        return _read_consistent(self.store, q, run)

    def export_to_file(
        self, source_id: str, directory: str | os.PathLike[str], id: str | None = None
    ) -> Path:
        """A tree fork into a file: every entry and lane."""
        return self.fork_to_file(source_id, directory, "tree", id=id)

    def import_file(
        self,
        path: str | os.PathLike[str],
        id: str | None = None,
        *,
        chunk_entries: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> PostgresSession:
        """Import a session file as a new PostgreSQL session whose parent is the
        file's session (a tree fork: entries and lanes kept, usage not copied).

        Streamed and chunked: `chunk_entries` entries per transaction (default
        `import_chunk_entries`), the session hidden from listings, opens and
        reads until the last, short, transaction shows it (with its
        `session.forked` event). `on_progress(entries_written)` runs after each
        chunk. A failed import removes what it wrote; one killed midway leaves a
        hidden partial that `list()` reports and that the next import of the
        same id or `cleanup_imports()` removes once it is stale."""
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
        # The file is read where blocking is fine (`to_thread`), a chunk at a time.
        opened = file_fork_source(file_path)
        source = to_thread(opened.__enter__)
        try:
            shape = to_thread(resolve_fork, source.registers, source.lookup, "tree")
            stream = ForkStream(
                checked_seq_order(source.entries()),
                shape.lanes,
                source.registers,
                file_id,
                shape.scope,
            )
            try:
                return self._write_stream(session_id, stream, size, on_progress)
            finally:
                to_thread(stream.close)
        finally:
            to_thread(opened.__exit__, None, None, None)

    # -- chunked imports --

    def _in_transaction(self, fn: Callable[[Conn], T], transaction: bool = True) -> T:
        """One short write transaction of an import or a purge (`transaction=False`:
        `fn` on the autocommit connection, each statement its own transaction)."""
        conn: Conn | None = None
        try:
            with self.store.connection() as conn:
                if not transaction:
                    return fn(conn)
                with conn.transaction():
                    if (limits := pooler_limits(self.store)) is not None:
                        conn.execute(limits)  # no session SET bounds it behind a pooler
                    return fn(conn)
        except psycopg.Error as exc:
            error = import_refusal(exc) or (
                translate_unique(exc)
                if isinstance(exc, psycopg.errors.UniqueViolation)
                else driver_error(self.store, exc, conn is not None and conn.broken)
            )
            raise error from cause_of(error, exc)

    def _begin_import(self, session_id: str, rid: str, token: str, parent: str | None) -> None:
        """Insert the hidden session row; an existing visible one is
        `SessionExistsError`, a live import `SessionBusyError`, a stale partial
        is removed first."""
        params = (session_id, rid, parent, STORAGE_VERSION, EMPTY_USAGE_JSON, token)

        def insert(conn: Conn) -> int:
            return conn.execute(self._q.begin_import, params).rowcount

        for _ in range(3):
            if self._in_transaction(insert):
                return
            rows = self._fetch(self._q.import_state, (session_id,))
            if not rows:
                continue  # deleted meanwhile: try again
            hidden, age = rows[0]
            if not hidden:
                raise SessionExistsError(f"session {session_id} already exists")
            if self._take_and_purge(session_id, self.import_stale_after):
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

    def _purge_import(
        self,
        session_id: str,
        token: str,
        size: int = PURGE_CHUNK,
        on_progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Delete a hidden import's (or deleted session's) rows in short
        transactions of up to `size` rows (fewer while they run past
        `CHUNK_TARGET`), each checking the token (a purge never
        touches a session that became visible); `on_progress(rows_removed)`
        after each. False when another cleanup took the partial over."""

        def purge_some(conn: Conn) -> int:
            touched = conn.execute(self._q.touch_import, (session_id, token))
            if not touched.fetchall():
                return -1
            for query in self._q.purge_rows:
                deleted = conn.execute(query, (session_id, sizer.size)).rowcount
                if deleted:
                    return deleted
            conn.execute(self._q.drop_import, (session_id, token))  # the row is locked: ours
            return 0

        removed = 0
        sizer = ChunkSizer(size)
        while True:
            began = time.monotonic()
            done = self._in_transaction(purge_some)
            sizer.record(time.monotonic() - began)
            if done <= 0:
                return done == 0
            removed += done
            if on_progress is not None:
                on_progress(removed)

    def _take_and_purge(self, session_id: str, stale_after: float) -> bool:
        """Take over a stale partial import (a new token) and remove it."""
        token = uuid7()

        def take(conn: Conn) -> list[tuple[Any, ...]]:
            cur = conn.execute(self._q.take_import, (token, session_id, stale_after))
            return cur.fetchall()

        return bool(self._in_transaction(take)) and self._purge_import(session_id, token)

    def _discard_import(self, session_id: str, token: str) -> None:
        try:
            self._purge_import(session_id, token)
        except PgleaseError as exc:  # the partial stays hidden; it goes once stale
            log.warning("session %s: removing a failed import failed: %s", session_id, exc)

    def cleanup_imports(self, stale_after: float | None = None) -> list[str]:
        """Remove hidden partial imports with no progress for `stale_after`
        seconds (default `import_stale_after`), in short transactions; return
        their ids."""
        limit = self.import_stale_after if stale_after is None else check_stale_after(stale_after)
        removed = []
        for sid, _age in self._fetch(self._q.stale_imports, (limit, None, None)):
            if self._take_and_purge(sid, limit):
                removed.append(sid)
        return removed

    def _copied_ids(self, session_id: str, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(ids), 1000):
            part = list(ids[start : start + 1000])
            rows = self._fetch(self._q.known_entries, (session_id, part))
            found.update(r[0] for r in rows)
        return found

    def _write_stream(
        self,
        session_id: str,
        stream: ForkStream,
        size: int,
        on_progress: Callable[[int], None] | None,
    ) -> PostgresSession:
        """A streamed fork as a new session: hidden row, entry chunks, register
        chunks, then one fenced mutation that shows it and claims its lease."""
        q = self._q
        rid = self.store.ensure_resource(RESOURCE_TYPE, session_id)
        token = uuid7()
        self._begin_import(session_id, rid, token, stream.parent_session_id)
        try:
            written = messages = last_seq = 0
            limits = pooler_limits(self.store)
            sizer = ChunkSizer(size)
            parts = sized_chunks(stream.entries, sizer)
            # The entries may come from a blocking reader (a file, `_fork_source`).
            while (part := to_thread(next, parts, None)) is not None:
                seconds = self._in_transaction(
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
            copied = self._copied_ids(session_id, stream.label_keys())
            registers, next_seq = stream.registers(last_seq, copied)
            for regs in chunks(registers, size):
                self._in_transaction(
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
            # A create() of this id racing the import claims and releases the lease
            # in one breath: wait for it rather than throw the import away.
            claim, started = self._claim(session_id, rid, IMPORT_CLAIM_WAIT)
            created_at = None if self.now_ms is None else self.now_ms()
            payload = {
                "session": session_id,
                "parent_session_id": stream.parent_session_id,
                "entries": written,
                "next_seq": next_seq,
            }

            def apply(conn: Conn) -> None:
                finish = (created_at, messages, next_seq, session_id, token)
                if conn.execute(q.finish_import, finish).rowcount != 1:
                    raise import_gone(session_id)

            try:
                result = self.store.mutate(
                    Permit(rid, claim.revision, claim), "session.forked", apply, payload
                )
            except psycopg.Error as exc:
                self._release_quietly(claim)
                error = _mutation_error(self.store, exc)
                raise error from cause_of(error, exc)
            except BaseException:
                self._release_quietly(claim)
                raise
        except BaseException:
            self._discard_import(session_id, token)
            raise
        return self._handle(session_id, claim, started, result.revision, next_seq)

    # -- reading without the lease --

    def snapshot(self, session_id: str) -> SessionSnapshot:
        """Entries (seq order) and registers in one consistent read, without
        touching the writer lease."""
        check_session_id(session_id)

        def read(conn: Conn) -> SessionSnapshot:
            return _read_snapshot(conn, self._q, session_id)

        return _read_consistent(self.store, self._q, read)

    def _infos(self, session_id: str | None) -> SessionListing:
        rows = self._fetch(self._q.list_sessions, (session_id, session_id))
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
            stale = self._fetch(self._q.stale_imports, (self.import_stale_after, None, None))
            for sid, age in stale:
                location = f"{self.store.schema}.sessions/{sid}"
                listing.problems.append(
                    SessionProblem(sid, location, stale_import_problem(sid, float(age)))
                )
        listing.sessions.sort(key=lambda s: (-s.created_at, s.id))
        return listing

    def list(self) -> SessionListing:
        """Every session, newest `created_at` first; `lease` is the live writer
        lease, if any (owner id, generation, expiry in ms)."""
        return self._infos(None)

    def info(self, session_id: str) -> SessionInfo:
        """One session as `list()` reports it."""
        check_session_id(session_id)
        listing = self._infos(session_id)
        if listing.problems:
            raise listing.problems[0].error
        if not listing.sessions:
            raise SessionNotFoundError(f"session {session_id} does not exist")
        return listing.sessions[0]

    def delete(
        self,
        session_id: str,
        *,
        chunk_rows: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        """Delete a session and all its rows. Refused while a writer lease is live
        (checked in the fenced transaction that hides the session).

        Chunked, so no transaction grows with the session: that transaction
        (with the `session.deleted` event) hides the session at once, as an
        import's token does; its rows then go in transactions of at most
        `chunk_rows` rows (default 5,000; fewer while a chunk runs past
        `CHUNK_TARGET`). `on_progress(rows_removed)` runs after each. A
        delete that stops midway (killed, connection lost) leaves a hidden
        remainder, reported by `list()` once stale and removed by
        `cleanup_imports()` or the next import of the id."""
        check_session_id(session_id)
        size = check_chunk_size(PURGE_CHUNK if chunk_rows is None else chunk_rows, "chunk_rows")
        if not self.exists(session_id):
            raise SessionNotFoundError(f"session {session_id} does not exist")
        rid = resource_id(RESOURCE_TYPE, session_id)
        token = uuid7()

        def hide(conn: Conn) -> None:
            cur = conn.execute(self._q.hide_session, (token, session_id))
            if not cur.fetchall():
                raise SessionNotFoundError(f"session {session_id} does not exist")

        for attempt in (1, 2, 3):
            revision = self.store.get(rid).revision
            try:
                self.store.mutate(
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
            self._purge_import(session_id, token, size, on_progress)
        except PgleaseError as exc:
            raise delete_interrupted(session_id, exc) from exc


# The sync lines give the twin its own names, in the order ruff sorts them.
__all__ = [
    "OWNER_TYPE",
    "RESOURCE_TYPE",
    "PgBranchIndex",
    "PostgresSession",
    "PostgresSessionRepository",
    "new_session_plan",
    "write_plan_rows",
]
