"""The fleet runtime: hold leases for as long as the code needs them.

::

    with hold(store, "run", "r1", Owner("host", "h1"), ttl=10) as lease:
        lease.check()                          # raises LeaseLostError once lost
        store.mutate(lease.permit(rev), "run.step", apply=...)   # fenced write
        downstream.write(fence=lease.generation)

    async with hold_async(astore, "run", "r1", owner, ttl=10) as lease: ...

    claim = acquire(store, "run", "r1", owner, ttl=10, timeout=5, fair=True)
    with elect(store, "scheduler", owner, on_elected=start, on_deposed=stop) as e: ...

Backends
    Everything here reaches the database through the store's runtime driver
    (`store.runtime_driver()`, the protocol in `pglease.driver`), never a
    driver library: `pglease.postgres.runtime` for PostgreSQL,
    `pglease.sqlite.runtime` for SQLite, so `SqliteStore.hold` and
    `PostgresStore.hold` run the same code.

Heartbeats
    One `Keeper` per store (process) renews every lease the process holds in
    one round trip per beat (PostgreSQL: `heartbeat` in sql/0005_fleet.sql;
    SQLite: one write transaction), every ttl/3 by default, from a dedicated
    thread (`AsyncKeeper`: a task) on its own line to the database (a
    dedicated connection on PostgreSQL). A heartbeat extends the expiry only:
    it is not a change of the resource, so it neither bumps the revision nor
    writes an event, and a holder's cached revision stays valid for its own
    `expected_revision` writes. The explicit `store.renew()` keeps bumping the revision and
    writing `lease.renewed`.

Trust window
    A held lease trusts itself until ``start of the request that claimed or
    last renewed it + ttl - margin`` on the local monotonic clock; the
    database's expiry is never earlier. Transient errors are retried until the
    window closes; a beat that finds the generation or token changed is loss
    at once. Loss sets `lease.lost`, runs `on_lost` callbacks and makes
    `check()` raise; leaving the `hold` block afterwards raises it too (a
    body's own exception wins, with the loss as a note).

Waiting
    `acquire`/`hold` wait for the holder's known expiry (a local delay computed
    from the database clock) or for a `lease.released`/`lease.expired` event
    from the watcher, never a fixed poll; ``fair=True`` serves waiters in
    arrival order across hosts. The waiters of one process on one resource
    share one watcher subscription (a waiting room, `_rooms`), and an event
    wakes one of them: the oldest fair waiter, or the longest-waiting unfair
    one. The others keep sleeping until their turn or the holder's expiry.
    A lease row locked past the store's lock_timeout counts as busy: acquire
    retries until its own timeout.

Errors
    Only `PgleaseError`s leave the fleet API (and a body's own exceptions);
    `hold` takes the keeper's connection before claiming, so a host without
    one fails at once (`DatabaseUnavailableError`) and claims nothing.

Clock
    Decisions by elapsed time (due times, late beats, trust windows, acquire
    deadlines, room linger, `pglease hold`'s kill schedule) read a
    `pglease.clock.Clock` (``clock=``; the system clock by default). Waits stay
    real: under any other clock they last at most `FAKE_CLOCK_TICK`, so a
    `FakeClock` moved by a test is acted on at the next wake-up.
"""

from ..driver.runtime_api import RuntimeEntryPoints, provide
from ._keeper_core import KeeperStats
from ._timing import FAKE_CLOCK_TICK, Timing
from .acquire import acquire, acquire_async, hold, hold_async
from .election import (
    ELECTION_TYPE,
    AsyncElection,
    Election,
    Leader,
    elect,
    elect_async,
    leader,
    leader_async,
)
from .keeper import AsyncKeeper, Keeper
from .lease import AsyncHeldLease, HeldLease

# The stores' facade methods (`SqliteStore.hold`, ...) reach the runtime
# through this registration, never by importing it (they sit below it).
provide(
    RuntimeEntryPoints(
        hold=hold,
        hold_async=hold_async,
        acquire=acquire,
        acquire_async=acquire_async,
        elect=elect,
        elect_async=elect_async,
        leader=leader,
        leader_async=leader_async,
    )
)

__all__ = [
    "ELECTION_TYPE",
    "FAKE_CLOCK_TICK",
    "AsyncElection",
    "AsyncHeldLease",
    "AsyncKeeper",
    "Election",
    "HeldLease",
    "Keeper",
    "KeeperStats",
    "Leader",
    "Timing",
    "acquire",
    "acquire_async",
    "elect",
    "elect_async",
    "hold",
    "hold_async",
    "leader",
    "leader_async",
]
