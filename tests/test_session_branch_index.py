"""Branch scans through the index agree with a plain parent walk on random trees."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pglease.sessions import (
    AppendEntry,
    BranchQuery,
    BranchRow,
    Entry,
    MemoryBranchIndex,
    SessionRepository,
)
from pglease.sessions.branch_index import index_entry, scan_branch

TYPES = ["message", "message", "message", "compaction", "custom"]


@dataclass(frozen=True)
class Node:
    id: str
    parent: str | None
    type: str
    custom_type: str | None


@st.composite
def trees(draw: st.DrawFn) -> tuple[list[Node], list[int]]:
    """Random forests: mostly linear growth with frequent divergences and compactions.
    Returns the nodes and the commit batch sizes."""
    size = draw(st.integers(min_value=1, max_value=60))
    nodes: list[Node] = []
    for i in range(size):
        if not nodes or draw(st.integers(0, 30)) == 0:
            parent = None
        elif draw(st.booleans()):
            parent = nodes[-1].id  # keep extending the newest entry
        else:
            parent = nodes[draw(st.integers(0, len(nodes) - 1))].id  # diverge anywhere
        kind = draw(st.sampled_from(TYPES))
        custom = draw(st.sampled_from(["a", "b"])) if kind == "custom" else None
        nodes.append(Node(f"n{i:03d}", parent, kind, custom))
    batches: list[int] = []
    left = size
    while left:
        take = draw(st.integers(1, min(left, 8)))
        batches.append(take)
        left -= take
    return nodes, batches


queries = st.builds(
    BranchQuery,
    newest_first=st.booleans(),
    stop_type=st.none() | st.sampled_from(["compaction", "custom", "message"]),
    stop_id=st.none() | st.sampled_from([f"n{i:03d}" for i in range(0, 60, 3)]),
    types=st.none() | st.sets(st.sampled_from(["message", "compaction", "custom"])).map(frozenset),
    custom_type=st.none() | st.sampled_from(["a", "b"]),
    cursor=st.none() | st.integers(0, 70),
    limit=st.none() | st.integers(0, 10),
)


def payload(node: Node) -> dict[str, object]:
    if node.type == "message":
        return {"message": {"role": "user", "content": node.id}}
    if node.type == "compaction":
        return {"summary": node.id, "retainedTail": [], "tokensBefore": 1, "fromHook": False}
    return {"data": node.id}


def walk(entries: dict[str, Entry], leaf: str) -> list[Entry]:
    """The reference: follow parent ids from the leaf to the root."""
    path: list[Entry] = []
    current: str | None = leaf
    while current is not None:
        entry = entries[current]
        path.append(entry)
        current = entry.parent_id
    return path


def reference(entries: dict[str, Entry], leaf: str, query: BranchQuery) -> list[str]:
    path = walk(entries, leaf)
    bounded: list[Entry] = []
    for entry in path:
        bounded.append(entry)
        if entry.type == query.stop_type or entry.id == query.stop_id:
            break
    ordered = bounded if query.newest_first else list(reversed(bounded))
    out = [
        e
        for e in ordered
        if (query.types is None or e.type in query.types)
        and (query.custom_type is None or e.custom_type == query.custom_type)
    ]
    if query.cursor is not None:
        out = [
            e for e in out if (e.seq < query.cursor if query.newest_first else e.seq > query.cursor)
        ]
    if query.limit is not None:
        out = out[: query.limit]
    return [e.id for e in out]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(tree=trees(), query_list=st.lists(queries, min_size=1, max_size=4), data=st.data())
def test_index_scans_match_parent_walk(
    tree: tuple[list[Node], list[int]], query_list: list[BranchQuery], data: st.DataObject
) -> None:
    nodes, batches = tree
    with tempfile.TemporaryDirectory() as directory:
        repo = SessionRepository(directory, renew_interval=None)
        with repo.create("t") as session:
            position = 0
            for size in batches:
                batch = nodes[position : position + size]
                position += size
                session.commit(
                    [AppendEntry(n.type, n.parent, payload(n), n.custom_type, n.id) for n in batch]
                )
            entries = {e.id: e for e in session.scan_entries()}
            assert len(entries) == len(nodes)

            # the same algorithm over the in-memory store gives the same answers
            memory = MemoryBranchIndex()
            for entry in sorted(entries.values(), key=lambda e: e.seq):
                parent_seq = None if entry.parent_id is None else entries[entry.parent_id].seq
                index_entry(memory, entry.id, entry.seq, entry.type, entry.parent_id, parent_seq)

            def load(row: BranchRow) -> Entry:
                return entries[row.entry_id]

            for leaf in entries:
                expected = [e.id for e in walk(entries, leaf)]
                assert [e.id for e in session.scan_branch(leaf)] == expected
                assert [e.id for e in session.scan_branch(leaf, newest_first=False)] == list(
                    reversed(expected)
                )
                assert [e.id for e in scan_branch(memory, entries[leaf], BranchQuery(), load)] == (
                    expected
                )
            for query in query_list:
                leaf = data.draw(st.sampled_from(sorted(entries)))
                got = session.scan_branch(
                    leaf,
                    newest_first=query.newest_first,
                    stop_type=query.stop_type,
                    stop_id=query.stop_id,
                    types=query.types,
                    custom_type=query.custom_type,
                    cursor=query.cursor,
                    limit=query.limit,
                )
                assert [e.id for e in got] == reference(entries, leaf, query), query
                assert [e.id for e in scan_branch(memory, entries[leaf], query, load)] == (
                    reference(entries, leaf, query)
                )

            # a tree fork rebuilds the index from scratch in seq order: same paths
            with repo.fork("t", scope="tree", id="copy") as copy:
                for leaf in list(entries)[:: max(1, len(entries) // 8)]:
                    assert [e.id for e in copy.scan_branch(leaf)] == [
                        e.id for e in walk(entries, leaf)
                    ]
