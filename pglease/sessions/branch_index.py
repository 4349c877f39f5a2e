"""The branch index: segments that let a root-to-entry path be read by ranges.

Backend independent. The algorithm talks to a `BranchIndexStore` (SQLite and
PostgreSQL implement it with SQL; `MemoryBranchIndex` with dicts).

A segment's `branch_id` is the id of the entry that started it. It stores its
own rows (`entry_seq > base_seq`, or > 0 without a base); logically it also
holds its base segment's rows up to `base_seq`. Seqs strictly increase along
every path, because a parent is always written before its children.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from .errors import InvalidSessionWriteError, SessionCorruptError
from .model import Entry


@dataclass(frozen=True, slots=True)
class Segment:
    branch_id: str
    tip_entry_id: str
    tip_seq: int
    base_branch_id: str | None
    base_seq: int | None

    @property
    def floor(self) -> int:
        """Own rows have `entry_seq > floor`."""
        return 0 if self.base_seq is None else self.base_seq


@dataclass(frozen=True, slots=True)
class BranchRow:
    entry_id: str
    entry_seq: int
    entry_type: str


class BranchIndexStore(Protocol):
    """The storage operations the algorithm needs (all within one transaction)."""

    def segment(self, branch_id: str) -> Segment | None: ...

    def segment_by_tip(self, tip_entry_id: str) -> Segment | None: ...

    def covering_segment(self, entry_id: str, entry_seq: int) -> Segment | None:
        """A segment holding a row for the entry with `base_seq < entry_seq <= tip_seq`,
        the one with the newest tip first."""
        ...

    def newest_row_of_type(
        self, branch_id: str, entry_type: str, above_seq: int, upto_seq: int
    ) -> BranchRow | None:
        """The segment's own row of that type with the highest seq in (above, upto]."""
        ...

    def rows(
        self, branch_id: str, above_seq: int, upto_seq: int, newest_first: bool
    ) -> Iterable[BranchRow]:
        """The segment's own rows with seq in (above_seq, upto_seq], ordered by seq."""
        ...

    def add_segment(self, segment: Segment) -> None: ...

    def move_tip(self, branch_id: str, tip_entry_id: str, tip_seq: int) -> None: ...

    def add_rows(self, branch_id: str, rows: Sequence[BranchRow]) -> None: ...


# --- maintenance -------------------------------------------------------------------


def chain_of(store: BranchIndexStore, segment: Segment, upto_seq: int) -> list[tuple[Segment, int]]:
    """`segment` and its bases, newest first, each with the highest seq it covers."""
    chain: list[tuple[Segment, int]] = []
    current: Segment | None = segment
    upto = upto_seq
    while current is not None:
        chain.append((current, upto))
        if current.base_branch_id is None:
            break
        base_seq = current.base_seq
        if base_seq is None or base_seq >= upto:
            raise SessionCorruptError(
                f"corrupt branch index: segment {current.branch_id} has base seq "
                f"{base_seq!r} not below {upto}"
            )
        base = store.segment(current.base_branch_id)
        if base is None:
            raise SessionCorruptError(
                f"corrupt branch index: segment {current.branch_id} refers to missing base "
                f"segment {current.base_branch_id}"
            )
        current, upto = base, base_seq
    return chain


def index_entry(
    store: BranchIndexStore,
    entry_id: str,
    entry_seq: int,
    entry_type: str,
    parent_id: str | None,
    parent_seq: int | None,
) -> None:
    """Add one newly inserted entry to the index (the three rules of the format)."""
    row = BranchRow(entry_id, entry_seq, entry_type)
    # 1. A root starts its own segment.
    if parent_id is None:
        store.add_segment(Segment(entry_id, entry_id, entry_seq, None, None))
        store.add_rows(entry_id, [row])
        return
    if parent_seq is None or parent_seq >= entry_seq:
        raise InvalidSessionWriteError(
            f"entry {entry_id} (seq {entry_seq}) must come after its parent {parent_id}"
        )
    # 2. The parent is a tip: extend that segment.
    tip_segment = store.segment_by_tip(parent_id)
    if tip_segment is not None:
        store.add_rows(tip_segment.branch_id, [row])
        store.move_tip(tip_segment.branch_id, entry_id, entry_seq)
        return
    # 3. Divergence: a new segment based at the newest compaction on the path.
    cover = store.covering_segment(parent_id, parent_seq)
    if cover is None:
        raise SessionCorruptError(
            f"corrupt branch index: no segment covers parent entry {parent_id}"
        )
    chain = chain_of(store, cover, parent_seq)
    base: tuple[str, int] | None = None
    for segment, upto in chain:
        found = store.newest_row_of_type(segment.branch_id, "compaction", segment.floor, upto)
        if found is not None:
            base = (segment.branch_id, found.entry_seq)
            break
    floor = 0 if base is None else base[1]
    copied: list[BranchRow] = []
    for segment, upto in reversed(chain):
        above = max(segment.floor, floor)
        if upto > above:
            copied.extend(store.rows(segment.branch_id, above, upto, newest_first=False))
    copied.append(row)
    store.add_segment(
        Segment(
            entry_id,
            entry_id,
            entry_seq,
            None if base is None else base[0],
            None if base is None else base[1],
        )
    )
    store.add_rows(entry_id, copied)


# --- reading ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BranchQuery:
    """How to read a branch.

    The path runs from the leaf back to the root. `stop_type` / `stop_id` end it
    (inclusively) at the first matching entry counted from the leaf, whatever the
    direction; then the `types` / `custom_type` filters apply, then the exclusive
    seq `cursor` (`seq < cursor` newest first, `seq > cursor` oldest first), then
    `limit`.
    """

    newest_first: bool = True
    stop_type: str | None = None
    stop_id: str | None = None
    types: frozenset[str] | None = None
    custom_type: str | None = None
    cursor: int | None = None
    limit: int | None = None


def _check_query(query: BranchQuery) -> None:
    if query.limit is not None and (
        isinstance(query.limit, bool) or not isinstance(query.limit, int) or query.limit < 0
    ):
        raise InvalidSessionWriteError(f"limit must be a non-negative int, got {query.limit!r}")
    if query.cursor is not None and (
        isinstance(query.cursor, bool) or not isinstance(query.cursor, int)
    ):
        raise InvalidSessionWriteError(f"cursor must be an int seq, got {query.cursor!r}")


def leaf_chain(store: BranchIndexStore, leaf_id: str, leaf_seq: int) -> list[tuple[Segment, int]]:
    cover = store.covering_segment(leaf_id, leaf_seq)
    if cover is None:
        raise SessionCorruptError(f"corrupt branch index: no segment covers entry {leaf_id}")
    return chain_of(store, cover, leaf_seq)


def path_rows(
    store: BranchIndexStore,
    chain: Sequence[tuple[Segment, int]],
    low: int,
    high: int,
    newest_first: bool,
) -> Iterator[BranchRow]:
    """Rows of the path with `low <= seq <= high`, in the requested order."""
    ordered = chain if newest_first else list(reversed(chain))
    for segment, upto in ordered:
        above = max(segment.floor, low - 1)
        top = min(upto, high)
        if top > above:
            yield from store.rows(segment.branch_id, above, top, newest_first)


def _stop_seq(
    store: BranchIndexStore, chain: Sequence[tuple[Segment, int]], leaf_seq: int, query: BranchQuery
) -> int | None:
    stops: list[int] = []
    if query.stop_type is not None:
        for segment, upto in chain:
            found = store.newest_row_of_type(
                segment.branch_id, query.stop_type, segment.floor, upto
            )
            if found is not None:
                stops.append(found.entry_seq)
                break
    if query.stop_id is not None:
        for row in path_rows(store, chain, 0, leaf_seq, newest_first=True):
            if row.entry_id == query.stop_id:
                stops.append(row.entry_seq)
                break
    return max(stops) if stops else None


def scan_branch(
    store: BranchIndexStore,
    leaf: Entry,
    query: BranchQuery,
    load: Callable[[BranchRow], Entry],
) -> list[Entry]:
    """Read the path ending at `leaf` through the index, per `query`."""
    _check_query(query)
    if query.limit == 0:
        return []
    chain = leaf_chain(store, leaf.id, leaf.seq)
    low = _stop_seq(store, chain, leaf.seq, query)
    low = 0 if low is None else low
    high = leaf.seq
    if query.cursor is not None:
        if query.newest_first:
            high = min(high, query.cursor - 1)
        else:
            low = max(low, query.cursor + 1)
    out: list[Entry] = []
    first = True
    for row in path_rows(store, chain, low, high, query.newest_first):
        if first and query.newest_first and high == leaf.seq and row.entry_id != leaf.id:
            raise SessionCorruptError(
                f"corrupt branch index: path of {leaf.id} starts at {row.entry_id}"
            )
        first = False
        if query.types is not None and row.entry_type not in query.types:
            continue
        entry = load(row)
        if query.custom_type is not None and entry.custom_type != query.custom_type:
            continue
        out.append(entry)
        if query.limit is not None and len(out) >= query.limit:
            break
    return out


# --- an in-memory store ------------------------------------------------------------------


class MemoryBranchIndex:
    """A `BranchIndexStore` over dicts: a reference for tests and other backends."""

    def __init__(self) -> None:
        self.segments: dict[str, Segment] = {}
        self.by_tip: dict[str, str] = {}
        self.rows_of: dict[str, list[BranchRow]] = {}
        self.segments_of_entry: dict[str, set[str]] = {}

    def segment(self, branch_id: str) -> Segment | None:
        return self.segments.get(branch_id)

    def segment_by_tip(self, tip_entry_id: str) -> Segment | None:
        branch_id = self.by_tip.get(tip_entry_id)
        return None if branch_id is None else self.segments[branch_id]

    def covering_segment(self, entry_id: str, entry_seq: int) -> Segment | None:
        best: Segment | None = None
        for branch_id in self.segments_of_entry.get(entry_id, ()):
            seg = self.segments[branch_id]
            if seg.floor < entry_seq <= seg.tip_seq and (
                best is None or seg.tip_seq > best.tip_seq
            ):
                best = seg
        return best

    def _slice(self, branch_id: str, above_seq: int, upto_seq: int) -> list[BranchRow]:
        rows = self.rows_of.get(branch_id, [])
        seqs = [r.entry_seq for r in rows]
        return rows[bisect.bisect_right(seqs, above_seq) : bisect.bisect_right(seqs, upto_seq)]

    def newest_row_of_type(
        self, branch_id: str, entry_type: str, above_seq: int, upto_seq: int
    ) -> BranchRow | None:
        for row in reversed(self._slice(branch_id, above_seq, upto_seq)):
            if row.entry_type == entry_type:
                return row
        return None

    def rows(
        self, branch_id: str, above_seq: int, upto_seq: int, newest_first: bool
    ) -> Iterable[BranchRow]:
        rows = self._slice(branch_id, above_seq, upto_seq)
        return list(reversed(rows)) if newest_first else rows

    def add_segment(self, segment: Segment) -> None:
        if segment.branch_id in self.segments or segment.tip_entry_id in self.by_tip:
            raise SessionCorruptError(f"segment {segment.branch_id} already exists")
        self.segments[segment.branch_id] = segment
        self.by_tip[segment.tip_entry_id] = segment.branch_id
        self.rows_of[segment.branch_id] = []

    def move_tip(self, branch_id: str, tip_entry_id: str, tip_seq: int) -> None:
        old = self.segments[branch_id]
        del self.by_tip[old.tip_entry_id]
        self.segments[branch_id] = Segment(
            branch_id, tip_entry_id, tip_seq, old.base_branch_id, old.base_seq
        )
        self.by_tip[tip_entry_id] = branch_id

    def add_rows(self, branch_id: str, rows: Sequence[BranchRow]) -> None:
        target = self.rows_of[branch_id]
        for row in rows:
            if target and row.entry_seq <= target[-1].entry_seq:
                raise SessionCorruptError("branch rows must be added in seq order")
            target.append(row)
            self.segments_of_entry.setdefault(row.entry_id, set()).add(branch_id)
