"""Iterating an asyncio watcher against `get()`, `get_batch()` and the cursor:
leaving a loop, starting another, mixing in `get()`/`get_batch()` and closing
from inside a loop never lose, repeat or skip an event. Real PostgreSQL.

The same for every backend and flavour, through a blocking face:
tests/conformance/test_watch.py; here what only asyncio has (a loop before
`start()`, a close from another task)."""

from __future__ import annotations

import asyncio

from pglease import AsyncPostgresStore, Owner, Permit, PostgresStore
from pglease.types import Event
from pglease.watch import AsyncWatcher, Watcher

A = Owner("host", "a")


async def _awrite(store: AsyncPostgresStore, rid: str, n: int) -> None:
    for i in range(n):
        revision = (await store.get(rid)).revision
        await store.mutate(Permit(rid, revision), f"run.e{i}")


def _first_after(store: PostgresStore | str, cursor: str, schema: str = "") -> int:
    """The revision of the first event after `cursor`, read by a fresh watcher."""
    if isinstance(store, str):
        with PostgresStore(store, schema=schema, auto_migrate=False) as fresh:
            return _first_after(fresh, cursor)
    with Watcher(store, after=cursor) as w:
        event = w.get(5)
    assert event is not None
    return event.revision


async def test_async_loops_get_and_batches_share_one_position(
    apg_store: AsyncPostgresStore,
) -> None:
    rid = await apg_store.ensure_resource("run", "ait")
    async with AsyncWatcher(apg_store, after="start") as w:
        await _awrite(apg_store, rid, 10)
        got: list[Event] = []
        async for event in w:
            got.append(event)
            if len(got) == 3:
                break
        assert _first_after(apg_store.dsn, w.cursor, apg_store.schema) == 4
        nxt = await w.get(5)
        assert nxt is not None
        got.append(nxt)
        got.extend(await w.get_batch(5))
        async for event in w:
            got.append(event)
            if len(got) >= 10:
                break
        assert [e.revision for e in got] == list(range(1, 11))
        assert await w.get(0.2) is None


async def test_async_loop_before_start_and_close_inside(apg_store: AsyncPostgresStore) -> None:
    rid = await apg_store.ensure_resource("run", "ait2")
    await _awrite(apg_store, rid, 3)
    # Iterating starts the watcher; closing inside the loop ends it.
    w = AsyncWatcher(apg_store, after="start")
    seen = []
    async for event in w:
        seen.append(event.revision)
        await w.aclose()
    assert seen == [1]
    # A closed watcher's loop ends at once.
    assert [e async for e in w] == []
    closed_early = AsyncWatcher(apg_store, after="start")
    await closed_early.aclose()
    assert [e async for e in closed_early] == []


async def test_async_loop_ends_when_closed_from_another_task(
    apg_store: AsyncPostgresStore,
) -> None:
    w = await AsyncWatcher(apg_store).start()
    asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(w.aclose()))
    assert [e async for e in w] == []
