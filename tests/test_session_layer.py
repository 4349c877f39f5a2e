"""The session layer (`Session`, `AsyncSession`) over session files and PostgreSQL.

Every behaviour test runs four times: files and PostgreSQL, blocking and
asyncio. The bodies are written once as coroutines; `w()` awaits a result when
the flavour is asyncio and passes a blocking result through, so the same
assertions check both twins on real SQLite files and a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from pglease import AsyncPostgresStore, PostgresStore
from pglease.admin import revoke_lease
from pglease.ids import resource_id
from pglease.sessions import (
    AsyncPostgresSessionRepository,
    AsyncSession,
    AsyncSessionRepository,
    DuplicateIdError,
    Entry,
    InvalidSessionIdError,
    InvalidSessionWriteError,
    LaneValidationError,
    PostgresSessionRepository,
    Session,
    SessionAlreadyClaimedError,
    SessionBusyError,
    SessionCorruptError,
    SessionNotFoundError,
    SessionRepository,
    UnknownEntryError,
    WriterLeaseLostError,
)
from pglease.sessions.pg_core import RESOURCE_TYPE

from .conftest import enable_test_clock

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

CONFIG = {"model": {"provider": "p", "modelId": "m"}, "thinkingLevel": "low", "activeToolNames": []}
IDLE: dict[str, Any] = {"currentOperationId": None, "pendingNextRun": []}
EMPTY_USAGE = {
    "input": 0,
    "output": 0,
    "cacheRead": 0,
    "cacheWrite": 0,
    "totalTokens": 0,
    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
}


async def w(value: Awaitable[T] | T) -> T:
    """Await an asyncio flavour's result; pass a blocking flavour's through."""
    if inspect.isawaitable(value):
        return await value
    return value


class Clock:
    """A settable millisecond clock for session files (lease expiry, timestamps)."""

    def __init__(self, start: int = 1_700_000_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now


@dataclass
class Flavour:
    """One repository flavour: files or PostgreSQL, blocking or asyncio."""

    name: str
    repo: Any
    is_async: bool
    directory: Path | None = None
    clock: Clock | None = None
    dsn: str = ""
    schema: str = ""

    @property
    def is_pg(self) -> bool:
        return self.name.startswith("pg")

    @property
    def session_cls(self) -> Any:
        return AsyncSession if self.is_async else Session

    async def create(self, id: str | None = None) -> Any:
        return await w(self.session_cls.create(self.repo, id))

    async def open(self, session_id: str) -> Any:
        return await w(self.session_cls.open(self.repo, session_id))

    def take_over(self, session_id: str) -> None:
        """Make the current writer lose its lease to someone else."""
        if self.is_pg:
            rid = resource_id(RESOURCE_TYPE, session_id)
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                revoke_lease(conn, self.schema, rid)
                # A revoked lease is claimable only after the revoked writer's
                # last expiry (30 s); the schema owner skips that wait here.
                conn.execute(
                    f'UPDATE "{self.schema}".leases SET revoked_until = NULL'
                    " WHERE resource_id = %s",
                    [rid],
                )
            return
        assert self.clock is not None and self.directory is not None
        self.clock.now += 31_000  # past the 30 s lease: another opener may take it
        other = SessionRepository(self.directory, renew_interval=None, now_ms=self.clock)
        other.open(session_id).close()


FLAVOURS = ["files-sync", "files-async", "pg-sync", "pg-async"]


@pytest.fixture(params=FLAVOURS)
async def flavour(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Flavour]:
    name: str = request.param
    is_async = name.endswith("-async")
    if name.startswith("files"):
        clock = Clock()
        directory = tmp_path / "sessions"
        directory.mkdir()
        if is_async:
            async with AsyncSessionRepository(
                directory, renew_interval=None, now_ms=clock
            ) as arepo:
                yield Flavour(name, arepo, True, directory, clock)
        else:
            with SessionRepository(directory, renew_interval=None, now_ms=clock) as repo:
                yield Flavour(name, repo, False, directory, clock)
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    schema: str = request.getfixturevalue("schema")
    if is_async:
        async with AsyncPostgresStore(dsn, schema=schema, max_size=4) as astore:
            enable_test_clock(dsn, schema)
            async with AsyncPostgresSessionRepository(astore, renew_interval=None) as apg:
                yield Flavour(name, apg, True, dsn=dsn, schema=schema)
    else:
        with PostgresStore(dsn, schema=schema, max_size=4) as store:
            enable_test_clock(dsn, schema)
            with PostgresSessionRepository(store, renew_interval=None) as pg:
                yield Flavour(name, pg, False, dsn=dsn, schema=schema)


def user(text: str) -> dict[str, Any]:
    return {"message": {"role": "user", "content": text}}


def assistant(text: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text, "usage": usage}}


def ids(entries: list[Entry]) -> list[str]:
    return [e.id for e in entries]


# -- append ------------------------------------------------------------------------


async def test_append_writes_the_entry_and_moves_the_leaf_in_one_commit(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    assert await w(s.leaf()) is None
    assert await w(s.branch()) == []
    before = (await w(s.handle.stats())).next_seq
    revision = s.handle.revision if flavour.is_pg else 0
    first = await w(s.append("main", "message", user("hello")))
    stats = await w(s.handle.stats())
    if flavour.is_pg:  # one fenced mutate: one revision, one event with both writes
        assert s.handle.revision == revision + 1
        events = await w(flavour.repo.store.events(resource_id(RESOURCE_TYPE, "s1"), revision))
        assert [(e.type, e.payload["entries"], e.payload["registers"]) for e in events] == [
            ("session.commit", 1, 1)
        ]
    # one commit: the entry at next_seq, the leaf register right after it
    assert first.seq == before and stats.next_seq == before + 2
    leaf_register = await w(s.get_register("lane.leaf", "main"))
    assert leaf_register.value == first.id and leaf_register.seq == first.seq + 1
    assert first.parent_id is None
    assert await w(s.handle.get_entry(first.id)) == first  # what append returned is what is stored

    second = await w(s.append("main", "message", user("again")))
    third = await w(s.append("main", "custom", {"data": {"n": 1}}, custom_type="note"))
    assert second.parent_id == first.id and third.parent_id == second.id
    assert await w(s.leaf("main")) == third.id
    assert await w(s.branch("main")) == [first, second, third]
    assert await w(s.handle.get_entry(third.id)) == third
    await w(s.close())
    assert s.closed


async def test_append_with_usage_fills_the_ledger_in_the_same_commit(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    usage = {"input": 3, "output": 4, "totalTokens": 7, "cost": {"total": 0.5}}
    entry = await w(s.append("main", "message", assistant("hi", usage), usage=usage))
    leaf = await w(s.get_register("lane.leaf", "main"))
    (row,) = await w(s.handle.usage_rows())
    assert (row.entry_id, row.seq, leaf.seq) == (entry.id, entry.seq + 1, entry.seq + 2)
    totals = await w(s.usage())
    assert totals["input"] == 3 and totals["totalTokens"] == 7 and totals["cost"]["total"] == 0.5
    await w(s.close())


async def test_a_refused_append_changes_nothing(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    a = await w(s.append("main", "message", user("a"), id="a"))
    before = await w(s.handle.stats())
    with pytest.raises(DuplicateIdError):
        await w(s.append("main", "message", user("again"), id="a"))
    with pytest.raises(InvalidSessionWriteError, match="missing field"):
        await w(s.append("main", "message", {"text": "no message field"}))
    with pytest.raises(InvalidSessionWriteError, match="entry type"):
        await w(s.append("main", "note", {}))
    with pytest.raises(InvalidSessionWriteError, match="custom_type"):
        await w(s.append("main", "custom", {}))
    with pytest.raises(InvalidSessionWriteError, match="usage field input"):
        await w(s.append("main", "message", user("u"), usage={"input": "many"}))
    with pytest.raises(LaneValidationError, match="no lane 'side'"):
        await w(s.append("side", "message", user("x")))
    with pytest.raises(InvalidSessionWriteError, match="lane name"):
        await w(s.append("", "message", user("x")))
    assert await w(s.handle.stats()) == before
    assert await w(s.leaf()) == a.id
    await w(s.close())


async def test_a_writer_that_lost_its_lease_writes_nothing(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    a = await w(s.append("main", "message", user("a")))
    with pytest.raises(SessionAlreadyClaimedError, match="already claimed by writer"):
        await flavour.open("s1")
    flavour.take_over("s1")
    with pytest.raises(WriterLeaseLostError, match="writer lease was lost"):
        await w(s.append("main", "message", user("late")))
    with pytest.raises(WriterLeaseLostError):
        await w(s.leaf())  # the handle refuses all further work
    await w(s.close())  # never releases the successor's lease, never raises
    if flavour.clock is not None:
        flavour.clock.now += 31_000  # the successor above closed; its lease is gone anyway
    again = await flavour.open("s1")
    assert await w(again.leaf()) == a.id
    assert ids(await w(again.branch())) == [a.id]
    await w(again.close())


async def test_concurrent_appends_to_one_lane_form_one_chain(flavour: Flavour) -> None:
    """Appends from several threads (or tasks) on one session never read the
    same leaf: the lane's branch is one chain holding every entry."""
    s = await flavour.create("s1")
    count = 12
    if flavour.is_async:
        made = await asyncio.gather(
            *(s.append("main", "message", user(f"t{i}")) for i in range(count))
        )
    else:
        with ThreadPoolExecutor(max_workers=4) as pool:
            made = list(
                pool.map(lambda i: s.append("main", "message", user(f"t{i}")), range(count))
            )
    branch = await w(s.branch())
    assert sorted(ids(branch)) == sorted(ids(made)) and len(branch) == count
    assert all(e.parent_id == p.id for p, e in itertools.pairwise(branch))
    await w(s.close())


# -- lanes, labels, registers ---------------------------------------------------------


async def test_lanes_leaves_and_lane_registers(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    a = await w(s.append("main", "message", user("a")))
    b = await w(s.append("main", "message", user("b")))
    assert await w(s.lanes()) == ["main"]
    await w(s.add_lane("side", CONFIG, at=a.id))
    await w(s.add_lane("aaa", CONFIG))
    assert await w(s.lanes()) == ["main", "aaa", "side"]
    assert await w(s.leaf("side")) == a.id and await w(s.leaf("aaa")) is None
    assert await w(s.lane_config("side")) == CONFIG
    assert await w(s.lane_config("main")) is None  # a new session writes no lane.config/main
    assert await w(s.lane_state("side")) == IDLE and await w(s.lane_state()) == IDLE
    assert await w(s.last_result("side")) is None

    x = await w(s.append("side", "message", user("x")))
    assert x.parent_id == a.id
    assert ids(await w(s.branch("side"))) == [a.id, x.id]
    assert ids(await w(s.branch("main"))) == [a.id, b.id]  # other lanes do not move

    # moving a leaf back makes the next append a new branch
    await w(s.set_leaf("main", a.id))
    c = await w(s.append("main", "message", user("c")))
    assert c.parent_id == a.id and ids(await w(s.branch())) == [a.id, c.id]
    await w(s.set_leaf("aaa", None))

    before = await w(s.handle.stats())
    with pytest.raises(InvalidSessionWriteError, match="already has lane 'side'"):
        await w(s.add_lane("side", CONFIG))
    with pytest.raises(UnknownEntryError, match="nope"):
        await w(s.add_lane("new", CONFIG, at="nope"))
    with pytest.raises(UnknownEntryError, match="nope"):
        await w(s.set_leaf("main", "nope"))
    with pytest.raises(LaneValidationError, match="no lane 'ghost'"):
        await w(s.set_leaf("ghost", a.id))
    with pytest.raises(LaneValidationError):
        await w(s.branch("ghost"))
    assert await w(s.handle.stats()) == before
    assert "new" not in await w(s.lanes())
    await w(s.close())


async def test_labels_name_custom_and_raw_registers(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    a = await w(s.append("main", "message", user("a")))
    b = await w(s.append("main", "message", user("b")))
    assert await w(s.labels()) == {} and await w(s.label(a.id)) is None
    await w(s.set_label(a.id, "start"))
    await w(s.set_label(b.id, "then"))
    assert await w(s.labels()) == {a.id: "start", b.id: "then"}
    assert await w(s.label(b.id)) == "then"
    await w(s.set_label(b.id, None))
    assert await w(s.labels()) == {a.id: "start"}
    assert (await w(s.get_register("fact.label", a.id))).value == "start"

    assert await w(s.name()) is None
    await w(s.set_name("My session"))
    assert await w(s.name()) == "My session"
    assert (await w(s.get_register("fact.name", ""))).value == "My session"
    await w(s.set_custom("color", {"v": "blue"}))
    assert await w(s.custom("color")) == {"v": "blue"} and await w(s.custom("other")) is None

    seq = await w(s.set_register("op.meta", "op1", {"x": 1}))
    assert (await w(s.get_register("op.meta", "op1"))).seq == seq
    assert [r.key for r in await w(s.list_registers("op.meta", "op"))] == ["op1"]
    await w(s.delete_register("op.meta", "op1"))
    assert await w(s.get_register("op.meta", "op1")) is None

    before = await w(s.handle.stats())
    with pytest.raises(UnknownEntryError, match="nope"):
        await w(s.set_label("nope", "x"))
    with pytest.raises(InvalidSessionWriteError, match="label"):
        await w(s.set_label(a.id, ""))
    with pytest.raises(InvalidSessionWriteError, match="label"):
        await w(s.set_label(a.id, 3))
    with pytest.raises(InvalidSessionWriteError, match="name"):
        await w(s.set_name(None))
    with pytest.raises(InvalidSessionWriteError, match="not JSON serialisable"):
        await w(s.set_custom("k", {1, 2}))
    # A lone surrogate cannot be stored as UTF-8, and a value nested past the
    # recursion limit cannot be serialised: both refused as bad input, not as a
    # UnicodeEncodeError or RecursionError from deep inside.
    lone = "\ud800"
    with pytest.raises(InvalidSessionWriteError, match=r"^lane name must be a non-empty UTF-8"):
        await w(s.add_lane(lone, {}))
    with pytest.raises(InvalidSessionWriteError, match=r"^entry id must be a non-empty UTF-8"):
        await w(s.set_label(lone, "x"))
    with pytest.raises(InvalidSessionWriteError, match=r"^a label must be a non-empty UTF-8"):
        await w(s.set_label(a.id, lone))
    with pytest.raises(InvalidSessionWriteError, match=r"^register key must be a UTF-8"):
        await w(s.set_custom(lone, 1))
    nested: object = {}
    for _ in range(100_000):
        nested = {"a": nested}
    with pytest.raises(InvalidSessionWriteError, match=r"^a session name must be a string, got"):
        await w(s.set_name(nested))  # type: ignore[arg-type]
    with pytest.raises(InvalidSessionWriteError, match="nested too deeply"):
        await w(s.set_custom("k", nested))
    assert await w(s.handle.stats()) == before

    # a label some other writer stored as a non-string is reported, not guessed at
    await w(s.set_register("fact.label", b.id, 7))
    with pytest.raises(SessionCorruptError, match="not a string"):
        await w(s.labels())
    await w(s.close())


async def test_usage_totals_and_branch_usage(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    u1 = {"input": 10, "output": 5, "totalTokens": 15, "cost": {"input": 0.5, "total": 0.5}}
    u2 = {"input": 1, "output": 2, "totalTokens": 3, "reasoning": 2, "cost": {"total": 0.25}}
    await w(s.append("main", "message", user("q")))
    a1 = await w(s.append("main", "message", assistant("a", u1), usage=u1))
    compaction = {
        "summary": "s",
        "retainedTail": [],
        "tokensBefore": 100,
        "fromHook": False,
        "usage": u2,
    }
    await w(s.append("main", "compaction", compaction, usage=u2))
    await w(s.add_lane("side", CONFIG, at=a1.id))
    await w(s.append("side", "message", assistant("b", u2)))  # carried, not in the ledger

    main = await w(s.branch_usage())
    assert main["input"] == 11 and main["output"] == 7 and main["totalTokens"] == 18
    assert main["reasoning"] == 2 and main["cost"]["total"] == 0.75
    side = await w(s.branch_usage("side"))
    assert side["input"] == 11 and side["totalTokens"] == 18
    ledger = await w(s.usage())
    assert ledger == main  # the ledger holds what was passed as usage=

    empty = await flavour.create("s2")
    assert await w(empty.usage()) == EMPTY_USAGE and await w(empty.branch_usage()) == EMPTY_USAGE
    await w(empty.append("main", "message", assistant("bad", {"input": "lots"})))
    with pytest.raises(SessionCorruptError, match="malformed usage"):
        await w(empty.branch_usage())
    await w(empty.close())
    await w(s.close())


# -- fork -----------------------------------------------------------------------------


async def test_fork_defaults_to_the_lanes_leaf(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    built = [await w(s.append("main", "message", user(t))) for t in "abc"]
    await w(s.set_label(built[1].id, "middle"))
    await w(s.set_name("source"))
    f = await w(s.fork(id="f1"))
    assert f.id == "f1"
    assert await w(f.branch()) == built  # ids, parents, seqs, timestamps, payloads
    assert await w(f.leaf()) == built[-1].id
    assert await w(f.labels()) == {built[1].id: "middle"} and await w(f.name()) == "source"
    assert (await w(f.handle.stats())).parent_session_id == "s1"
    await w(f.close())

    # The handle alone does not move the leaf: a default fork then copies nothing.
    # The layer exists to make that impossible.
    raw = await w(flavour.repo.create("raw"))
    await w(raw.append_message(None, {"role": "user", "content": "lost"}))
    raw_fork = await w(flavour.repo.fork("raw", id="raw-fork"))
    assert (await w(raw_fork.stats())).entry_count == 0
    await w(raw_fork.close())
    await w(raw.close())
    await w(s.close())


async def test_fork_of_a_lane_mid_branch(flavour: Flavour) -> None:
    s = await flavour.create("s1")
    a, b, c, d = [await w(s.append("main", "message", user(t))) for t in "abcd"]
    await w(s.add_lane("side", CONFIG, at=b.id))
    x = await w(s.append("side", "message", user("x")))
    y = await w(s.append("side", "custom", {"data": 1}, custom_type="note"))
    await w(s.set_label(c.id, "not copied"))
    await w(s.set_label(x.id, "copied"))

    # at an entry in the middle of main's branch
    mid = await w(s.fork(at=b.id, id="mid"))
    assert await w(mid.branch()) == [a, b]
    assert await w(mid.lanes()) == ["main"] and await w(mid.labels()) == {}
    e = await w(mid.append("main", "message", user("e")))
    assert e.parent_id == b.id and ids(await w(mid.branch())) == [a.id, b.id, e.id]
    await w(mid.close())

    # a lane's leaf, and its parent, and an entry on that lane's branch
    side = await w(s.fork(lane="side", id="side"))
    assert await w(side.branch()) == [a, b, x, y]
    assert await w(side.labels()) == {x.id: "copied"}
    await w(side.close())
    before = await w(s.fork(lane="side", position="before", id="side-before"))
    assert await w(before.branch()) == [a, b, x]
    await w(before.close())
    at_x = await w(s.fork(lane="side", at=x.id, position="before", id="at-x"))
    assert await w(at_x.branch()) == [a, b]
    await w(at_x.close())

    # a whole tree: every entry and lane
    tree = await w(s.fork(scope="tree", id="tree"))
    assert await w(tree.lanes()) == ["main", "side"]
    assert await w(tree.branch("side")) == [a, b, x, y]
    assert await w(tree.branch()) == [a, b, c, d]
    await w(tree.close())

    # an empty lane forks to an empty session, not to main's branch
    await w(s.add_lane("empty", CONFIG))
    empty = await w(s.fork(lane="empty", id="empty"))
    assert await w(empty.branch()) == [] and (await w(empty.handle.stats())).entry_count == 0
    await w(empty.close())

    with pytest.raises(InvalidSessionWriteError, match="lane 'empty': the lane is empty"):
        await w(s.fork(lane="empty", position="before", id="nope1"))
    with pytest.raises(InvalidSessionWriteError, match="branch scope only"):
        await w(s.fork(scope="tree", at=a.id, id="nope2"))
    with pytest.raises(InvalidSessionWriteError, match="fork scope"):
        await w(s.fork(scope="forest", id="nope3"))
    with pytest.raises(UnknownEntryError):
        await w(s.fork(at="missing", id="nope4"))
    with pytest.raises(LaneValidationError):
        await w(s.fork(lane="ghost", id="nope5"))
    for refused in ("nope1", "nope2", "nope3", "nope4", "nope5"):
        with pytest.raises(Exception, match="does not exist"):
            await flavour.open(refused)
    await w(s.close())


# -- two processes -------------------------------------------------------------------

WRITER = """
import asyncio, sys
from pglease.sessions import (
    AsyncPostgresSessionRepository, AsyncSession, AsyncSessionRepository,
    PostgresSessionRepository, Session, SessionRepository, SessionAlreadyClaimedError,
)
from pglease import AsyncPostgresStore, PostgresStore

flavour, target, schema = sys.argv[1], sys.argv[2], sys.argv[3]

def say(*words):
    print(*words, flush=True)

async def work(session):
    say("OPENED", session.handle.owner_id)
    while (line := sys.stdin.readline().strip()) and line != "close":
        entry = session.append("main", "message", {"message": {"role": "user", "content": line}})
        if asyncio.iscoroutine(entry):
            entry = await entry
        say("APPENDED", entry.id, entry.parent_id)
    closed = session.close()
    if asyncio.iscoroutine(closed):
        await closed
    say("CLOSED")

async def main():
    try:
        if flavour == "files-sync":
            with SessionRepository(target) as repo:
                await work(Session.open(repo, "shared"))
        elif flavour == "files-async":
            async with AsyncSessionRepository(target) as arepo:
                await work(await AsyncSession.open(arepo, "shared"))
        elif flavour == "pg-sync":
            with PostgresStore(target, schema=schema, max_size=2) as store:
                await work(Session.open(PostgresSessionRepository(store), "shared"))
        else:
            async with AsyncPostgresStore(target, schema=schema, max_size=2) as astore:
                repo = AsyncPostgresSessionRepository(astore)
                await work(await AsyncSession.open(repo, "shared"))
    except SessionAlreadyClaimedError as exc:
        say("HELD", type(exc).__name__, exc)

asyncio.run(main())
"""


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


def expect(proc: subprocess.Popen[str], word: str) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the caller's test timeout, and each child exits
    if not line.startswith(word):
        proc.kill()
        _, err = proc.communicate(timeout=60)
        raise AssertionError(f"expected {word}, got {line!r}; stderr: {err}")
    return line.split()


def send(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(text + "\n")
    proc.stdin.flush()


@pytest.mark.timeout(240)
async def test_second_process_gets_the_writer_lease_error(flavour: Flavour) -> None:
    """Two real processes open one session for writing: the second is refused
    while the first holds it, then gets it once the first has closed."""
    created = await flavour.create("shared")
    await w(created.close())
    target = flavour.dsn if flavour.is_pg else str(flavour.directory)
    args = (flavour.name, target, flavour.schema or "-")
    first = spawn(*args)
    owner = expect(first, "OPENED")[1]
    send(first, "one")
    one = expect(first, "APPENDED")[1]

    second = spawn(*args)
    out, err = second.communicate(timeout=120)
    assert out.startswith("HELD SessionAlreadyClaimedError"), (out, err)
    assert f"already claimed by writer {owner}" in out
    assert second.returncode == 0, err

    send(first, "two")
    two, parent = expect(first, "APPENDED")[1:3]
    assert parent == one  # the first writer was not disturbed
    send(first, "close")
    expect(first, "CLOSED")
    assert first.wait(timeout=60) == 0

    third = spawn(*args)
    expect(third, "OPENED")
    send(third, "three")
    three, parent = expect(third, "APPENDED")[1:3]
    assert parent == two
    send(third, "close")
    expect(third, "CLOSED")
    assert third.wait(timeout=60) == 0

    s = await flavour.open("shared")  # the last writer released its lease
    assert ids(await w(s.branch())) == [one, two, three]
    await w(s.close())


# -- across stores -------------------------------------------------------------------


async def build_through_the_layer(s: Any) -> None:
    usage = {"input": 2, "output": 3, "totalTokens": 5}
    a = await w(s.append("main", "message", user("a")))
    await w(s.append("main", "message", assistant("b", usage), usage=usage))
    await w(s.add_lane("side", CONFIG, at=a.id))
    x = await w(s.append("side", "message", user("x")))
    await w(s.append("main", "branch_summary", {"fromId": x.id, "summary": "s", "fromHook": True}))
    await w(s.set_label(a.id, "first"))
    await w(s.set_label(x.id, "side one"))
    await w(s.set_name("round trip"))
    await w(s.set_custom("k", [1, "two", None]))
    await w(s.set_register("lane.lastResult", "main", {"ok": True}))  # not copied by forks
    await w(s.set_register("op.meta", "op1", {"x": 1}))  # nor this


async def view(s: Any) -> dict[str, Any]:
    """Everything a fork keeps: lanes with branches, leaves, configs, facts."""
    lanes = await w(s.lanes())
    return {
        "lanes": lanes,
        "branches": {lane: await w(s.branch(lane)) for lane in lanes},
        "configs": {lane: await w(s.lane_config(lane)) for lane in lanes},
        "states": {lane: await w(s.lane_state(lane)) for lane in lanes},
        "labels": await w(s.labels()),
        "name": await w(s.name()),
        "custom": await w(s.custom("k")),
    }


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_round_trip_postgres_file_postgres(
    pg_dsn: str, schema: str, tmp_path: Path, is_async: bool
) -> None:
    """A session built through the layer in PostgreSQL, exported to a file,
    worked on there, imported back: branches and registers survive."""
    files = SessionRepository(tmp_path, renew_interval=None)
    if is_async:
        async with AsyncPostgresStore(pg_dsn, schema=schema, max_size=4) as astore:
            apg = AsyncPostgresSessionRepository(astore, renew_interval=None)
            source = await AsyncSession.create(apg, "src")
            await build_through_the_layer(source)
            original = await view(source)
            path = await apg.export_to_file("src", tmp_path, id="local")
            local = Session.open(files, "local")
            await check_and_extend(local, original)
            local_view = await view(local)
            local.close()
            back = AsyncSession(await apg.import_file(path, id="back"), apg)
            assert await view(back) == local_view
            assert (await back.handle.stats()).parent_session_id == "local"
            assert await back.usage() == EMPTY_USAGE  # forks never copy the ledger
            await back.close()
            await source.close()
    else:
        with PostgresStore(pg_dsn, schema=schema, max_size=4) as store:
            pg = PostgresSessionRepository(store, renew_interval=None)
            sync_source = Session.create(pg, "src")
            await build_through_the_layer(sync_source)
            original = await view(sync_source)
            path = pg.export_to_file("src", tmp_path, id="local")
            local = Session.open(files, "local")
            await check_and_extend(local, original)
            local_view = await view(local)
            local.close()
            sync_back = Session(pg.import_file(path, id="back"), pg)
            assert await view(sync_back) == local_view
            assert sync_back.handle.stats().parent_session_id == "local"
            assert sync_back.usage() == EMPTY_USAGE
            sync_back.close()
            sync_source.close()
    files.close()


async def check_and_extend(local: Session, original: dict[str, Any]) -> None:
    assert await view(local) == original
    assert local.last_result() is None and local.get_register("op.meta", "op1") is None
    assert local.handle.stats().parent_session_id == "src"
    # local work on the file, through the same layer
    leaf = local.leaf()
    y = local.append("main", "message", user("offline"))
    assert y.parent_id == leaf
    z = local.append("side", "message", user("offline side"))
    local.set_label(z.id, "offline")


async def test_async_file_repository_lists_and_deletes(tmp_path: Path) -> None:
    async with AsyncSessionRepository(tmp_path, renew_interval=None) as repo:
        s = await AsyncSession.create(repo, "one")
        await s.append("main", "message", user("a"))
        assert await repo.exists("one") and not await repo.exists("two")
        with pytest.raises(SessionBusyError):
            await repo.delete("one")  # open for writing
        await s.close()
        assert (await repo.list()).ids() == ["one"]
        assert repo.path_for("one") == tmp_path / "one.sqlite"
        await repo.delete("one")
        assert (await repo.list()).ids() == []
        with pytest.raises(SessionNotFoundError):
            await AsyncSession.open(repo, "one")
        with pytest.raises(InvalidSessionIdError):
            await repo.create("../escape")
