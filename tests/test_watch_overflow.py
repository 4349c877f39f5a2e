"""Bounded watcher mailboxes: a consumer that falls behind reads the missed span
from the log instead of making its process hold every event (real PostgreSQL)."""

from __future__ import annotations

import time

import pytest

from pglease import AsyncPostgresStore, Owner, PostgresStore, ValidationError
from pglease.types import Event
from pglease.watch import AsyncWatcher, Watcher
from pglease.watch._core import Batch

A = Owner("host", "a")
CYCLES = 30


def write_cycles(store: PostgresStore, rids: list[str], cycles: int) -> None:
    for i in range(cycles):
        claim = store.claim(rids[i % len(rids)], A, 5)
        assert claim is not None
        store.release(claim)


def drain(w: Watcher, n: int, timeout: float = 10.0) -> list[Event]:
    out: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        got = w.get_batch(max(0.0, deadline - time.monotonic()))
        if not got:
            break
        out += got
    return out


def test_slow_watcher_overflows_and_loses_nothing(pg_store: PostgresStore) -> None:
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
        got = drain(slow, 2 * CYCLES)
        assert got == pg_store.events_after(None, 1000)
        assert slow.get(0.2) is None
        # Back on the live stream after reading the dropped span.
        write_cycles(pg_store, rids, 2)
        later = drain(slow, 4)
        assert [e.revision for e in later] == [e.revision for e in drain(fast, 4)]
        assert later[0].id > got[-1].id
        assert later == pg_store.events_after(got[-1].cursor, 1000)


def test_filtered_watcher_overflow_keeps_the_filter(pg_store: PostgresStore) -> None:
    rids = [pg_store.ensure_resource("run", f"ff{i}") for i in range(2)]
    with Watcher(pg_store, max_pending=2, resources=rids[0]) as slow, Watcher(pg_store) as fast:
        write_cycles(pg_store, rids, 20)
        assert len(drain(fast, 40)) == 40
        got = drain(slow, 20)
        assert slow.overflows >= 1
        expected = [e for e in pg_store.events_after(None, 1000) if e.resource_id == rids[0]]
        assert got == expected
        assert slow.get(0.2) is None


@pytest.mark.parametrize("bad", [0, -1, True, "5", 2.5])
def test_bad_max_pending_is_refused(pg_store: PostgresStore, bad: object) -> None:
    with pytest.raises(ValidationError, match="max_pending"):
        Watcher(pg_store, max_pending=bad)  # type: ignore[arg-type]


async def test_async_slow_watcher_overflows_and_loses_nothing(
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
            batch = await fast.get_batch(10)
            assert batch, "the fast watcher stalled"
            seen += batch
        assert slow.overflows == 1 and fast.overflows == 0
        got: list[Event] = []
        while len(got) < 2 * CYCLES:
            batch = await slow.get_batch(10)
            assert batch, "the slow watcher stalled"
            got += batch
        assert got == seen == pg_store.events_after(None, 1000)
        assert await slow.get(0.2) is None
        write_cycles(pg_store, rids, 1)
        later = [await slow.get(5), await slow.get(5)]
        assert [e.type for e in later if e is not None] == ["lease.claimed", "lease.released"]
    with pytest.raises(ValidationError, match="max_pending"):
        AsyncWatcher(apg_store, max_pending=0)
