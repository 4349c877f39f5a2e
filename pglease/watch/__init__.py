"""Watchers: stream committed events gap-free over LISTEN/NOTIFY, with a poll fallback.

Usage::

    with Watcher(store, after=saved_cursor, types="run") as w:
        for event in w:
            handle(event)
            save(event.cursor)          # restart with after=saved_cursor later

    async with AsyncWatcher(astore, after="now") as w:
        async for event in w: ...

The event table is the truth; NOTIFY is only a wake-up hint.

Reading rule (gap-free, no duplicate)
    Readers take events in ``(xid, id)`` order, and only those with
    ``xid < pg_snapshot_xmin(snapshot)``: every transaction below xmin has
    finished, and every later transaction gets a larger xid, so the events
    below xmin are a fixed prefix of the final order. A cursor is a position in
    that order; "after cursor" can never skip an event committed late (out of
    id order). Per resource, revision order agrees with that order because
    revisions are bumped under the lease row lock; `_bump` refuses (40001) the
    one case where it would not (a transaction that took its xid before the
    lock).

One reader per process
    A `hub.Hub` per (dsn, schema, mode) owns one dedicated autocommit
    connection (LISTEN in listen mode, never a pooled one), keeps a tip
    position and reads after it; every `Watcher`/`AsyncWatcher` of the process
    subscribes to it. A watcher resuming from an older cursor first catches up
    with its own reads up to the position at which it joined the hub stream,
    then drops from the stream whatever it already has. After a reconnect
    (including a server restart) the hub re-LISTENs and reads from its tip.

Coalesced NOTIFY (the hot-path cost)
    NOTIFY takes a cluster-wide lock from pre-commit to the end of commit; one
    NOTIFY per operation halves claim/release throughput. In `_bump` every
    writer first takes K2 in shared mode (``pg_try_advisory_xact_lock_shared``,
    held to its commit: "a writer is in flight"), then notifies only if it
    wins ``pg_try_advisory_xact_lock(K1)``, so at most one in-flight writer
    notifies; the losers ("skippers") rely on it. Nobody ever waits for either
    lock. If even K2 is not free (a watcher probe holds it for an instant) the
    writer notifies itself. (Migration 0006; 0002 took K2 only after losing
    K1, which left a tiny window open.)

Reads under load
    A read costs the server about as much as a write, and each batch costs
    every subscriber a wake-up, so the hub does not read once per NOTIFY when
    busy. It keeps a smoothed event rate (events per read over time between
    reads); above 1,500 events/s the next read starts some time after the
    previous one: 8 ms, or 0.25 ms per consumer a batch wakes when that is
    more (25 ms at most), scaled down linearly below 3,000 events/s. That
    bounds the reads and wake-ups per second and the latency added. Below
    1,500 events/s every NOTIFY is read at once (a fair-queue handoff, for
    one, waits on it). Above 3,000 events/s the hub also UNLISTENs, since its
    spaced reads find every event anyway while each NOTIFY still interrupts
    its server process; below 1,500 it LISTENs again, then reads.

    The hub reaches PostgreSQL only through the listen protocol
    (`pglease.driver.listen`); its listener (`pglease/postgres/_listen.py`)
    reads with a libpq prepared statement on the hub's own connection, its
    rows loaded by psycopg's C loaders. A NOTIFY that arrives with a read's
    result stays in libpq's buffer, which a wait on the socket would not see:
    the listener takes it out after every read, and the hub's next wait
    returns at once, so the hub reads again instead of waiting. Async
    watchers of one event loop share one hub subscription (one cross-thread
    call per batch); blocked sync watchers are woken in a chain, each waking
    the next, instead of all fighting for the GIL at once
    (`mailbox.WakeChain`).

Slow consumers
    The hub never waits for a watcher. Each watcher has a mailbox bounded by
    ``max_pending`` queued events (10,000 by default); past it the mailbox
    drops further batches, keeping only the last tip, and queues a marker. The
    watcher, reaching the marker, reads the dropped span from the log with its
    own queries (as it does when resuming from a cursor) and then takes the
    stream again after that tip. Memory stays bounded, nothing is lost or
    repeated, and only the slow watcher pays for the extra reads.

Why no event is stranded
    Each read (`watch_read`) first probes K2 (try-exclusive and release at
    once: it fails while any writer that took K2 is in flight), then takes its
    snapshot. The read is "held back" when the probe failed or the snapshot
    had a transaction in progress (``xmin <> xmax``). While held back the hub
    re-polls after 1 ms (doubling up to 50 ms while nothing changes);
    otherwise it waits for a NOTIFY or the fallback interval (1 s default).

    Take an event E of transaction X. (1) A read whose probe runs after X took
    K2 is held back until E has been read: while X is in flight the probe
    fails; once X has committed (before the probe, so before the snapshot),
    the snapshot either shows E readable or has an older transaction still in
    progress below its xmax. Every re-poll is such a read, so once one
    happens, re-polls continue until E is delivered. (2) Such a read happens:
    if X notified, its NOTIFY arrives after X committed; if X skipped, the
    notifier N held K1 when X tried it, which was after X took K2, and N's
    NOTIFY is sent when N commits, later still. (If X could not get K2 it
    notified itself.) The one gap: N rolls back after X skipped and no other
    write follows; then the fallback poll (``interval``) delivers E. NOTIFYs
    lost while disconnected are covered by the catch-up read after every
    (re)connect. So every committed event is delivered within ``interval`` of
    becoming readable, and within a re-poll delay (about a millisecond) in the
    common case.

Poll-only mode
    ``mode="poll"`` uses the same hub and reading rule without LISTEN (for
    PgBouncer transaction pooling): reads every ``interval`` (50 ms default),
    and re-polls as above while held back. Same guarantees, higher latency.

Expiry events
    `Reaper` (any host; a pglease lease elects one) writes ``lease.expired``
    for leases whose TTL ran out without a release, under the lease row lock,
    with the next revision, at most once per generation
    (``leases.expired_generation``). The expired holder stays recorded: claims
    still judge expiry by the clock, so the event changes nobody's right to
    claim. A claim that takes over an expired lease before the reaper got to
    it writes that ``lease.expired`` itself, in the same transaction, right
    before its ``lease.claimed``; either way a generation gets at most one,
    and none if its holder released it first. The event does raise the
    revision: a holder's cached `Claim.revision` is then stale, which only
    matters for an ``expected_revision`` check after the lease has already run
    out (renew and leased writes are refused then anyway); a late `release`
    without ``expected_revision`` still works.

Errors and health
    The hub logs (logger ``pglease.watch``) and retries a failed connect or
    read with backoff, from its tip, so a retry loses or repeats nothing. It
    gives up when the error cannot heal (SQLSTATE class 42, e.g. 42501
    insufficient_privilege or 42P01 undefined_table; class 28; 3F000
    invalid_schema_name; 0A000, a pooler refusing LISTEN) or has persisted
    for ``retry_window`` seconds (30 by default): every watcher then raises
    `WatchFailedError` from get/get_batch/iteration, its ``__cause__`` the
    last database error, and the stopped hub is replaced by the next watcher.
    A watcher's own catch-up reads follow the same rule. ``watcher.health``
    (a `WatchHealth`) shows the last error, since when reads fail, the
    reconnects and the lag. Elapsed-time decisions (the rate estimate, the
    retry window) read an injectable `pglease.clock.Clock`; waits stay real.

    Silence is an error too (``stall_timeout``, 5 s by default): a stalled
    network path keeps the socket open, so every round trip on the hub's
    connection, its connect, and a watcher's own catch-up reads and start
    must be answered within it (`pglease.postgres._stall` shuts the socket
    down otherwise), and the hub reads at least every
    ``min(interval, stall_timeout)``, also in listen mode, since waiting for
    a NOTIFY sends nothing. The failure is a `DatabaseUnavailableError` that
    says "no answer from the server", and follows the rule above: health
    unhealthy, the connection replaced, catch-up from the tip once the
    server answers, `WatchFailedError` after ``retry_window``.

Retention
    `prune` deletes events older than a duration, as a prefix of the read
    order, and records the last deleted position. A watcher whose cursor lies
    below it gets `CursorExpiredError` (``after="start"`` means the oldest
    retained event and never expires). It works in chunks, each its own
    transaction that deletes the next part of that prefix and raises the
    recorded position in the same commit, so every read's snapshot sees the
    log and the position agree: between chunks the log is a shorter prefix
    of the same order, never one with a hole.
"""

from ..driver.runtime_api import WatchEntryPoints, provide_watch
from ..errors import CursorExpiredError, WatchClosedError, WatchError, WatchFailedError
from ._core import DEFAULT_RETRY_WINDOW, WatchHealth
from .hub import HubTuning
from .prune import parse_duration, prune, prune_async
from .reaper import Reaper, reap_once, reap_once_async, run_reaper_async
from .watcher import AsyncWatcher, Watcher, watch, watch_async

# The stores' watch() reaches the watchers through this registration, never by
# importing this package (they sit below it).
provide_watch(WatchEntryPoints(watch=watch, watch_async=watch_async))

__all__ = [
    "DEFAULT_RETRY_WINDOW",
    "AsyncWatcher",
    "CursorExpiredError",
    "HubTuning",
    "Reaper",
    "WatchClosedError",
    "WatchError",
    "WatchFailedError",
    "WatchHealth",
    "Watcher",
    "parse_duration",
    "prune",
    "prune_async",
    "reap_once",
    "reap_once_async",
    "run_reaper_async",
    "watch",
    "watch_async",
]
