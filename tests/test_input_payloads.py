"""No poison events: writers may not nest payloads beyond MAX_PAYLOAD_DEPTH, and
readers deliver every stored payload, even one nested too deeply for json.loads
(stored before the limit existed), as a RawPayload instead of raising."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from typing import Any

import psycopg
import pytest

from pglease import Event, InvalidPayloadError, Permit
from pglease.payloads import (
    MAX_PAYLOAD_DEPTH,
    RawPayload,
    canonical_payload,
    check_payload_depth,
    decode_payload,
)

from .backends import Backend, PostgresBackend, SqliteBackend

#: Far beyond what json.loads can recurse into with any default recursion limit.
DEEP_TEXT = "[" * 100_000 + "]" * 100_000
#: Generous bound for a watcher to deliver an event that is already committed; a
#: healthy run returns as soon as it arrives.
WAIT = 60.0


def nest_lists(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def nest_dicts(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


# --- the write-side limit ------------------------------------------------------------


@pytest.mark.parametrize("nest", [nest_lists, nest_dicts])
def test_depth_limit_is_exact(nest: Any) -> None:
    canonical_payload(nest(MAX_PAYLOAD_DEPTH))
    with pytest.raises(InvalidPayloadError, match=f"more than {MAX_PAYLOAD_DEPTH} levels"):
        canonical_payload(nest(MAX_PAYLOAD_DEPTH + 1))


def test_scalars_and_flat_values_have_no_depth() -> None:
    for value in [None, 1, "x", 1.5, True, [1, 2, 3], {"a": 1}, (1, 2)]:
        check_payload_depth(value)


def test_mixed_nesting_counts_arrays_and_objects() -> None:
    value: Any = 1
    for i in range(MAX_PAYLOAD_DEPTH):
        value = [value] if i % 2 else {"k": value}
    canonical_payload(value)
    with pytest.raises(InvalidPayloadError):
        canonical_payload([value])


def test_one_deep_branch_among_wide_ones_is_found() -> None:
    wide = {f"k{i}": list(range(50)) for i in range(200)}
    wide["deep"] = nest_lists(MAX_PAYLOAD_DEPTH + 1)
    with pytest.raises(InvalidPayloadError):
        canonical_payload(wide)


def test_a_100000_deep_list_is_refused_without_recursion() -> None:
    with pytest.raises(InvalidPayloadError):
        canonical_payload(nest_lists(100_000))
    deep_tuple: Any = ()
    for _ in range(100_000):
        deep_tuple = (deep_tuple,)
    with pytest.raises(InvalidPayloadError):
        canonical_payload(deep_tuple)


def test_cycles_are_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidPayloadError):
        canonical_payload(loop)
    d: dict[str, Any] = {}
    d["self"] = d
    with pytest.raises(InvalidPayloadError):
        canonical_payload({"a": d})


def test_store_refuses_too_deep_payloads_and_keeps_the_limit(backend: Backend) -> None:
    s = backend.store
    rid = s.ensure_resource("run", "depth")
    for payload in (nest_lists(MAX_PAYLOAD_DEPTH + 1), nest_lists(100_000)):
        with pytest.raises(InvalidPayloadError):
            s.mutate(Permit(rid, 0), "run.deep", payload=payload)
    assert s.get(rid).revision == 0 and s.events(rid) == []
    assert backend.payload_count() == 0  # type: ignore[attr-defined]
    deepest = nest_dicts(MAX_PAYLOAD_DEPTH)
    s.mutate(Permit(rid, 0), "run.deep", payload=deepest)
    assert s.events(rid)[0].payload == deepest
    assert s.events_after()[0].payload == deepest


# --- decoding never raises -------------------------------------------------------------


def test_decode_payload() -> None:
    assert decode_payload(None) is None
    assert decode_payload('{"a":[1,2]}') == {"a": [1, 2]}
    deep = decode_payload(DEEP_TEXT)
    assert isinstance(deep, RawPayload) and deep.text == DEEP_TEXT and "deep" in deep.reason
    broken = decode_payload('{"a":')
    assert isinstance(broken, RawPayload) and broken.text == '{"a":' and str(broken) == '{"a":'


def _inject_postgres(b: PostgresBackend, rid: str, body: str) -> int:
    """Store `body` as the next event of `rid` the way an older pglease (no depth
    limit) would have: straight into the tables, as the schema owner."""
    s = psycopg.sql.Identifier(b.schema)
    with psycopg.connect(b.dsn) as conn:  # one transaction, committed on exit
        sha = hashlib.sha256(body.encode()).digest()
        conn.execute(
            psycopg.sql.SQL(
                "INSERT INTO {s}.payloads (sha256, body) VALUES (%s, %s) ON CONFLICT DO NOTHING"
            ).format(s=s),
            [sha, body],
        )
        row = conn.execute(
            psycopg.sql.SQL(
                "UPDATE {s}.leases x SET revision = coalesce(x.revision, (SELECT r.revision"
                " FROM {s}.resources r WHERE r.id = x.resource_id)) + 1,"
                " updated_at = clock_timestamp(), last_xid = pg_current_xact_id()"
                " WHERE x.resource_id = %s RETURNING x.revision"
            ).format(s=s),
            [rid],
        ).fetchone()
        assert row is not None
        conn.execute(
            psycopg.sql.SQL(
                "INSERT INTO {s}.events (resource_id, revision, type, payload_sha256)"
                " VALUES (%s, %s, 'run.poison', %s)"
            ).format(s=s),
            [rid, row[0], sha],
        )
        return int(row[0])


def _inject_sqlite(b: SqliteBackend, rid: str, body: str) -> int:
    now = time.time_ns() // 1000
    sha = hashlib.sha256(body.encode()).digest()
    conn = sqlite3.connect(b.path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO payloads (sha256, body, created_at) VALUES (?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            (sha, body, now),
        )
        (revision,) = conn.execute(
            "UPDATE resources SET revision = revision + 1, updated_at = ? WHERE id = ?"
            " RETURNING revision",
            (now, rid),
        ).fetchone()
        conn.execute(
            "INSERT INTO events (resource_id, revision, type, payload_sha256, created_at)"
            " VALUES (?, ?, 'run.poison', ?, ?)",
            (rid, revision, sha, now),
        )
        conn.execute("COMMIT")
        return int(revision)
    finally:
        conn.close()


def inject(b: Backend, rid: str, body: str) -> int:
    if isinstance(b, PostgresBackend):
        return _inject_postgres(b, rid, body)
    assert isinstance(b, SqliteBackend)
    return _inject_sqlite(b, rid, body)


class _Consumer:
    """A watcher of the backend's own kind (sync or asyncio) from the log's start."""

    def __init__(self, b: Backend) -> None:
        self.b = b
        if b.is_async:
            astore = b.store._store  # the asyncio store behind the test bridge

            async def open_() -> Any:
                watcher = astore.watch(after="start")
                await watcher.__aenter__()
                return watcher

            self.watcher = b._loop.run(open_())  # type: ignore[attr-defined]
        else:
            self.watcher = b.store.watch(after="start").__enter__()

    def get(self) -> Event:
        if self.b.is_async:
            event = self.b._loop.run(self.watcher.get(WAIT))  # type: ignore[attr-defined]
        else:
            event = self.watcher.get(WAIT)
        assert event is not None, f"no event within {WAIT} s"
        assert isinstance(event, Event)
        return event

    def close(self) -> None:
        if self.b.is_async:
            self.b._loop.run(self.watcher.aclose())  # type: ignore[attr-defined]
        else:
            self.watcher.close()


@pytest.mark.parametrize("body", [DEEP_TEXT, '{"not json":'], ids=["deep", "not-json"])
def test_every_read_path_delivers_a_poison_payload(backend: Backend, body: str) -> None:
    s = backend.store
    rid = s.ensure_resource("run", "poison")
    consumer = _Consumer(backend)
    try:
        s.mutate(Permit(rid, 0), "run.before", payload={"n": 1})
        # The watcher is live (its hub read the first event) before the poison lands.
        assert consumer.get().type == "run.before"
        poisoned = inject(backend, rid, body)
        s.mutate(Permit(rid, poisoned), "run.after", payload={"n": 2})

        seen = [consumer.get(), consumer.get()]
        assert [e.type for e in seen] == ["run.poison", "run.after"]
        for events in (s.events(rid), s.events_after(), seen):
            poison = next(e for e in events if e.type == "run.poison")
            assert isinstance(poison.payload, RawPayload)
            assert poison.payload.text == body
            assert poison.revision == poisoned
            assert poison.payload_sha256 == hashlib.sha256(body.encode()).digest()
        assert [e.payload for e in s.events(rid) if e.type != "run.poison"] == [{"n": 1}, {"n": 2}]
    finally:
        consumer.close()

    # A watcher resuming from before the poison (a catch-up read) gets it too.
    late = _Consumer(backend)
    try:
        assert [late.get().type for _ in range(3)] == ["run.before", "run.poison", "run.after"]
    finally:
        late.close()
