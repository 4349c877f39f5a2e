"""The SQLite store's operations: plain blocking sqlite3 functions, one per
store-driver operation (`pglease.driver.ops`), each on an open `Database`.

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

The drivers (`_driver_async` and its generated twin) call these directly
(blocking) or in a worker thread (asyncio).
"""

from __future__ import annotations

import hashlib
import hmac
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .. import _common, cursor_check
from ..cursors import Cursor, parse_cursor
from ..driver import ops
from ..errors import (
    InvalidCursorError,
    LeaseExpiredError,
    LeaseLostError,
    PayloadConflictError,
    ResourceLeasedError,
    StaleResourceError,
    UnknownResourceError,
)
from ..ids import resource_id as make_resource_id
from ..types import Claim, Event, MutationResult, ResourceState
from ._db import CallerError, Database, clock_us, file_error, from_us, opt_from_us, ttl_us

T = TypeVar("T")

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
    #: The generation whose `lease.expired` is recorded (migration 0003).
    expired_generation: int | None

    def live(self, now: int) -> bool:
        return self.owner_id is not None and self.expires_at is not None and self.expires_at > now


def lock_lease(conn: sqlite3.Connection, rid: str) -> _Lease:
    row = conn.execute(
        "SELECT l.generation, l.owner_type, l.owner_id, l.token_sha256, l.expires_at,"
        " r.revision, l.expired_generation FROM leases l JOIN resources r"
        " ON r.id = l.resource_id"
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
        # Same wording as _check_current in sql/functions/10_core.sql.
        if lease.generation > generation:
            why = f"superseded by generation {lease.generation}"
        elif lease.generation < generation:
            why = f"there is no such generation yet (current generation {lease.generation})"
        elif lease.owner_id is None:
            why = "it was released"
        elif lease.owner_type != owner_type or lease.owner_id != owner_id:
            why = f"the owner does not match (it is held by {lease.owner_type}:{lease.owner_id})"
        else:
            why = "the token does not match the holder's"
        raise LeaseLostError(
            f"lease generation {generation} of {owner_type}:{owner_id} on {lease.resource_id}"
            f" is no longer current: {why}"
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


def expiry_unrecorded(lease: _Lease, now: int) -> bool:
    """A holder is still recorded, its ttl ran out at `now`, and that
    generation has no `lease.expired` event yet."""
    return (
        lease.owner_id is not None
        and not lease.live(now)
        and lease.expired_generation != lease.generation
    )


def record_expiry(conn: sqlite3.Connection, lease: _Lease, now: int) -> int:
    """Under the write lock: write `lease`'s `lease.expired` event (revision +1,
    the generation kept) and mark the generation; return the new revision.
    The reaper and a takeover both come through here, so the marker is the one
    place that decides whether a generation's expiry is already recorded."""
    rid = lease.resource_id
    conn.execute(
        "UPDATE leases SET expired_generation = ? WHERE resource_id = ?", (lease.generation, rid)
    )
    revision, _ = _bump(
        conn, rid, now, "lease.expired", lease.owner_type, lease.owner_id, lease.generation,
        lease.expires_at, None,
    )  # fmt: skip
    return revision


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
    if expiry_unrecorded(lease, t):
        # A holder still recorded ran out without a release: record that
        # generation's expiry first, as the PostgreSQL claim does (sql/0007),
        # unless the reaper already did (the marker), so both backends give
        # watchers the same history.
        record_expiry(conn, lease, t)
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


def open_database(path: str, busy_timeout: float, auto_migrate: bool) -> Database:
    """An open `Database` (first connection made, migrated if asked); closed again
    when that fails."""
    db = Database(path, busy_timeout)
    try:
        db.open()
        if auto_migrate:
            db.migrate()
    except BaseException:
        db.close()
        raise
    return db


def migrate(db: Database) -> list[str]:
    return [f"{m.version:04d}_{m.name}" for m in db.migrate()]


def ensure_resource(db: Database, op: ops.EnsureOp) -> str:
    rtype, key = op.resource_type, op.key
    rid = make_resource_id(rtype, key)
    with db.connection() as conn:
        # Most calls find the resource: answer them without taking the write lock.
        if conn.execute("SELECT 1 FROM resources WHERE id = ?", (rid,)).fetchone():
            return rid
    with db.write() as conn:
        now = clock_us(None)
        cur = conn.execute(
            "INSERT INTO resources (id, type, key, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (rid, rtype, key, now, now),
        )
        if cur.rowcount:
            conn.execute("INSERT INTO leases (resource_id) VALUES (?)", (rid,))
    return rid


def claim(db: Database, op: ops.ClaimOp) -> Claim | None:
    rid, owner = op.resource_id, op.owner
    with db.write() as conn:
        lease = lock_lease(conn, rid)
        _check_revision(lease, op.expected_revision)
        # Judge expiry after the lock wait.
        t = clock_us(op.now)
        taken = claim_locked(conn, lease, owner.type, owner.id, op.token_sha256, op.ttl, t)
    if taken is None:
        return None
    generation, expires, revision = taken
    return Claim(rid, owner, op.token, generation, from_us(expires), revision, op.trusted_until)


def _lock_current(
    conn: sqlite3.Connection, claim: Claim, token_sha256: bytes, expected: int | None
) -> _Lease:
    """The lease `claim` names, locked, checked to be its holder's and at `expected`."""
    lease = lock_lease(conn, claim.resource_id)
    _check_current(lease, claim.owner.type, claim.owner.id, claim.generation, token_sha256)
    _check_revision(lease, expected)
    return lease


def renew(db: Database, op: ops.RenewOp) -> Claim:
    c = op.claim
    with db.write() as conn:
        lease = _lock_current(conn, c, op.token_sha256, op.expected_revision)
        t = clock_us(op.now)
        _check_unexpired(lease, t)
        expires = t + ttl_us(op.ttl)
        conn.execute(
            "UPDATE leases SET heartbeat_at = ?, expires_at = ? WHERE resource_id = ?",
            (t, expires, c.resource_id),
        )
        revision, _ = _bump(
            conn, c.resource_id, t, "lease.renewed", c.owner.type, c.owner.id, c.generation,
            expires, None,
        )  # fmt: skip
    return replace(
        c, expires_at=from_us(expires), revision=revision, trusted_until=op.trusted_until
    )


def release(db: Database, op: ops.ReleaseOp) -> int:
    c = op.claim
    with db.write() as conn:
        _lock_current(conn, c, op.token_sha256, op.expected_revision)
        t = clock_us(op.now)
        # The generation stays: the next claim continues from it.
        conn.execute(
            "UPDATE leases SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL,"
            " expires_at = NULL, heartbeat_at = ? WHERE resource_id = ?",
            (t, c.resource_id),
        )
        revision, _ = _bump(
            conn, c.resource_id, t, "lease.released", c.owner.type, c.owner.id, c.generation,
            None, None,
        )  # fmt: skip
    return revision


# The batches: one write transaction each, the items in resource-id order (as
# the PostgreSQL functions do them, so both backends write the same history).
# An item's failure (held, not current, expired) is found before it writes,
# so it leaves nothing to undo and the other items go on; an unknown resource
# raises and rolls the whole batch back.
def _id_order(rids: Sequence[str]) -> list[int]:
    return sorted(range(len(rids)), key=lambda i: rids[i].encode())


def claim_many(db: Database, op: ops.ClaimManyOp) -> list[Claim | None]:
    owner, rids = op.owner, op.resource_ids
    out: list[Claim | None] = [None] * len(rids)
    with db.write() as conn:
        for i in _id_order(rids):
            lease = lock_lease(conn, rids[i])
            t = clock_us(op.now)
            taken = claim_locked(conn, lease, owner.type, owner.id, op.token_sha256s[i], op.ttl, t)
            if taken is not None:
                generation, expires, revision = taken
                out[i] = Claim(
                    rids[i], owner, op.tokens[i], generation, from_us(expires), revision,
                    op.trusted_until,
                )  # fmt: skip
    return out


def renew_many(db: Database, op: ops.RenewManyOp) -> list[Claim | LeaseLostError]:
    claims = op.claims
    out: list[Claim | LeaseLostError | None] = [None] * len(claims)
    with db.write() as conn:
        for i in _id_order([c.resource_id for c in claims]):
            c = claims[i]
            try:
                lease = _lock_current(conn, c, op.token_sha256s[i], None)
                t = clock_us(op.now)
                _check_unexpired(lease, t)
            except LeaseLostError as exc:
                out[i] = exc
                continue
            expires = t + ttl_us(op.ttl)
            conn.execute(
                "UPDATE leases SET heartbeat_at = ?, expires_at = ? WHERE resource_id = ?",
                (t, expires, c.resource_id),
            )
            revision, _ = _bump(
                conn, c.resource_id, t, "lease.renewed", c.owner.type, c.owner.id, c.generation,
                expires, None,
            )  # fmt: skip
            out[i] = replace(
                c, expires_at=from_us(expires), revision=revision, trusted_until=op.trusted_until
            )
    return [r for r in out if r is not None]


def release_many(db: Database, op: ops.ReleaseManyOp) -> list[int | LeaseLostError]:
    claims = op.claims
    out: list[int | LeaseLostError | None] = [None] * len(claims)
    with db.write() as conn:
        for i in _id_order([c.resource_id for c in claims]):
            c = claims[i]
            try:
                _lock_current(conn, c, op.token_sha256s[i], None)
            except LeaseLostError as exc:
                out[i] = exc
                continue
            t = clock_us(op.now)
            conn.execute(
                "UPDATE leases SET owner_type = NULL, owner_id = NULL, token_sha256 = NULL,"
                " expires_at = NULL, heartbeat_at = ? WHERE resource_id = ?",
                (t, c.resource_id),
            )
            out[i], _ = _bump(
                conn, c.resource_id, t, "lease.released", c.owner.type, c.owner.id, c.generation,
                None, None,
            )  # fmt: skip
    return [r for r in out if r is not None]


def mutate(
    db: Database, op: ops.MutateOp, apply: Callable[[sqlite3.Connection], Any] | None
) -> MutationResult:
    """`SqliteStore.mutate`: `apply` runs inside the write transaction, where
    COMMIT and ROLLBACK are refused; what it raises propagates unchanged (its
    sqlite3 errors too, unless they are about the file itself)."""
    permit, lease_claim = op.permit, op.permit.lease
    rid, expected, token_sha = permit.resource_id, permit.expected_revision, op.lease_token_sha256
    actor = op.actor
    atype, aid = (actor.type, actor.id) if actor is not None else (None, None)
    try:
        with db.write() as conn:
            lease = lock_lease(conn, rid)
            t = clock_us(op.now)
            if lease_claim is not None and token_sha is not None:
                otype, oid = lease_claim.owner.type, lease_claim.owner.id
                _check_current(lease, otype, oid, lease_claim.generation, token_sha)
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
            body = op.payload_text
            sha = _store_payload(conn, body, t) if body is not None else None
            generation = lease_claim.generation if lease_claim is not None else None
            revision, event_id = _bump(
                conn, rid, t, op.event_type, atype, aid, generation, None, sha
            )
            value = _run_apply(conn, apply) if apply is not None else None
    except CallerError as wrapped:
        error = wrapped.error
    else:
        return MutationResult(rid, revision, event_id, value)
    # Raised outside the except block: the caller's error keeps its own context.
    raise error


def get(db: Database, op: ops.GetOp) -> ResourceState:
    t = clock_us(op.now)
    with db.connection() as conn:
        row = conn.execute(_RESOURCE_SELECT + " WHERE r.id = ?", (t, op.resource_id)).fetchone()
    if row is None:
        raise UnknownResourceError(f"unknown resource {op.resource_id}")
    return _parse_resource(row)


def list_resources(db: Database, op: ops.ListOp) -> list[ResourceState]:
    t = clock_us(op.now)
    with db.connection() as conn:
        if op.resource_type is None:
            rows = conn.execute(_RESOURCE_SELECT + " ORDER BY r.type, r.key", (t,)).fetchall()
        else:
            rows = conn.execute(
                _RESOURCE_SELECT + " WHERE r.type = ? ORDER BY r.key", (t, op.resource_type)
            ).fetchall()
    return [_parse_resource(r) for r in rows]


def events(db: Database, op: ops.EventsOp) -> list[Event]:
    rid = op.resource_id
    with db.connection() as conn:
        rows = conn.execute(
            _EVENT_SELECT + " WHERE e.resource_id = ? AND e.revision > ?"
            " ORDER BY e.revision LIMIT ?",
            (rid, op.after_revision, op.limit),
        ).fetchall()
        if not rows and not conn.execute("SELECT 1 FROM resources WHERE id = ?", (rid,)).fetchone():
            raise UnknownResourceError(f"unknown resource {rid}")
    return [_parse_event(r) for r in rows]


def _sqlite_cursor(parsed: Cursor, cursor: str | None) -> Cursor:
    """SQLite cursors are ``0.<event id>``: one writer at a time makes event ids
    commit-ordered, so the id alone is the position."""
    if parsed.position.xid != 0:
        raise InvalidCursorError(f"cursor {cursor!r} was not produced by a SQLite store")
    return parsed


def read_log(db: Database, op: ops.ReadLogOp) -> list[Event]:
    parsed = _sqlite_cursor(op.cursor, op.cursor.text)
    # The check and the page share one snapshot: a prune committing between
    # them could otherwise delete events the check let the page expect.
    with db.connection() as conn, cursor_check.sqlite_snapshot(conn):
        cursor_check.sqlite_verify(conn, parsed, refuse_expired=True)
        return _read_after(conn, parsed.position.event_id, op.limit)


def check_cursor(db: Database, cursor: str) -> None:
    """Refuse a cursor that is not a position in this file's log (a watcher's
    resume; `read_log` checks every call)."""
    parsed = _sqlite_cursor(parse_cursor(cursor), cursor)
    with db.connection() as conn:
        cursor_check.sqlite_verify(conn, parsed, refuse_expired=True)


def now_cursor(db: Database) -> str:
    """The cursor after the last event (a watcher's "now")."""
    with db.connection() as conn:
        return cursor_check.sqlite_now(conn)


def events_after_id(db: Database, event_id: int, limit: int) -> list[Event]:
    """The events after `event_id`: a watcher's polls after its cursor was
    checked once. Only the prune horizon is checked again (one snapshot with
    the page): a watcher that a prune passed gets `CursorExpiredError`."""
    with db.connection() as conn, cursor_check.sqlite_snapshot(conn):
        cursor_check.sqlite_check_horizon(conn, event_id)
        return _read_after(conn, event_id, limit)


def _read_after(conn: sqlite3.Connection, event_id: int, limit: int) -> list[Event]:
    rows = conn.execute(
        _EVENT_SELECT + " WHERE e.id > ? ORDER BY e.id LIMIT ?", (event_id, limit)
    ).fetchall()
    return [_parse_event(r) for r in rows]


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
