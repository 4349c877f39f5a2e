# Generated from pglease/sessions/pg_io_async.py by tools/async_to_sync.py: do not edit.
"""What the PostgreSQL session stores do over one connection, asyncio source
of `pg_io`: a commit's and a plan's writes, an import chunk's reads and call,
a streamed fork's source, and reads that retry once on a fresh connection.

The branch-index algorithm (`pg_core`) is synchronous. On asyncio it runs
against a `ReplayIndex`: the driver fetches whatever a step misses, then runs
the step again; the blocking flavour's `PgBranchIndex` queries as it goes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg

from .._compat import fetched_in_thread
from ..errors import PgleaseError
from ..postgres import PostgresStore
from .errors import SessionError, SessionExistsError, SessionNotFoundError
from .fork import (
    ForkPlan,
    ForkPosition,
    ForkScope,
    ForkStream,
    checked_path,
    checked_seq_order,
    resolve_fork,
    resolve_fork_lookups,
)
from .model import CommitResult, Entry, Register, SessionSnapshot, UsageRow
from .pg_core import (
    ChunkBuilder,
    ChunkIndex,
    CommitBuilder,
    Miss,
    PgBranchIndex,
    PlanBuilder,
    Row,
    Sql,
    cause_of,
    check_version,
    driver_error,
    entry_from_row,
    pooler_limits,
    register_from_row,
    registers_call,
    translate_unique,
)
from .pg_core import (
    send as _send,
)
from .sqlite_file import STREAM_FETCH
from .writes import Prepared

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
