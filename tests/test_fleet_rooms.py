"""Waiting rooms: the waiters of one process on one resource share one watcher
subscription, and a release wakes one of them, not all (`pglease.runtime._rooms`).

Timing is generous (a loaded 2-core machine must pass): the tests assert who
was woken and in which order, never how fast.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from pglease import AsyncPostgresStore, Owner, PostgresStore
from pglease.runtime import acquire, acquire_async
from pglease.runtime._rooms import RoomCore, _async_rooms, _sync_rooms
from pglease.watch import hub as watch_hub

from ._runtime_stores import astore, queued, store

__all__ = ["astore", "store"]  # fixtures: the tests taking them run on PostgreSQL and SQLite

A = Owner("host", "a")


def _eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


# --------------------------------------------------------------------------- core


def test_core_wakes_one_member_per_event_in_rank_order() -> None:
    core = RoomCore()
    flags = [threading.Event() for _ in range(3)]
    members = [core.join(f, fair=False) for f in flags]
    assert core.on_event() is members[0]
    members[0].flag.set()
    # The head has an unconsumed wake-up: its next attempt sees this event too.
    assert core.on_event() is None
    members[0].consume()
    assert core.on_event() is members[0]
    assert core.wakes == 2 and core.events == 3


def test_core_passes_an_unused_wake_up_on() -> None:
    core = RoomCore()
    first, second = core.join(threading.Event(), False), core.join(threading.Event(), False)
    first.flag.set()
    # Leaves (timeout) without attempting again: the next member gets the wake-up.
    assert core.leave(first, won=False) is second
    second.flag.set()
    # A winner's wake-up is not passed on: its release is the next event.
    assert core.leave(second, won=True) is None
    assert core.members == {}


def test_core_fair_rank_is_queue_order_and_unranked_come_last() -> None:
    core = RoomCore()
    late = core.join(threading.Event(), fair=True)
    early = core.join(threading.Event(), fair=True)
    # `early` created its queue entry first (first attempts run one at a time).
    core.rank(early)
    assert core.head() is early
    core.rank(late)
    core.leave(early, won=True)
    assert core.head() is late
    newcomer = core.join(threading.Event(), fair=True)
    assert core.head() is late
    core.leave(late, won=True)
    assert core.head() is newcomer


# --------------------------------------------------------------------------- sync


def _subscribers(store: PostgresStore | AsyncPostgresStore) -> int:
    hubs = [h for k, h in watch_hub._hubs.items() if k[2] == store.schema]
    return sum(len(h._subscribers) for h in hubs)


def test_waiters_share_one_subscription_and_a_release_wakes_one(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("hot", "k")
    holder = pg_store.claim(rid, A, 60)
    assert holder is not None
    won: list[str] = []
    lock = threading.Lock()

    def wait(n: int) -> None:
        claim = acquire(pg_store, "hot", "k", Owner("host", f"w{n}"), 60, timeout=60)
        with lock:
            won.append(claim.owner.id)
            n_won = len(won)
        if n_won > 1:
            pg_store.release(claim)  # the first winner is released by the test

    threads = [threading.Thread(target=wait, args=(n,), daemon=True) for n in range(6)]
    for t in threads:
        t.start()
    # The threads make the room as they reach acquire: on a busy machine that is
    # after start() returns.
    _eventually(lambda: any(k[3] == rid for k in list(_sync_rooms)))
    rooms = [r for k, r in list(_sync_rooms.items()) if k[3] == rid]
    assert len(rooms) == 1
    room = rooms[0]
    _eventually(lambda: len(room.core.members) == 6 and room.ready.is_set())
    # One hub subscription for six waiters (the room's watcher).
    assert _subscribers(pg_store) == 1
    pg_store.release(holder)
    _eventually(lambda: len(won) == 1)
    time.sleep(0.5)  # were any others woken, they would be refused and stay
    assert len(won) == 1
    assert room.core.events == 1 and room.core.wakes == 1
    assert len(room.core.members) == 5
    first = pg_store.get(rid).lease
    assert first.owner is not None and first.owner.id == won[0]
    # Release on the first winner's behalf: claim as if it ran out, then release.
    assert first.expires_at is not None
    stand_in = pg_store.claim(rid, A, 60, now=first.expires_at)
    assert stand_in is not None
    pg_store.release(stand_in)
    # Each winner's release (below) hands the lease to one more waiter.
    for t in threads:
        t.join(60)
    assert sorted(won) == sorted(f"w{n}" for n in range(6))
    assert room.core.wakes <= room.core.events


def test_fair_waiters_in_one_process_are_served_in_arrival_order(store: Any) -> None:
    rid = store.ensure_resource("fair", "k")
    holder = store.claim(rid, A, 60)
    assert holder is not None
    order: list[int] = []
    lock = threading.Lock()

    def waiter(n: int) -> None:
        c = acquire(store, "fair", "k", Owner("host", f"w{n}"), 30, timeout=60, fair=True)
        with lock:
            order.append(n)
        time.sleep(0.1)
        store.release(c)

    threads = []
    for n in range(5):
        t = threading.Thread(target=waiter, args=(n,), daemon=True)
        t.start()
        threads.append(t)

        _eventually(lambda n=n: queued(store, rid) == n + 1)  # type: ignore[misc]
    store.release(holder)
    for t in threads:
        t.join(60)
    assert order == [0, 1, 2, 3, 4]


def test_room_lingers_then_goes(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("linger", "k")
    holder = pg_store.claim(rid, A, 60)
    assert holder is not None
    got: list[int] = []
    t = threading.Thread(
        target=lambda: got.append(
            acquire(pg_store, "linger", "k", Owner("host", "b"), 5).generation
        ),
        daemon=True,
    )
    t.start()
    _eventually(lambda: any(k[3] == rid for k in _sync_rooms))
    pg_store.release(holder)
    t.join(30)
    assert got == [holder.generation + 1]
    # No members: the room and its hub subscription go after the linger time.
    _eventually(lambda: not any(k[3] == rid for k in _sync_rooms))
    _eventually(lambda: _subscribers(pg_store) == 0)


# --------------------------------------------------------------------------- asyncio


@pytest.mark.asyncio
async def test_async_waiters_share_one_room_and_a_release_wakes_one(
    astore: Any,
) -> None:
    rid = await astore.ensure_resource("hot", "ak")
    holder = await astore.claim(rid, A, 60)
    assert holder is not None
    tasks = [
        asyncio.create_task(acquire_async(astore, "hot", "ak", Owner("host", f"w{n}"), 60))
        for n in range(5)
    ]
    end = time.monotonic() + 30
    rooms = []
    while time.monotonic() < end:
        rooms = [r for k, r in _async_rooms.items() if k[4] == rid]
        if rooms and len(rooms[0].core.members) == 5 and rooms[0].ready.is_set():
            break
        await asyncio.sleep(0.02)
    assert len(rooms) == 1
    room = rooms[0]
    await astore.release(holder)
    done, pending = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    await asyncio.sleep(0.5)
    assert sum(t.done() for t in tasks) == 1
    assert room.core.wakes == 1 and len(room.core.members) == 4
    # Cancelling the rest leaves the room empty (and nothing behind in it).
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert room.core.members == {}
    winner = next(iter(done)).result()
    await astore.release(winner)


async def test_async_fair_waiters_in_one_loop_are_served_in_arrival_order(
    astore: Any,
) -> None:
    rid = await astore.ensure_resource("fair", "ak")
    holder = await astore.claim(rid, A, 60)
    assert holder is not None
    order: list[int] = []

    async def waiter(n: int) -> None:
        owner = Owner("host", f"w{n}")
        c = await acquire_async(astore, "fair", "ak", owner, 30, timeout=60, fair=True)
        order.append(n)
        await asyncio.sleep(0.1)
        await astore.release(c)

    tasks = []
    for n in range(4):
        tasks.append(asyncio.create_task(waiter(n)))
        end = time.monotonic() + 30
        while queued(astore, rid) < n + 1:
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
    await astore.release(holder)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert order == [0, 1, 2, 3]
