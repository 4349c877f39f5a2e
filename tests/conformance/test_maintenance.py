"""The reaper and prune behave alike on every store: PostgreSQL and SQLite,
sync and asyncio. Both reach a backend only through its runtime driver
(`pglease.driver.maintenance`), so one set of test bodies runs on the four.

Leases are made expired by claiming them at an instant in the past (`now=`,
the test clock on PostgreSQL): the backend's real clock then finds them run
out, with no waiting. Events made that way are old by their `created_at` too,
which is what prune judges; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pglease import CursorExpiredError, Owner, ValidationError
from pglease.watch import Reaper, prune, prune_async, reap_once, reap_once_async
from pglease.watch.prune import MAX_CHUNK
from pglease.watch.reaper import REAPER_RESOURCE, run_reaper_async

from .._runtime_stores import astore, store

__all__ = ["astore", "store"]  # fixtures, used by name

A = Owner("host", "a")
B = Owner("host", "b")
R = Owner("host", "reaper")
DEADLINE = 60.0


def _past(seconds: float = 3600.0) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


def _kinds(events: list[Any]) -> list[tuple[str, int, int | None]]:
    return [(e.type, e.revision, e.lease_generation) for e in events]


def _expired_lease(store: Any, key: str) -> str:
    """A resource whose lease (generation 1, held by A) ran out an hour ago."""
    rid = store.ensure_resource("run", key)
    assert store.claim(rid, A, 1.0, now=_past()) is not None
    return str(rid)


async def _aexpired_lease(astore: Any, key: str) -> str:
    rid = await astore.ensure_resource("run", key)
    assert await astore.claim(rid, A, 1.0, now=_past()) is not None
    return str(rid)


# --------------------------------------------------------------------------- reap


def test_an_expired_lease_gets_one_expiry_event(store: Any) -> None:
    rid = _expired_lease(store, "gone")
    before = store.get(rid)
    assert reap_once(store) == 1
    after = store.get(rid)
    assert after.revision == before.revision + 1
    assert after.lease.generation == 1 and not after.lease.held
    assert _kinds(store.events(rid)) == [("lease.claimed", 1, 1), ("lease.expired", 2, 1)]
    expired = store.events(rid)[-1]
    assert expired.actor == A and expired.lease_expires_at == before.lease.expires_at
    assert reap_once(store) == 0  # recorded once
    assert store.get(rid).revision == 2
    # A later claim takes generation 2 and writes no second expiry.
    claim = store.claim(rid, B, 60)
    assert claim is not None and claim.generation == 2 and claim.revision == 3
    assert _kinds(store.events(rid)) == [
        ("lease.claimed", 1, 1),
        ("lease.expired", 2, 1),
        ("lease.claimed", 3, 2),
    ]


def test_a_takeover_before_the_reaper_records_the_expiry_itself(store: Any) -> None:
    rid = _expired_lease(store, "taken")
    claim = store.claim(rid, B, 60)
    assert claim is not None and claim.generation == 2
    assert _kinds(store.events(rid)) == [
        ("lease.claimed", 1, 1),
        ("lease.expired", 2, 1),
        ("lease.claimed", 3, 2),
    ]
    assert reap_once(store) == 0  # nothing left: generation 1 is recorded, 2 is live
    assert store.get(rid).revision == 3


def test_live_and_released_leases_are_not_reaped(store: Any) -> None:
    live = store.ensure_resource("run", "live")
    assert store.claim(live, A, 600) is not None
    freed = store.ensure_resource("run", "freed")
    claim = store.claim(freed, A, 1.0, now=_past())
    assert claim is not None
    store.release(claim, now=_past(1800))  # released, then its ttl would have run out
    revisions = {rid: store.get(rid).revision for rid in (live, freed)}
    assert reap_once(store) == 0
    assert {rid: store.get(rid).revision for rid in (live, freed)} == revisions
    assert store.get(live).lease.held


def test_reap_takes_at_most_limit_leases_per_call(store: Any) -> None:
    rids = [_expired_lease(store, f"many-{i}") for i in range(3)]
    assert reap_once(store, limit=2) == 2
    assert reap_once(store, limit=2) == 1
    assert reap_once(store, limit=2) == 0
    for rid in rids:
        assert [e.type for e in store.events(rid)] == ["lease.claimed", "lease.expired"]


@pytest.mark.parametrize("limit", [0, -1, 100_001, 1.5, True, "10"])
def test_a_bad_reap_limit_is_refused_and_changes_nothing(store: Any, limit: object) -> None:
    rid = _expired_lease(store, "bad-limit")
    with pytest.raises(ValidationError, match="limit"):
        reap_once(store, limit)  # type: ignore[arg-type]
    assert store.get(rid).revision == 1


def test_the_reaper_thread_reaps_while_it_holds_its_lease(store: Any) -> None:
    rid = _expired_lease(store, "threaded")
    with Reaper(store, R, interval=0.02, lease_ttl=30) as reaper:
        end = time.monotonic() + DEADLINE
        while reaper.reaped < 1:
            assert time.monotonic() < end, "the reaper did not reap in time"
            time.sleep(0.02)
        assert reaper.active
    assert [e.type for e in store.events(rid)] == ["lease.claimed", "lease.expired"]
    # Stopping released the reaper's own lease, so another host takes over at once.
    assert not store.get(store.ensure_resource(*REAPER_RESOURCE)).lease.held


async def test_async_an_expired_lease_gets_one_expiry_event(astore: Any) -> None:
    rid = await _aexpired_lease(astore, "gone")
    assert await reap_once_async(astore) == 1
    assert await reap_once_async(astore) == 0
    claim = await astore.claim(rid, B, 60)
    assert claim is not None and claim.generation == 2 and claim.revision == 3
    assert _kinds(await astore.events(rid)) == [
        ("lease.claimed", 1, 1),
        ("lease.expired", 2, 1),
        ("lease.claimed", 3, 2),
    ]


async def test_async_a_live_lease_is_not_reaped(astore: Any) -> None:
    rid = await astore.ensure_resource("run", "live")
    assert await astore.claim(rid, A, 600) is not None
    assert await reap_once_async(astore) == 0
    assert (await astore.get(rid)).revision == 1
    with pytest.raises(ValidationError, match="limit"):
        await reap_once_async(astore, 0)


async def test_async_run_reaper_reaps_and_releases_its_lease_on_cancel(astore: Any) -> None:
    rid = await _aexpired_lease(astore, "task")
    task = asyncio.create_task(run_reaper_async(astore, R, interval=0.02, lease_ttl=30))
    try:
        end = time.monotonic() + DEADLINE
        while len(await astore.events(rid)) < 2:
            assert time.monotonic() < end, "the reaper did not reap in time"
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [e.type for e in await astore.events(rid)] == ["lease.claimed", "lease.expired"]
    reaper_rid = await astore.ensure_resource(*REAPER_RESOURCE)
    assert not (await astore.get(reaper_rid)).lease.held


# --------------------------------------------------------------------------- prune


def _old_and_new(store: Any) -> tuple[str, str]:
    """Two events two hours old on one resource, then one new event on another."""
    old = store.ensure_resource("run", "old")
    claim = store.claim(old, A, 60, now=_past(7200))
    assert claim is not None
    store.release(claim, now=_past(7200 - 1))
    new = store.ensure_resource("run", "new")
    assert store.claim(new, A, 60) is not None
    return str(old), str(new)


def test_prune_removes_only_events_older_than_the_bound(store: Any) -> None:
    old, new = _old_and_new(store)
    assert prune(store, 2 * 86400) == 0  # nothing that old
    assert len(store.events(old)) == 2
    deleted = prune(store, 3600, chunk=1)  # one event per transaction
    assert deleted == 2 and deleted.events == 2
    assert store.events(old) == []
    assert _kinds(store.events(new)) == [("lease.claimed", 1, 1)]
    # The resources, revisions and generations stay: only history goes.
    state = store.get(old)
    assert state.revision == 2 and state.lease.generation == 1
    assert prune(store, 3600) == 0  # done already


def test_prune_deletes_payloads_no_event_references_any_more(store: Any) -> None:
    from pglease import Permit

    rid = store.ensure_resource("doc", "p")
    # Written an hour ago (unleased, at revision 0), then a second writer
    # reuses the first payload now: that one must stay.
    store.mutate(Permit(rid, 0), "doc.written", payload={"v": "old only"}, now=_past(7200))
    store.mutate(Permit(rid, 1), "doc.written", payload={"v": "shared"}, now=_past(7100))
    store.mutate(Permit(rid, 2), "doc.written", payload={"v": "shared"})
    deleted = prune(store, 3600)
    assert deleted.events == 2 and deleted.payloads == 1
    assert [e.payload for e in store.events(rid)] == [{"v": "shared"}]


@pytest.mark.parametrize(
    ("older_than", "chunk", "match"),
    [
        (-1, 10, "non-negative"),
        (float("nan"), 10, "non-negative"),
        ("1h", 10, "seconds"),
        (0, 0, "chunk"),
        (0, MAX_CHUNK + 1, "chunk"),
        (0, 2.5, "chunk"),
    ],
)
def test_prune_refuses_bad_bounds_and_changes_nothing(
    store: Any, older_than: object, chunk: object, match: str
) -> None:
    old, _new = _old_and_new(store)
    with pytest.raises(ValidationError, match=match):
        prune(store, older_than, chunk=chunk)  # type: ignore[arg-type]
    assert len(store.events(old)) == 2


def test_prune_respecting_ttls_refuses_an_age_below_a_held_lease_ttl(store: Any) -> None:
    old, _new = _old_and_new(store)  # held for 60 s
    held = store.ensure_resource("run", "long")
    assert store.claim(held, B, 1800) is not None
    with pytest.raises(ValidationError, match=r"longest TTL in use \(1800s"):
        prune(store, 600, respect_ttl=True)
    assert len(store.events(old)) == 2  # nothing deleted
    with pytest.raises(ValidationError, match="respect_ttl must be a bool"):
        prune(store, 3600, respect_ttl="yes")  # type: ignore[arg-type]
    assert prune(store, 600) == 2  # without the check, as before
    assert prune(store, 3600, respect_ttl=True) == 0  # allowed: nothing left that old


def test_a_cursor_a_prune_passed_is_expired(store: Any) -> None:
    old, new = _old_and_new(store)
    first = store.events(old)[0]
    last_new = store.events(new)[-1]
    assert prune(store, 3600) == 2
    with (
        pytest.raises(CursorExpiredError, match="pruned horizon"),
        store.watch(after=first.cursor) as w,
    ):
        w.get(DEADLINE)
    # A cursor at or past the horizon lost nothing and resumes normally.
    with store.watch(after=last_new.cursor) as w:
        claim = store.claim(store.ensure_resource("run", "later"), B, 60)
        assert claim is not None
        got = w.get(DEADLINE)
        assert got is not None and got.resource_id == claim.resource_id
    # "start" means the start of what is left.
    with store.watch(after="start") as w:
        got = w.get(DEADLINE)
        assert got is not None and got.resource_id == new


async def test_async_prune_and_an_expired_cursor(astore: Any) -> None:
    old = await astore.ensure_resource("run", "old")
    claim = await astore.claim(old, A, 60, now=_past(7200))
    assert claim is not None
    await astore.release(claim, now=_past(7199))
    new = await astore.ensure_resource("run", "new")
    assert await astore.claim(new, A, 60) is not None
    first = (await astore.events(old))[0]
    with pytest.raises(ValidationError, match="chunk"):
        await prune_async(astore, 3600, chunk=0)
    with pytest.raises(ValidationError, match="longest TTL in use"):
        await prune_async(astore, 30, respect_ttl=True)  # `new` is held for 60 s
    assert len(await astore.events(old)) == 2
    deleted = await prune_async(astore, 3600, chunk=1)
    assert deleted.events == 2 and deleted.payloads == 0
    assert await astore.events(old) == []
    assert len(await astore.events(new)) == 1
    with pytest.raises(CursorExpiredError, match="pruned horizon"):
        async with astore.watch(after=first.cursor) as w:
            await w.get(DEADLINE)


# --------------------------------------------------------------------------- layering


@pytest.mark.parametrize("module", ["reaper", "prune"])
def test_the_reaper_and_prune_import_no_backend(module: str) -> None:
    """They reach a backend through its runtime driver only: no psycopg, no
    `pglease.postgres`, no `pglease.sqlite`, not even through `watch._core`."""
    import ast
    from pathlib import Path

    import pglease.watch

    path = Path(pglease.watch.__file__).with_name(f"{module}.py")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            imported.add(base)
            imported.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    banned = ("psycopg", "..postgres", "..sqlite", "._core", "pglease.postgres", "pglease.sqlite")
    assert imported, "no imports parsed"
    assert {n for n in imported if n.startswith(banned)} == set()
