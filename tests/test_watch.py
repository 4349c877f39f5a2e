"""Watchers, expiry events, retention: behaviour on a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from pglease import (
    AsyncPostgresStore,
    CursorExpiredError,
    Owner,
    Permit,
    PgleaseError,
    PostgresStore,
    ValidationError,
)
from pglease.types import Event
from pglease.watch import (
    AsyncWatcher,
    Reaper,
    Watcher,
    parse_duration,
    prune,
    prune_async,
    reap_once,
    reap_once_async,
)
from pglease.watch._core import Filters

A = Owner("host", "a")
B = Owner("host", "b")


def drain(w: Watcher, n: int, timeout: float = 5.0) -> list[Event]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        e = w.get(max(0.0, deadline - time.monotonic()))
        if e is None:
            break
        out.append(e)
    return out


def cycle(store: PostgresStore, rid: str, owner: Owner = A) -> None:
    claim = store.claim(rid, owner, 5)
    assert claim is not None
    store.release(claim)


def test_watchers_of_a_process_share_one_hub(pg_store: PostgresStore) -> None:
    with Watcher(pg_store) as w1, Watcher(pg_store) as w2, Watcher(pg_store, mode="poll") as w3:
        assert w1._hub is w2._hub
        assert w3._hub is not w1._hub
        hub = w1._hub
    assert hub is not None
    hub.join(2)
    # The last watcher closed the hub's connection; a new watcher gets a new hub.
    with Watcher(pg_store) as w4:
        assert w4._hub is not hub


def test_filter_accepts_reserved_lease_types() -> None:
    f = Filters.build(None, None, ["lease.expired"])
    assert f.event_types == frozenset({"lease.expired"})


def _blocking_mutation(
    store: PostgresStore, rid: str, event_type: str
) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """Start a mutation whose transaction stays open until `release` is set."""
    entered, release = threading.Event(), threading.Event()

    def apply(conn: psycopg.Connection[Any]) -> None:
        entered.set()
        assert release.wait(10)

    rev = store.get(rid).revision
    t = threading.Thread(target=lambda: store.mutate(Permit(rid, rev), event_type, apply))
    t.start()
    assert entered.wait(5)
    return t, entered, release


@pytest.mark.parametrize("mode", ["listen", "poll"])
def test_out_of_order_commit(pg_store: PostgresStore, mode: str) -> None:
    r1 = pg_store.ensure_resource("run", "o1")
    r2 = pg_store.ensure_resource("run", "o2")
    # A long fallback/poll interval: delivery must not depend on it... except
    # in poll mode, where polling is the mechanism.
    interval = 30.0 if mode == "listen" else 0.05
    with Watcher(pg_store, mode=mode, interval=interval) as w:
        t, _, release = _blocking_mutation(pg_store, r1, "run.first")  # lower id, commits last
        pg_store.mutate(Permit(r2, 0), "run.second")  # higher id, commits first
        # Not deliverable yet: an older transaction may still commit before it.
        assert w.get(0.3) is None
        release.set()
        t.join()
        started = time.monotonic()
        got = drain(w, 2, timeout=60)
        # Well before the 30 s fallback poll (a bound, not a speed claim: the
        # re-poll after a held-back read delivers, within milliseconds).
        assert time.monotonic() - started < interval / 2 or mode == "poll"
    assert [e.type for e in got] == ["run.first", "run.second"]
    assert got[0].id < got[1].id


def test_skipper_committing_after_the_notifier_is_not_stranded(pg_store: PostgresStore) -> None:
    """The notifier (lower xid) commits first; the skipper (higher xid, above
    the reader's snapshot xmax) commits later and sends no NOTIFY. The read
    probe must keep the hub re-polling until the skipper's event arrives."""
    r1 = pg_store.ensure_resource("run", "s1")
    r2 = pg_store.ensure_resource("run", "s2")
    with Watcher(pg_store, interval=30.0) as w:
        t1, _, release1 = _blocking_mutation(pg_store, r1, "run.notifier")
        t2, _, release2 = _blocking_mutation(pg_store, r2, "run.skipper")
        release1.set()
        t1.join()
        first = w.get(5)
        assert first is not None and first.type == "run.notifier"
        time.sleep(0.2)
        release2.set()
        t2.join()
        started = time.monotonic()
        second = w.get(60)
        assert second is not None and second.type == "run.skipper"
        assert time.monotonic() - started < 15.0  # not the 30 s fallback poll


# --------------------------------------------------------------------------- retention


def test_prune_and_cursor_expiry(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "p1")
    cycle(pg_store, rid)
    with Watcher(pg_store, after="start") as w:
        old = drain(w, 2)
    assert prune(pg_store, 3600) == 0  # nothing that old
    assert prune(pg_store, 0) == 2
    assert pg_store.events(rid) == []
    cycle(pg_store, rid)
    # Resuming below the horizon must fail loudly, never skip silently, and
    # keep failing if the caller tries again.
    with Watcher(pg_store, after=old[0].cursor) as stale:
        for _ in range(2):
            with pytest.raises(CursorExpiredError):
                stale.get(5)
    # The last deleted event's cursor is exactly the horizon: nothing was lost.
    with Watcher(pg_store, after=old[1].cursor) as fine:
        assert [e.revision for e in drain(fine, 2)] == [3, 4]
    # "start" means the oldest retained event.
    with Watcher(pg_store, after="start") as w:
        assert [e.revision for e in drain(w, 2)] == [3, 4]


def test_prune_keeps_events_of_open_transactions(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "p2")
    t, _, release = _blocking_mutation(pg_store, rid, "run.open")
    try:
        assert prune(pg_store, 0) == 0
    finally:
        release.set()
        t.join()
    assert [e.type for e in pg_store.events(rid)] == ["run.open"]


def test_parse_duration() -> None:
    assert parse_duration("90s") == 90
    assert parse_duration("1h30m") == 5400
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("250ms") == 0.25
    assert parse_duration("12") == 12
    for bad in ("", "abc", "5 parsecs", "-1", "1h-5m", "nan"):
        with pytest.raises(ValidationError):
            parse_duration(bad)


def test_prune_rejects_bad_ages(pg_store: PostgresStore) -> None:
    for bad in (-1, "7d", float("nan"), True):
        with pytest.raises(ValidationError):
            prune(pg_store, bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- expiry


def test_reaper_writes_expired_event_once(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "e1")
    with Watcher(pg_store, event_types="lease.expired") as w:
        claim = pg_store.claim(rid, A, 0.2)
        assert claim is not None
        started = time.monotonic()
        with Reaper(pg_store, Owner("host", "reaper"), interval=0.05) as reaper:
            event = w.get(5)
            assert reaper.active
        assert event is not None
        assert time.monotonic() - started < 2.0
        assert event.resource_id == rid
        assert event.revision == claim.revision + 1
        assert event.lease_generation == claim.generation
        assert event.actor == A
        assert event.lease_expires_at == claim.expires_at
        assert reap_once(pg_store) == 0  # once per generation
        assert w.get(0.2) is None
    # The event changed nobody's rights: the holder is still recorded but
    # not live, anyone may claim, and the old holder cannot renew.
    state = pg_store.get(rid)
    assert state.lease.owner == A and not state.lease.held
    with pytest.raises(PgleaseError):
        pg_store.renew(claim, 5)
    taken = pg_store.claim(rid, B, 5)
    assert taken is not None and taken.generation == claim.generation + 1
    types = [e.type for e in pg_store.events(rid)]
    assert types == ["lease.claimed", "lease.expired", "lease.claimed"]


def test_takeover_before_reaping_writes_the_expired_event(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "e2")
    old = pg_store.claim(rid, A, 0.05)
    assert old is not None
    time.sleep(0.1)
    new = pg_store.claim(rid, B, 0.05)
    assert new is not None and new.revision == 3
    # The takeover recorded the old generation's expiry (sql/0007); the
    # reaper does not repeat it, and reaps the new one once.
    time.sleep(0.1)
    assert reap_once(pg_store) == 1
    assert reap_once(pg_store) == 0
    events = pg_store.events(rid)
    assert [(e.type, e.revision, e.lease_generation, e.actor) for e in events] == [
        ("lease.claimed", 1, 1, A),
        ("lease.expired", 2, 1, A),
        ("lease.claimed", 3, 2, B),
        ("lease.expired", 4, 2, B),
    ]
    # The late release of an expired (and reaped) lease still works; a
    # released lease never expires.
    pg_store.release(new)
    assert reap_once(pg_store) == 0


def test_live_and_renewed_leases_are_not_reaped(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "e3")
    claim = pg_store.claim(rid, A, 0.3)
    assert claim is not None
    assert reap_once(pg_store) == 0
    claim = pg_store.renew(claim, 5)
    time.sleep(0.35)
    assert reap_once(pg_store) == 0
    with pytest.raises(ValidationError):
        reap_once(pg_store, 0)


def test_one_reaper_at_a_time(pg_store: PostgresStore) -> None:
    r1 = Reaper(pg_store, Owner("host", "r1"), interval=0.05, lease_ttl=5)
    r2 = Reaper(pg_store, Owner("host", "r2"), interval=0.05, lease_ttl=5)
    r1.run_once()
    r2.run_once()
    assert r1.active and not r2.active
    r1.stop()  # releases the reaper lease
    r2.run_once()
    assert r2.active
    r2.stop()
    with pytest.raises(ValidationError):
        Reaper(pg_store, "host:x", interval=0.05)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- asyncio


async def test_async_watcher(apg_store: AsyncPostgresStore, pg_dsn: str, schema: str) -> None:
    rid = await apg_store.ensure_resource("run", "a1")
    async with AsyncWatcher(apg_store) as w:
        claim = await apg_store.claim(rid, A, 0.1)
        assert claim is not None
        first = await w.get(5)
        assert first is not None and first.type == "lease.claimed"
        await _sleep(0.15)
        assert await reap_once_async(apg_store) == 1
        second = await w.get(5)
        assert second is not None and second.type == "lease.expired"
        assert await w.get(0.1) is None
        cursor = w.cursor
    await apg_store.mutate(Permit(rid, 2), "run.after")
    got = []
    async for event in AsyncWatcher(apg_store, after=cursor, mode="poll"):
        got.append(event.type)
        break
    assert got == ["run.after"]
    assert await prune_async(apg_store, 0) == 3
    stale = AsyncWatcher(apg_store, after=first.cursor)
    with pytest.raises(CursorExpiredError):
        await stale.get(5)
    await stale.aclose()
    with pytest.raises(PgleaseError):
        await stale.get(0.1)


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def test_sync_and_async_share_a_hub(pg_store: PostgresStore) -> None:
    import asyncio

    async def main() -> tuple[Any, Any]:
        async with AsyncPostgresStore(pg_store.dsn, schema=pg_store.schema) as astore:
            aw = await AsyncWatcher(astore).start()
            with Watcher(pg_store) as sw:
                same = (aw._hub, sw._hub)
            await aw.aclose()
            return same

    a, b = asyncio.run(main())
    assert a is b


async def test_async_watchers_of_a_loop_share_one_subscription(
    apg_store: AsyncPostgresStore,
) -> None:
    rid = await apg_store.ensure_resource("run", "fan")
    a = await AsyncWatcher(apg_store).start()
    b = await AsyncWatcher(apg_store, event_types="lease.released").start()
    hub = a._hub
    assert hub is not None and hub is b._hub
    assert len(hub._subscribers) == 1
    claim = await apg_store.claim(rid, A, 5)
    assert claim is not None
    await apg_store.release(claim)
    first = await a.get(5)
    assert first is not None and first.type == "lease.claimed"
    got = await b.get(5)
    assert got is not None and got.type == "lease.released"
    # A watcher joining the loop's stream late starts at "now", not at the
    # loop's last tip: it must not see the claim again.
    c = await AsyncWatcher(apg_store).start()
    await a.aclose()
    await apg_store.mutate(Permit(rid, 2), "run.later")
    later = await c.get(5)
    assert later is not None and later.type == "run.later"
    assert await b.get(0.2) is None
    await b.aclose()
    await c.aclose()
    hub.join(2)
    assert not hub._subscribers


def test_store_closed_while_catching_up(pg_dsn: str, schema: str) -> None:
    store = PostgresStore(pg_dsn, schema=schema, max_size=2)
    rid = store.ensure_resource("run", "closed")
    cycle(store, rid)
    w = Watcher(store, after="start")
    store.close()
    with pytest.raises(PgleaseError, match="store was closed"):
        w.get(5)
    w.close()


@pytest.mark.parametrize("mode", ["listen", "poll"])
def test_hub_reconnects_and_catches_up(pg_store: PostgresStore, pg_dsn: str, mode: str) -> None:
    rid = pg_store.ensure_resource("run", f"reconnect-{mode}")
    with Watcher(pg_store, mode=mode, interval=0.05) as w:
        cycle(pg_store, rid)
        assert [e.revision for e in drain(w, 2)] == [1, 2]
        hub = w._hub
        assert hub is not None and hub.backend_pid is not None
        connects = hub.connects
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [hub.backend_pid])
        # Written while the hub's connection is gone: no NOTIFY reaches it.
        cycle(pg_store, rid)
        cycle(pg_store, rid)
        assert [e.revision for e in drain(w, 4)] == [3, 4, 5, 6]
        assert w.get(0.2) is None
        assert hub.connects > connects
