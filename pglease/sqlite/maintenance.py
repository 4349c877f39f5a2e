"""Log maintenance (`pglease.driver.maintenance`) on one SQLite file.

Reap: the same rules as `reap_next` on PostgreSQL (sql/functions/20_watch.sql).
Candidates are found by a plain read (an idle reaper never takes the write
lock) of the ``leases_to_reap`` index, in expiry order after the last one
visited; each is then re-judged
and reaped in its own ``BEGIN IMMEDIATE`` transaction by `record_expiry`, the
function a takeover uses too, so the expiry marker keeps a generation from
ever getting two `lease.expired` events.

Prune: the rules of ``prune_chunk`` (sql/functions/20_watch.sql). The cutoff
is read once by the store clock, so a prune ends while events keep arriving;
each chunk is one write transaction that deletes at most `chunk` events, a
prefix of the log in id order (ids are commit-ordered, so every committed
event is readable and there is no frontier to wait for), raises the horizon
to the last deleted id and deletes the payloads of those events that no
remaining event references. A writer reusing a payload holds the write lock
while it does, so it can never lose its payload between two statements.
A chunk holds the file's write lock, so it is kept short.
"""

from __future__ import annotations

from ..driver.maintenance import (
    PruneReport,
    PruneRequest,
    ReapReport,
    ReapRequest,
    ttl_refusal,
)
from ..errors import ValidationError
from ._db import Database, clock_us
from ._ops import expiry_unrecorded, lock_lease, record_expiry

# The predicate repeats the partial index's (migration 0003), so SQLite uses
# it; candidates come in expiry order after the last one visited.
_CANDIDATE = (
    "SELECT resource_id, expires_at FROM leases"
    " WHERE owner_id IS NOT NULL AND expired_generation IS NOT generation"
    " AND expires_at <= ? AND (expires_at, resource_id) > (?, ?)"
    " ORDER BY expires_at, resource_id LIMIT 1"
)


def reap(db: Database, request: ReapRequest) -> ReapReport:
    """Reap up to `request.limit` leases, one write transaction each."""
    reaped: list[str] = []
    after: tuple[int, str] = (-(2**63), "")
    for _ in range(request.limit):
        with db.connection() as conn:
            row = conn.execute(_CANDIDATE, (clock_us(None), *after)).fetchone()
        if row is None:
            break
        rid = row[0]
        after = (row[1], rid)
        with db.write() as conn:
            lease = lock_lease(conn, rid)
            t = clock_us(None)  # after the lock wait, as a claim judges expiry
            # Re-judged under the write lock: renewed, released or taken over meanwhile?
            if not expiry_unrecorded(lease, t):
                continue
            record_expiry(conn, lease, t)
        reaped.append(rid)
    return ReapReport(tuple(reaped))


def _prune_chunk(db: Database, cutoff: int, limit: int) -> tuple[int, int, bool]:
    """One chunk: (events deleted, payloads deleted, done)."""
    with db.write() as conn:
        (pruned_id,) = conn.execute("SELECT pruned_id FROM event_horizon").fetchone()
        head = conn.execute(
            "SELECT id, created_at, payload_sha256 FROM events WHERE id > ? ORDER BY id LIMIT ?",
            (pruned_id, limit),
        ).fetchall()
        run = 0
        for _id, created_at, _sha in head:
            if created_at >= cutoff:
                break  # the first keeper ends the prefix
            run += 1
        if run == 0:
            return 0, 0, True
        last = head[run - 1][0]
        conn.execute("DELETE FROM events WHERE id > ? AND id <= ?", (pruned_id, last))
        conn.execute(
            "UPDATE event_horizon SET pruned_id = ?, pruned_at = ?", (last, clock_us(None))
        )
        shas = {sha for _i, _c, sha in head[:run] if sha is not None}
        payloads = 0
        for sha in shas:
            cur = conn.execute(
                "DELETE FROM payloads WHERE sha256 = ?"
                " AND NOT EXISTS (SELECT 1 FROM events WHERE payload_sha256 = ?)",
                (sha, sha),
            )
            payloads += cur.rowcount
    # A full run may be followed by more; anything shorter met a keeper or the end.
    return run, payloads, run < limit


def prune(db: Database, request: PruneRequest) -> PruneReport:
    """Prune in chunks, each its own write transaction; chunks committed before
    an error stay done."""
    if request.respect_ttl:
        with db.connection() as conn:
            (longest_us,) = conn.execute(
                "SELECT max(expires_at - coalesce(heartbeat_at, acquired_at)) FROM leases"
                " WHERE owner_id IS NOT NULL AND expires_at > ?",
                (clock_us(None),),
            ).fetchone()
        refusal = ttl_refusal(request.older_than, None if longest_us is None else longest_us / 1e6)
        if refusal is not None:
            raise ValidationError(refusal)
    cutoff = clock_us(None) - round(request.older_than * 1_000_000)
    events = payloads = 0
    done = False
    while not done:
        n, p, done = _prune_chunk(db, cutoff, request.chunk)
        events += n
        payloads += p
    return PruneReport(events, payloads)
