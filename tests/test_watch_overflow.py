"""Bounded watcher mailboxes: a consumer that falls behind reads the missed span
from the log instead of making its process hold every event (real PostgreSQL).

That nothing is lost or repeated, on every backend: tests/conformance/test_watch.py."""

from __future__ import annotations

import time

from pglease import AsyncPostgresStore, Owner, PostgresStore
from pglease.types import Event
from pglease.watch import AsyncWatcher, Watcher
from pglease.watch._core import Batch

A = Owner("host", "a")
CYCLES = 30
DEADLINE = 60.0


def write_cycles(store: PostgresStore, rids: list[str], cycles: int) -> None:
    for i in range(cycles):
        claim = store.claim(rids[i % len(rids)], A, 5)
        assert claim is not None
        store.release(claim)


def drain(w: Watcher, n: int, timeout: float = DEADLINE) -> list[Event]:
    out: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        got = w.get_batch(max(0.0, deadline - time.monotonic()))
        if not got:
            break
        out += got
    return out


def test_the_mailbox_holds_at_most_max_pending_events(pg_store: PostgresStore) -> None:
    # The hub's side of the bound (delivery itself is in tests/conformance/test_watch.py).
    rids = [pg_store.ensure_resource("run", f"of{i}") for i in range(3)]
    with Watcher(pg_store, max_pending=3) as slow, Watcher(pg_store) as fast:
        write_cycles(pg_store, rids, CYCLES)
        # Once the fast watcher has every event, the hub has offered all of
        # them to the slow one too, which took none so far.
        assert len(drain(fast, 2 * CYCLES)) == 2 * CYCLES
        # The bound holds: at most 3 queued events, or one batch on its own
        # (a batch bigger than the bound is let into an empty mailbox).
        queued = [item for item in slow._mailbox._items if isinstance(item, Batch)]
        assert sum(len(b.events) for b in queued) <= 3 or len(queued) == 1
        assert slow.overflows == 1 and fast.overflows == 0
        assert drain(slow, 2 * CYCLES) == pg_store.events_after(None, 1000)


async def test_async_mailbox_holds_at_most_max_pending_events(
    apg_store: AsyncPostgresStore, pg_store: PostgresStore
) -> None:
    rids = [pg_store.ensure_resource("run", f"aof{i}") for i in range(3)]
    async with (
        AsyncWatcher(apg_store, max_pending=3) as slow,
        AsyncWatcher(apg_store) as fast,
    ):
        write_cycles(pg_store, rids, CYCLES)
        seen: list[Event] = []
        while len(seen) < 2 * CYCLES:
            batch = await fast.get_batch(DEADLINE)
            assert batch, "the fast watcher stalled"
            seen += batch
        queued = [item for item in slow._mailbox._items if isinstance(item, Batch)]
        assert sum(len(b.events) for b in queued) <= 3 or len(queued) == 1
        assert slow.overflows == 1 and fast.overflows == 0
