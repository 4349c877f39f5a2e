"""`SqliteStore`: the lease store on one SQLite file, blocking API.

The semantics are those of the PostgreSQL functions in ``sql/0001_core.sql``
(claim, renew, release, mutate_begin; claim as redefined in
``sql/0007_expiry_gc.sql``), written in Python and run inside one
``BEGIN IMMEDIATE`` transaction each. SQLite admits a single writer per file,
so holding the write lock is the row lock of the PostgreSQL version: the checks
and the writes they allow can never be separated by another writer.

Clock: SQLite has no server clock, so expiry is judged by the host's wall
clock (`time.time()`), read after BEGIN IMMEDIATE has taken the write lock, or
by `now` when passed. All processes on one machine share that clock; do not put
the file on a network file system shared by several hosts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from .. import _common, _instrument, cursor_check
from ..cursors import Cursor, parse_cursor
from ..driver.runtime_api import Leader, runtime
from ..errors import (
    InvalidCursorError,
    LeaseExpiredError,
    LeaseLostError,
    PayloadConflictError,
    PgleaseError,
    ResourceLeasedError,
    StaleResourceError,
    UnknownResourceError,
)
from ..ids import resource_id as make_resource_id
from ..types import Claim, Event, MutationResult, Owner, Permit, ResourceState
from ..validation import check_resource_id, check_resource_type
from ._db import (
    DEFAULT_BUSY_TIMEOUT,
    CallerError,
    Database,
    check_busy_timeout,
    check_path,
    clock_us,
    file_error,
    from_us,
    opt_from_us,
    ttl_us,
)

T = TypeVar("T")
Apply = Callable[[sqlite3.Connection], T]

_RESOURCE_SELECT = (
    "SELECT r.id, r.type, r.key, r.revision, r.created_at, r.updated_at, l.generation,"
    " l.owner_type, l.owner_id, l.acquired_at, l.heartbeat_at, l.expires_at,"
    " (l.owner_id IS NOT NULL AND l.expires_at > ?)"
    " FROM resources r JOIN leases l ON l.resource_id = r.id"
)
# xid is always 0 on SQLite: ids are commit-ordered on their own (see the schema).
_EVENT_SELECT = (
    "SELECT e.id, 0, e.resource_id, r.type, r.key, e.revision, e.type, e.actor_type,"
    " e.actor_id, e.lease_generation, e.lease_expires_at, p.body, e.payload_sha256,"
    " e.created_at FROM events e JOIN resources r ON r.id = e.resource_id"
    " LEFT JOIN payloads p ON p.sha256 = e.payload_sha256"
)
# sqlite3 authorizer action code for BEGIN/COMMIT/ROLLBACK statements.
_SQLITE_TRANSACTION = 22


def _parse_resource(row: Sequence[Any]) -> ResourceState:
    r = list(row)
    r[4], r[5] = from_us(r[4]), from_us(r[5])
    r[9], r[10], r[11] = opt_from_us(r[9]), opt_from_us(r[10]), opt_from_us(r[11])
    return _common.parse_resource(r)


def _parse_event(row: Sequence[Any]) -> Event:
    r = list(row)
    r[10], r[13] = opt_from_us(r[10]), from_us(r[13])
    return _common.parse_event(r)


if TYPE_CHECKING:
    from .._watch_common import HubTuning
    from ..clock import Clock
    from ..runtime import Election, HeldLease
    from .runtime import SqliteRuntime
    from .watch import SqliteWatcher


@dataclass(frozen=True, slots=True)
class _Lease:
    """A lease row and its resource's revision, read under the write lock."""

    resource_id: str
    generation: int
    owner_type: str | None
    owner_id: str | None
    token_sha256: bytes | None
    expires_at: int | None
    revision: int

    def live(self, now: int) -> bool:
        return self.owner_id is not None and self.expires_at is not None and self.expires_at > now


def _lock_lease(conn: sqlite3.Connection, rid: str) -> _Lease:
    row = conn.execute(
        "SELECT l.generation, l.owner_type, l.owner_id, l.token_sha256, l.expires_at,"
        " r.revision FROM leases l JOIN resources r ON r.id = l.resource_id"
        " WHERE l.resource_id = ?",
        (rid,),
    ).fetchone()
    if row is None:
        raise UnknownResourceError(f"unknown resource {rid}")
    return _Lease(rid, *row)


def _check_revision(lease: _Lease, expected: int | None) -> None:
    if expected is not None and lease.revision != expected:
        raise StaleResourceError(
            f"resource {lease.resource_id} is at revision {lease.revision}, expected {expected}",
            expected=expected,
            actual=lease.revision,
        )


def _check_current(
    lease: _Lease, owner_type: str, owner_id: str, generation: int, token_sha256: bytes
) -> None:
    if (
        lease.owner_id is None
        or lease.token_sha256 is None
        or lease.owner_type != owner_type
        or lease.owner_id != owner_id
        or lease.generation != generation
        or not hmac.compare_digest(lease.token_sha256, token_sha256)
    ):
        raise LeaseLostError(
            f"lease generation {generation} of {owner_type}:{owner_id} on {lease.resource_id}"
            f" is no longer current (current generation {lease.generation})"
        )


def _check_unexpired(lease: _Lease, now: int) -> None:
    if lease.expires_at is not None and lease.expires_at <= now:
        raise LeaseExpiredError(
            f"lease generation {lease.generation} on {lease.resource_id} expired at"
            f" {from_us(lease.expires_at).isoformat()}"
        )


def _bump(
    conn: sqlite3.Connection,
    rid: str,
    now: int,
    event_type: str,
    actor_type: str | None,
    actor_id: str | None,
    generation: int | None,
    expires_at: int | None,
    payload_sha256: bytes | None,
) -> tuple[int, int]:
    """Raise the revision by one and append its event; return (revision, event id)."""
    row = conn.execute(
        "UPDATE resources SET revision = revision + 1, updated_at = ? WHERE id = ?"
        " RETURNING revision",
        (now, rid),
    ).fetchone()
    assert row is not None
    cur = conn.execute(
        "INSERT INTO events (resource_id, revision, type, actor_type, actor_id,"
        " lease_generation, lease_expires_at, payload_sha256, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            rid,
            row[0],
            event_type,
            actor_type,
            actor_id,
            generation,
            expires_at,
            payload_sha256,
            now,
        ),
    )
    assert cur.lastrowid is not None
    return int(row[0]), cur.lastrowid


def claim_locked(
    conn: sqlite3.Connection,
    lease: _Lease,
    otype: str,
    oid: str,
    token_sha: bytes,
    ttl_s: float,
    t: int,
) -> tuple[int, int, int] | None:
    """Under the write lock, at store time `t`: take `lease` unless it is live.

    Returns (generation, expires_at, revision) of the new claim, or None.
    """
    rid = lease.resource_id
    if lease.live(t):
        return None
    if lease.owner_id is not None:
        # A holder still recorded ran out without a release: record that
        # generation's expiry first, as the PostgreSQL claim does (sql/0007)
        # so both backends give watchers the same history. SQLite has no
        # reaper, so no earlier `lease.expired` for it can exist.
        _bump(
            conn,
            rid,
            t,
            "lease.expired",
            lease.owner_type,
            lease.owner_id,
            lease.generation,
            lease.expires_at,
            None,
        )
    generation = lease.generation + 1
    expires = t + ttl_us(ttl_s)
    conn.execute(
        "UPDATE leases SET generation = ?, owner_type = ?, owner_id = ?,"
        " token_sha256 = ?, acquired_at = ?, heartbeat_at = ?, expires_at = ?"
        " WHERE resource_id = ?",
        (generation, otype, oid, token_sha, t, t, expires, rid),
    )
    revision, _ = _bump(conn, rid, t, "lease.claimed", otype, oid, generation, expires, None)
    return generation, expires, revision


def _store_payload(conn: sqlite3.Connection, body: str, now: int) -> bytes:
    sha = hashlib.sha256(body.encode("utf-8")).digest()
    cur = conn.execute(
        "INSERT INTO payloads (sha256, body, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        (sha, body, now),
    )
    if cur.rowcount == 0:
        row = conn.execute("SELECT body FROM payloads WHERE sha256 = ?", (sha,)).fetchone()
        if row is None or row[0] != body:
            raise PayloadConflictError(f"payload {sha.hex()} is stored with different bytes")
    return sha


class SqliteStore:
    """Leases, revisions and the event log in one SQLite file (WAL mode).

    Any number of threads and processes on one host may open the same file.
    Every write is one ``BEGIN IMMEDIATE ... COMMIT`` transaction; readers never
    block writers. Close the store (or use it as a context manager) when done.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        auto_migrate: bool = True,
    ) -> None:
        self.path = check_path(path)
        self.busy_timeout = check_busy_timeout(busy_timeout)
        self._db = Database(self.path, self.busy_timeout)
        self._runtime: SqliteRuntime | None = None
        try:
            self._db.open()
            if auto_migrate:
                self.migrate()
        except BaseException:
            self._db.close()
            raise

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every pooled connection; connections in use close when returned."""
        self._db.close()

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """Borrow an autocommit connection to the store's file.

        Errors of the SQL run on it are sqlite3's (the caller's own statements);
        a file that cannot be opened raises `SqliteFileError`, a closed store
        `StoreClosedError`.
        """
        with self._db.raw_connection() as conn:
            yield conn

    def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""
        return [f"{m.version:04d}_{m.name}" for m in self._db.migrate()]

    def ensure_resource(self, resource_type: str, key: str) -> str:
        """Create the resource if needed and return its deterministic id (no event)."""
        rtype, key = _common.ensure_args(resource_type, key)
        rid = make_resource_id(rtype, key)
        with self._db.connection() as conn:
            # Most calls find the resource: answer them without taking the write lock.
            if conn.execute("SELECT 1 FROM resources WHERE id = ?", (rid,)).fetchone():
                return rid
        with self._db.write() as conn:
            now = clock_us(None)
            cur = conn.execute(
                "INSERT INTO resources (id, type, key, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (rid, rtype, key, now, now),
            )
            if cur.rowcount:
                conn.execute("INSERT INTO leases (resource_id) VALUES (?)", (rid,))
        return rid

    def claim(
        self,
        resource_id: str,
        owner: Owner,
        ttl: float,
        expected_revision: int | None = None,
        *,
        now: datetime | None = None,
    ) -> Claim | None:
        """Take the lease, or return None while another holder's lease is unexpired."""
        token, args = _common.claim_args(resource_id, owner, ttl, expected_revision, now)
        try:
            claim = self._claim(owner, token, args)
        except PgleaseError as exc:
            _instrument.recorder.claim(_instrument.claim_error(exc))
            raise
        _instrument.recorder.claim("held" if claim is None else "claimed")
        return claim

    def _claim(self, owner: Owner, token: str, args: Sequence[Any]) -> Claim | None:
        rid, otype, oid, token_sha, ttl_s, expected, given_now = args
        with self._db.write() as conn:
            lease = _lock_lease(conn, rid)
            _check_revision(lease, expected)
            # Judge expiry after the lock wait.
            t = clock_us(given_now)
            taken = claim_locked(conn, lease, otype, oid, token_sha, ttl_s, t)
        if taken is None:
            return None
        generation, expires, revision = taken
        return Claim(rid, owner, token, generation, from_us(expires), revision)

    def renew(
        self,
        claim: Claim,
        ttl: float,
        expected_revision: int | None = None,
        *,
        now: datetime | None = None,
    ) -> Claim:
        """Extend a current, unexpired lease; return the updated claim."""
        args = _common.renew_args(claim, ttl, expected_revision, now)
        try:
            renewed = self._renew(claim, args)
        except PgleaseError as exc:
            _instrument.recorder.renewal("store", _instrument.lease_error(exc))
            raise
        _instrument.recorder.renewal("store", "renewed")
        return renewed

    def _renew(self, claim: Claim, args: Sequence[Any]) -> Claim:
        rid, otype, oid, generation, token_sha, ttl_s, expected, given_now = args
        with self._db.write() as conn:
            lease = _lock_lease(conn, rid)
            _check_current(lease, otype, oid, generation, token_sha)
            _check_revision(lease, expected)
            t = clock_us(given_now)
            _check_unexpired(lease, t)
            expires = t + ttl_us(ttl_s)
            conn.execute(
                "UPDATE leases SET heartbeat_at = ?, expires_at = ? WHERE resource_id = ?",
                (t, expires, rid),
            )
            revision, _ = _bump(
                conn, rid, t, "lease.renewed", otype, oid, generation, expires, None
            )
        return replace(claim, expires_at=from_us(expires), revision=revision)

    def release(
        self, claim: Claim, expected_revision: int | None = None, *, now: datetime | None = None
    ) -> int:
        """Give up a current lease (expired or not); return the new revision."""
        args = _common.release_args(claim, expected_revision, now)
        try:
            revision = self._release(args)
        except PgleaseError as exc:
            _instrument.recorder.release(_instrument.lease_error(exc))
            raise
        _instrument.recorder.release("released")
        return revision

    def _release(self, args: Sequence[Any]) -> int:
        rid, otype, oid, generation, token_sha, expected, given_now = args
        with self._db.write() as conn:
            lease = _lock_lease(conn, rid)
            _check_current(lease, otype, oid, generation, token_sha)
            _check_revision(lease, expected)
            t = clock_us(given_now)
            # The generation stays: the next claim continues from it.
            conn.execute(
                "UPDATE leases SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL,"
                " expires_at = NULL, heartbeat_at = ? WHERE resource_id = ?",
                (t, rid),
            )
            revision, _ = _bump(conn, rid, t, "lease.released", otype, oid, generation, None, None)
        return revision

    def mutate(
        self,
        permit: Permit,
        event_type: str,
        apply: Apply[T] | None = None,
        payload: Any = None,
        *,
        actor: Owner | None = None,
        now: datetime | None = None,
    ) -> MutationResult:
        """Check the permit, run `apply(conn)` and append the event, all in one transaction.

        `apply` gets the `sqlite3.Connection` inside the write transaction; it must
        not commit or roll back (such statements are refused). Any exception (a
        stale permit, a lost lease, or one raised by `apply`) rolls everything
        back: no revision bump, no event, no payload. What `apply` raises
        propagates unchanged, its SQL's own errors too (an IntegrityError, a
        refused COMMIT); only trouble with the file itself (busy past
        busy_timeout, I/O, disk full, corruption) becomes a `SqliteFileError`,
        as for pglease's own statements.
        """
        args = _common.mutate_args(permit, event_type, payload, actor, now)
        (rid, expected, etype, otype, oid, generation, token_sha, atype, aid, body, given_now) = (
            args
        )
        try:
            with self._db.write() as conn:
                lease = _lock_lease(conn, rid)
                t = clock_us(given_now)
                if token_sha is not None:
                    _check_current(lease, otype, oid, generation, token_sha)
                    _check_revision(lease, expected)
                    _check_unexpired(lease, t)
                    atype, aid = otype, oid
                else:
                    _check_revision(lease, expected)
                    if lease.live(t):
                        assert lease.expires_at is not None
                        raise ResourceLeasedError(
                            f"resource {rid} is leased by {lease.owner_type}:{lease.owner_id}"
                            f" (generation {lease.generation}) until"
                            f" {from_us(lease.expires_at).isoformat()};"
                            " unleased writes are refused"
                        )
                sha = _store_payload(conn, body, t) if body is not None else None
                revision, event_id = _bump(
                    conn,
                    rid,
                    t,
                    etype,
                    atype,
                    aid,
                    generation if token_sha is not None else None,
                    None,
                    sha,
                )
                value = _run_apply(conn, apply) if apply is not None else None
        except CallerError as wrapped:
            error = wrapped.error
        else:
            return MutationResult(rid, revision, event_id, value)
        # Raised outside the except block: the caller's error keeps its own context.
        raise error

    def get(self, resource_id: str, *, now: datetime | None = None) -> ResourceState:
        """The resource with its lease state, judged by the host clock (or `now`)."""
        check_resource_id(resource_id)
        t = clock_us(_common.check_now(now))
        with self._db.connection() as conn:
            row = conn.execute(_RESOURCE_SELECT + " WHERE r.id = ?", (t, resource_id)).fetchone()
        if row is None:
            raise UnknownResourceError(f"unknown resource {resource_id}")
        return _parse_resource(row)

    def list_resources(
        self, resource_type: str | None = None, *, now: datetime | None = None
    ) -> list[ResourceState]:
        """All resources (or those of one type), ordered by type and key."""
        t = clock_us(_common.check_now(now))
        with self._db.connection() as conn:
            if resource_type is None:
                rows = conn.execute(_RESOURCE_SELECT + " ORDER BY r.type, r.key", (t,)).fetchall()
            else:
                check_resource_type(resource_type)
                rows = conn.execute(
                    _RESOURCE_SELECT + " WHERE r.type = ? ORDER BY r.key", (t, resource_type)
                ).fetchall()
        return [_parse_resource(r) for r in rows]

    def events(self, resource_id: str, after_revision: int = 0, limit: int = 1000) -> list[Event]:
        """A resource's events in revision order, after `after_revision`."""
        rid, after, lim = _common.events_of_args(resource_id, after_revision, limit)
        with self._db.connection() as conn:
            rows = conn.execute(
                _EVENT_SELECT + " WHERE e.resource_id = ? AND e.revision > ?"
                " ORDER BY e.revision LIMIT ?",
                (rid, after, lim),
            ).fetchall()
            if (
                not rows
                and not conn.execute("SELECT 1 FROM resources WHERE id = ?", (rid,)).fetchone()
            ):
                raise UnknownResourceError(f"unknown resource {rid}")
        return [_parse_event(r) for r in rows]

    def events_after(self, cursor: str | None = None, limit: int = 1000) -> list[Event]:
        """Committed events after `cursor` (None or "start": from the beginning).

        Pass the last event's `cursor` to get the next page; no event is ever
        skipped or repeated. SQLite cursors are ``0.<event id>``: one writer at a
        time makes event ids commit-ordered, so the id alone is the position.
        """
        parsed = self._parse_cursor(cursor)
        lim = _common.check_limit(limit)
        with self._db.connection() as conn:
            cursor_check.sqlite_verify(conn, parsed, refuse_expired=True)
            return self._read_after(conn, parsed.position.event_id, lim)

    @staticmethod
    def _parse_cursor(cursor: str | None) -> Cursor:
        parsed = parse_cursor(cursor)
        if parsed.position.xid != 0:
            raise InvalidCursorError(f"cursor {cursor!r} was not produced by a SQLite store")
        return parsed

    def _check_cursor(self, cursor: str) -> None:
        """Refuse a cursor that is not a position in this file's log (a watcher's
        resume; `events_after` checks every call)."""
        parsed = self._parse_cursor(cursor)
        with self._db.connection() as conn:
            cursor_check.sqlite_verify(conn, parsed, refuse_expired=True)

    def _now_cursor(self) -> str:
        """The cursor after the last event (a watcher's "now")."""
        with self._db.connection() as conn:
            return cursor_check.sqlite_now(conn)

    def _events_after_id(self, event_id: int, limit: int) -> list[Event]:
        """The events after `event_id`, unchecked: a watcher's polls after its
        cursor was checked once."""
        with self._db.connection() as conn:
            return self._read_after(conn, event_id, limit)

    @staticmethod
    def _read_after(conn: sqlite3.Connection, event_id: int, limit: int) -> list[Event]:
        rows = conn.execute(
            _EVENT_SELECT + " WHERE e.id > ? ORDER BY e.id LIMIT ?", (event_id, limit)
        ).fetchall()
        return [_parse_event(r) for r in rows]

    # --- fleet runtime (see pglease.runtime) -------------------------------------------

    def runtime_driver(self) -> SqliteRuntime:
        """The runtime driver (`pglease.driver`) that hold, acquire and elect use."""
        if self._runtime is None:
            from .runtime import SqliteRuntime

            self._runtime = SqliteRuntime(self)
        return self._runtime

    def hold(
        self, resource_type: str, key: str, owner: Owner, ttl: float, **options: Any
    ) -> AbstractContextManager[HeldLease]:
        """Hold a lease for a block, renewed by the store's keeper thread: ``with
        store.hold(type, key, owner, ttl) as lease:``; see `pglease.runtime.hold`."""
        return runtime().hold(self, resource_type, key, owner, ttl, **options)

    def acquire(
        self,
        resource_type: str,
        key: str,
        owner: Owner,
        ttl: float,
        timeout: float | None = None,
        **options: Any,
    ) -> Claim:
        """Wait for the lease and claim it (``fair=True``: in arrival order, across
        processes); see `pglease.runtime.acquire`."""
        return runtime().acquire(self, resource_type, key, owner, ttl, timeout, **options)

    def elect(self, name: str, candidate: Owner, **options: Any) -> Election:
        """Campaign for leadership of `name` (a running `pglease.runtime.Election`);
        see `pglease.runtime.elect`."""
        election: Election = runtime().elect(self, name, candidate, **options)
        return election

    def leader(self, name: str) -> Leader | None:
        """The current leader of election `name` and its generation, if any."""
        return runtime().leader(self, name)

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
    ) -> SqliteWatcher:
        """Stream committed events from `after` (a cursor, "now" or "start") by polling
        the event table every `interval` seconds (50 ms default).

        The arguments are `PostgresStore.watch`'s: `mode` None or "poll" (SQLite
        has no LISTEN: "listen" is refused), at most `max_pending` events read
        and not handed out (a watcher further behind reads the rest later,
        nothing is lost), `tuning` accepted and unused (no hub). See
        `pglease.sqlite.watch`."""
        from .watch import SqliteWatcher

        return SqliteWatcher(
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


def _refuse_transaction_control(action: int, *_args: str | None) -> int:
    return sqlite3.SQLITE_DENY if action == _SQLITE_TRANSACTION else sqlite3.SQLITE_OK


def _run_apply(conn: sqlite3.Connection, apply: Callable[[sqlite3.Connection], T]) -> T:
    """Run the writer's own SQL; a COMMIT or ROLLBACK from it would split the
    transaction from its event, so the authorizer refuses those statements."""
    conn.set_authorizer(_refuse_transaction_control)
    try:
        return apply(conn)
    except sqlite3.Error as exc:
        if file_error(exc):
            raise  # about the file, not the caller's SQL: mapped like pglease's own
        raise CallerError(exc) from None
    finally:
        conn.set_authorizer(None)
