"""The asyncio twin of the PostgreSQL session store, against the sync one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pglease import AsyncPostgresStore, PostgresStore
from pglease.sessions import (
    AddUsage,
    AppendEntry,
    AsyncPostgresSession,
    AsyncPostgresSessionRepository,
    DuplicateIdError,
    InvalidSessionWriteError,
    PostgresSessionRepository,
    SessionAlreadyClaimedError,
    SessionBusyError,
    SessionExistsError,
    SessionRepository,
    SetRegister,
    UnknownEntryError,
    WriterLeaseLostError,
)

from .conformance.test_sessions import QUERIES, Clock, msg
from .test_session_branch_index import reference

SPEC = [
    ("a", None, "message"),
    ("b", "a", "message"),
    ("c", "b", "compaction"),
    ("d", "c", "message"),
    ("e", "d", "custom"),
    ("f", "b", "message"),
    ("g", "d", "message"),
    ("h", "g", "compaction"),
    ("i", "h", "message"),
    ("j", "e", "message"),
    ("k", "i", "branch_summary"),
    ("l", "c", "message"),
]


def tree_writes() -> list[AppendEntry]:
    writes = []
    for entry_id, parent, type_ in SPEC:
        payloads: dict[str, dict[str, Any]] = {
            "message": {"message": msg(entry_id)},
            "compaction": {
                "summary": "s",
                "retainedTail": [],
                "tokensBefore": 1,
                "fromHook": False,
            },
            "branch_summary": {"fromId": "a", "summary": "x", "fromHook": True},
            "custom": {"data": entry_id},
        }
        payload = payloads[type_]
        custom = "note" if type_ == "custom" else None
        writes.append(AppendEntry(type_, parent, payload, custom, entry_id))
    return writes


@pytest.fixture
async def arepo(apg_store: AsyncPostgresStore) -> AsyncIterator[AsyncPostgresSessionRepository]:
    async with AsyncPostgresSessionRepository(
        apg_store, renew_interval=None, now_ms=Clock()
    ) as repo:
        yield repo


async def test_async_commits_and_scans_match_the_sync_store(
    arepo: AsyncPostgresSessionRepository, pg_dsn: str, schema: str
) -> None:
    session = await arepo.create("s")
    writes = tree_writes()
    # divergences inside one commit and across commits go through the replaying index
    await session.commit(writes[:5])
    await session.commit(writes[5:])
    usage = await session.add_usage({"input": 4}, entry_id="a")
    assert usage.seq == 15
    assert await session.set_register("fact.name", "", "N") == 16
    assert await session.delete_register("fact.name", "") == 17
    entries = {e.id: e for e in await session.scan_entries()}
    assert [e.seq for e in entries.values()] == list(range(3, 15))
    for leaf in entries:
        for query in QUERIES:
            got = await session.scan_branch(
                leaf,
                newest_first=query.newest_first,
                stop_type=query.stop_type,
                stop_id=query.stop_id,
                types=query.types,
                custom_type=query.custom_type,
                cursor=query.cursor,
                limit=query.limit,
            )
            assert [e.id for e in got] == reference(entries, leaf, query), (leaf, query)
    stats = await session.stats()
    assert (stats.next_seq, stats.entry_count, stats.usage["input"]) == (18, 12, 4)
    # the same writes through the sync store give the same rows
    with (
        PostgresStore(pg_dsn, schema=schema, max_size=2) as store,
        PostgresSessionRepository(store, renew_interval=None, now_ms=Clock()) as sync,
        sync.create("t") as twin,
    ):
        twin.commit(writes[:5])
        twin.commit(writes[5:])
        assert twin.snapshot().entries == (await session.snapshot()).entries
        for leaf in entries:
            assert [e.id for e in twin.scan_branch(leaf)] == [
                e.id for e in await session.scan_branch(leaf)
            ]
    await session.close()


async def test_async_failures_roll_back_and_fence(
    arepo: AsyncPostgresSessionRepository, apg_store: AsyncPostgresStore
) -> None:
    session = await arepo.create("s")
    await session.append_message(None, msg("a"), id="a")
    revision = (await apg_store.get(session.resource_id)).revision
    with pytest.raises(UnknownEntryError):
        await session.commit(
            [
                AppendEntry("message", "a", {"message": 1}, id="b"),
                AppendEntry("message", "x", {"message": 2}),
            ]
        )
    with pytest.raises(DuplicateIdError):
        await session.commit([AddUsage({"input": 1}, id="a")])
    assert (await apg_store.get(session.resource_id)).revision == revision
    assert await session.get_entry("b") is None
    with pytest.raises(InvalidSessionWriteError):
        await session.scan_entries(limit="3")  # type: ignore[arg-type]
    with pytest.raises(InvalidSessionWriteError):
        await session.scan_branch("a", limit=-1)
    with pytest.raises(SessionAlreadyClaimedError, match="already held"):
        await arepo.open("s")
    with pytest.raises(SessionExistsError):
        await arepo.create("s")
    with pytest.raises(SessionBusyError):
        await arepo.delete("s")
    await session.close()
    short = AsyncPostgresSessionRepository(apg_store, lease_seconds=0.3, renew_interval=None)
    first = await short.open("s")
    await asyncio.sleep(0.4)
    second = await arepo.open("s")
    assert second.fence == first.fence + 1
    with pytest.raises(WriterLeaseLostError):
        await first.commit([SetRegister("x", "y", 1)])
    assert first.lost.is_set()
    await first.close()
    assert (await second.append_message("a", msg("mine"))).seq == 4
    await second.close()
    await arepo.delete("s")
    assert (await arepo.list()).ids() == []


async def test_async_heartbeat_keeps_the_lease(apg_store: AsyncPostgresStore) -> None:
    # 2 s rather than less: one stall of a loaded host must not lose it.
    repo = AsyncPostgresSessionRepository(apg_store, lease_seconds=2, renew_interval=0.25)
    async with await repo.create("s") as session:
        assert isinstance(session, AsyncPostgresSession)
        await asyncio.sleep(2.5)
        assert not session.lost.is_set()
        await session.append_message(None, msg("still mine"))
    waited_repo = AsyncPostgresSessionRepository(apg_store, lease_seconds=5, renew_interval=None)
    holder = await waited_repo.open("s")
    asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(holder.close()))
    async with await waited_repo.open("s", wait=5) as waited:
        assert waited.fence == holder.fence + 1


async def test_async_cross_store_round_trip(
    arepo: AsyncPostgresSessionRepository, tmp_path: Path
) -> None:
    async with await arepo.create("orig") as source:
        await source.commit(tree_writes())
        await source.set_register("lane.leaf", "main", "k")
        await source.set_register("fact.label", "b", "label")
    path = await arepo.fork_to_file("orig", tmp_path, "branch", "i", "before", id="f")
    files = SessionRepository(tmp_path, renew_interval=None)
    assert [e.id for e in files.snapshot("f").entries] == ["a", "b", "c", "d", "g", "h"]
    exported = await arepo.export_to_file("orig", tmp_path, id="all")
    async with await arepo.import_file(exported, id="back") as back:
        snapshot = await back.snapshot()
        assert snapshot.entries == (await arepo.snapshot("orig")).entries
        assert snapshot.parent_session_id == "all"
        leaf = await back.get_register("lane.leaf", "main")
        assert leaf is not None and leaf.value == "k"
        assert [r.key for r in await back.list_registers("fact.label")] == ["b"]
    async with await arepo.fork("orig", id="pgfork") as fork:
        assert [e.id for e in await fork.scan_entries()] == ["a", "b", "c", "d", "g", "h", "i", "k"]
    assert path.exists()
    info = await arepo.info("back")
    assert info.lease is None and info.parent_session_id == "all"
