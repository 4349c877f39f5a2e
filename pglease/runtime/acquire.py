"""Blocking acquire and `hold` (acquire + keep alive + release), sync and asyncio.

The code is written once: `_acquire_async` is the source, `_acquire` its
generated blocking twin (tools/async_to_sync.py), `_acquire_core` what neither
waits for; this module names them all.

Wake-ups, never a fixed poll: a waiter sleeps until the holder's known expiry
(converted to a local delay from the database's own clock, read in the same
round trip) or until a `lease.released` / `lease.expired` event on the resource
wakes it, whichever comes first. Events reach waiters through the process's
waiting room for the resource (`_rooms`): one watcher subscription shared by
all waiters of the process, one waiter woken per event. If `pglease.watch` is
missing or fails, waiters fall back to the expiry timer plus a coarse re-check
every `FALLBACK_POLL` seconds, since a release would otherwise go unnoticed
until the expiry.

Fairness (``fair=True``): the waiter enqueues in the resource's queue
(PostgreSQL: `claim_fair`, migration 0005; SQLite: its lease_waiters table)
and may claim only as the head of the live queue, so fair waiters are served
in the order they arrived, across hosts (SQLite: across processes).
Besides the wake-ups above a fair waiter also wakes when the head's queue
entry would run out (a dead head), and every third of its own entry's ttl to
refresh it. On timeout, error or cancellation its entry is deleted.

Backends: every attempt goes through the store's runtime driver
(`store.runtime_driver()`, `pglease.driver`), so the same code waits on
PostgreSQL and on SQLite.

Busy rows: a claim that waits for the lease row's lock longer than the store's
``lock_timeout`` (a stalled transaction holds it; on SQLite the file's write
lock past ``busy_timeout``) changes nothing and the driver answers None;
acquire counts that as "busy" and tries again until its own `timeout`, which
then raises `AcquireTimeoutError` as for a held lease.

Errors: the drivers raise only `PgleaseError`s (on PostgreSQL worded with the
store's limits): a connection that broke while the claim was in flight is a
`CommitOutcomeUnknownError` (the claim may have committed under this call's
token), a pool or connect failure a `DatabaseUnavailableError`.

Timeout: one budget (`_Budget`) for every step: `hold`'s keeper connect,
ensuring the resource, the room's readiness, each claim round trip. Each
driver call gets what is left plus `STEP_GRACE` as its client deadline, so a
stalled path cannot hold a caller past about ``timeout + STEP_GRACE``. A step
that fails once the budget is spent is the acquire's timeout
(`AcquireTimeoutError`), except a claim whose outcome is unknown, which stays
a `CommitOutcomeUnknownError` (the caller may hold it; `.token`). A claim
answered after its trust window (`_trust`) is a loss: `hold` hands it to its
keeper to release, `acquire` lets it run out; neither returns it.

Clock: the deadline of `timeout`, and the instant a won claim's trust window
starts from, read ``clock`` (`pglease.clock.Clock`, the system clock by
default; `hold` uses its keeper's). Waits stay real: the holder's expiry is a
real delay computed from the database's clock, and under any other clock the
waiter re-reads it at least every `FAKE_CLOCK_TICK` without a database round
trip, so advancing a fake clock past the deadline ends the wait.
"""

from __future__ import annotations

from ._acquire import LeaseStore as SyncLeaseStore
from ._acquire import _acquire, _attempt, _leave_queue, _release, acquire, hold
from ._acquire_async import (
    AsyncLeaseStore,
    _acquire_async,
    _attempt_async,
    _leave_queue_async,
    _release_async,
    acquire_async,
    hold_async,
)
from ._acquire_core import (
    _EXPIRY_SLACK,
    _NO_LOCK,
    BUSY_PAUSE,
    FALLBACK_POLL,
    LEAVE_LIMIT,
    MAX_WAITER_TTL,
    MIN_WAITER_TTL,
    STEP_GRACE,
    STOP_POLL,
    _Budget,
    _check_timeout,
    _claim_outcome,
    _left,
    _min_wait,
    _Outcome,
    _Pause,
    _Plan,
    _record_wait,
    _same_clock,
    _trust,
    _waiting,
)

__all__ = [
    "BUSY_PAUSE",
    "FALLBACK_POLL",
    "LEAVE_LIMIT",
    "MAX_WAITER_TTL",
    "MIN_WAITER_TTL",
    "STEP_GRACE",
    "STOP_POLL",
    "_EXPIRY_SLACK",
    "_NO_LOCK",
    "AsyncLeaseStore",
    "SyncLeaseStore",
    "_Budget",
    "_Outcome",
    "_Pause",
    "_Plan",
    "_acquire",
    "_acquire_async",
    "_attempt",
    "_attempt_async",
    "_check_timeout",
    "_claim_outcome",
    "_leave_queue",
    "_leave_queue_async",
    "_left",
    "_min_wait",
    "_record_wait",
    "_release",
    "_release_async",
    "_same_clock",
    "_trust",
    "_waiting",
    "acquire",
    "acquire_async",
    "hold",
    "hold_async",
]
