"""Fork rules and lane validation, independent of any storage backend.

`plan_fork` turns a `SessionSnapshot` of the source into a `ForkPlan`: the
entries to copy (seq order, unchanged) and the registers to write with their
fresh seqs. A backend writes the plan, passing entries through the branch
index in seq order.

For sources too big for a snapshot, `resolve_fork` decides the same rules from
the registers and a few looked-up entries, and a `ForkStream` carries the
entries as an iterator (checked by `checked_path` / `checked_seq_order`); the
registers are planned by `plan_registers` once the entries are written.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from .errors import InvalidSessionWriteError, LaneValidationError, UnknownEntryError
from .model import Entry, Register, SessionSnapshot, dump_json, lane_names
from .schema import IDLE_LANE_STATE_JSON, MAIN_LANE

ForkScope: TypeAlias = Literal["branch", "tree"]
ForkPosition: TypeAlias = Literal["at", "before"]

#: The register namespaces a fork copies as facts (labels only for copied entries).
FACT_NAMESPACES = frozenset({"fact.name", "fact.custom", "fact.label"})


@dataclass(frozen=True, slots=True)
class ForkPlan:
    entries: tuple[Entry, ...]
    registers: tuple[Register, ...]
    message_count: int
    next_seq: int
    parent_session_id: str | None


def _leaf_value(register: Register) -> str | None:
    try:
        value = register.value
    except ValueError:
        raise LaneValidationError(
            f"lane {register.key!r}: lane.leaf holds invalid JSON {register.value_json!r}"
        ) from None
    if value is not None and not isinstance(value, str):
        raise LaneValidationError(
            f"lane {register.key!r}: lane.leaf must be an entry id or null, got {value!r}"
        )
    return value


def validate_lanes(
    registers: Sequence[Register], entry_ids: Collection[str]
) -> dict[str, str | None]:
    """Check the lane registers of a session; return each lane's leaf.

    main must have a leaf; a lane with config, state or lastResult needs a leaf;
    every leaf needs a state; lanes other than main need a config; a non-null
    leaf must name an existing entry.
    """
    by_ns: dict[str, dict[str, Register]] = {}
    for register in registers:
        by_ns.setdefault(register.namespace, {})[register.key] = register
    leaves = by_ns.get("lane.leaf", {})
    configs = by_ns.get("lane.config", {})
    states = by_ns.get("lane.state", {})
    if MAIN_LANE not in leaves:
        raise LaneValidationError("lane 'main' is missing its lane.leaf register")
    out: dict[str, str | None] = {}
    for lane in lane_names(registers):
        present = [
            ns
            for ns in ("lane.config", "lane.state", "lane.lastResult")
            if lane in by_ns.get(ns, {})
        ]
        if lane not in leaves:
            raise LaneValidationError(
                f"lane {lane!r} has {', '.join(present)} but is missing its lane.leaf register"
            )
        if lane not in states:
            raise LaneValidationError(f"lane {lane!r} is missing its lane.state register")
        if lane != MAIN_LANE and lane not in configs:
            raise LaneValidationError(f"lane {lane!r} is missing its lane.config register")
        leaf = _leaf_value(leaves[lane])
        if leaf is not None and leaf not in entry_ids:
            raise LaneValidationError(
                f"lane {lane!r}: lane.leaf points at entry {leaf!r}, which does not exist"
            )
        out[lane] = leaf
    return out


def branch_path(entries: dict[str, Entry], entry_id: str) -> list[Entry]:
    """The entries from the root down to `entry_id` (inclusive), oldest first."""
    path: list[Entry] = []
    current = entries.get(entry_id)
    if current is None:
        raise UnknownEntryError(f"fork entry {entry_id!r} does not exist in the source session")
    while True:
        path.append(current)
        if current.parent_id is None:
            break
        parent = entries.get(current.parent_id)
        if parent is None:
            raise UnknownEntryError(
                f"entry {current.id!r} has a missing parent {current.parent_id!r}"
            )
        if parent.seq >= current.seq or len(path) > len(entries):
            raise UnknownEntryError(f"entry {current.id!r} has an invalid parent chain")
        current = parent
    path.reverse()
    return path


def plan_registers(
    source: Sequence[Register],
    lanes: Sequence[tuple[str, str | None]],
    last_entry_seq: int,
    copied_ids: Collection[str],
) -> tuple[tuple[Register, ...], int]:
    """The registers of a fork and its next_seq: fresh seqs from
    `max(last_entry_seq, 0) + 1`; per lane config (if any), leaf, idle state;
    then the facts (`fact.name`, `fact.custom`, and `fact.label` of copied
    entries only) in one pass in the source's seq order, whatever their
    namespace, in both scopes: the harness copies them that way, so a label set
    before the name is numbered before it."""
    regs = {(r.namespace, r.key): r for r in source}
    seq = max(last_entry_seq, 0)
    out: list[Register] = []

    def put(namespace: str, key: str, value_json: str) -> None:
        nonlocal seq
        seq += 1
        out.append(Register(namespace, key, seq, value_json))

    for lane, lane_leaf in lanes:
        config = regs.get(("lane.config", lane))
        if config is not None:
            put("lane.config", lane, config.value_json)
        put("lane.leaf", lane, dump_json(lane_leaf))
        put("lane.state", lane, IDLE_LANE_STATE_JSON)
    facts = [
        r
        for r in source
        if r.namespace in FACT_NAMESPACES and (r.namespace != "fact.label" or r.key in copied_ids)
    ]
    # Seqs are unique within a session; namespace and key only make a
    # damaged source's order deterministic.
    for register in sorted(facts, key=lambda r: (r.seq, r.namespace, r.key)):
        put(register.namespace, register.key, register.value_json)
    return tuple(out), seq + 1


def plan_fork(
    snapshot: SessionSnapshot,
    source_id: str | None,
    scope: ForkScope = "branch",
    entry_id: str | None = None,
    position: ForkPosition = "at",
) -> ForkPlan:
    """Apply the fork rules to a source snapshot (raises before anything is written)."""
    if scope not in ("branch", "tree"):
        raise InvalidSessionWriteError(f"fork scope must be 'branch' or 'tree', got {scope!r}")
    if position not in ("at", "before"):
        raise InvalidSessionWriteError(f"fork position must be 'at' or 'before', got {position!r}")
    entries = snapshot.entry_map()
    leaves = validate_lanes(snapshot.registers, entries)

    lanes: list[tuple[str, str | None]]
    copied: list[Entry]
    if scope == "branch":
        target = leaves[MAIN_LANE] if entry_id is None else entry_id
        if target is None:
            # An empty main lane forks to an empty session, 'at' or 'before' alike
            # (as the harness does): there is nothing before nothing.
            copied = []
            leaf: str | None = None
        else:
            path = branch_path(entries, target)
            if position == "before":
                path = path[:-1]
            copied = path
            leaf = path[-1].id if path else None
        lanes = [(MAIN_LANE, leaf)]
    else:
        if entry_id is not None or position != "at":
            raise InvalidSessionWriteError(
                "entry_id and position='before' apply to branch scope only"
            )
        copied = sorted(snapshot.entries, key=lambda e: e.seq)
        seen: dict[str, int] = {}
        for entry in copied:
            if entry.parent_id is not None and entry.parent_id not in seen:
                raise UnknownEntryError(
                    f"entry {entry.id!r} has a missing parent {entry.parent_id!r}"
                )
            seen[entry.id] = entry.seq
        # Lanes in the order the source wrote their leaves (its seq order), as
        # the harness numbers them; main is not moved first.
        leaf_seq = {r.key: r.seq for r in snapshot.registers if r.namespace == "lane.leaf"}
        lanes = sorted(leaves.items(), key=lambda lane: leaf_seq[lane[0]])

    copied_ids = {e.id for e in copied}
    out, next_seq = plan_registers(
        snapshot.registers, lanes, max((e.seq for e in copied), default=0), copied_ids
    )
    return ForkPlan(
        entries=tuple(copied),
        registers=out,
        message_count=sum(1 for e in copied if e.type == "message"),
        next_seq=next_seq,
        parent_session_id=source_id,
    )


# --- streamed forks: entries read while they are written ---------------------------------


@dataclass(frozen=True, slots=True)
class ForkShape:
    """What a fork copies, decided from the registers and a few looked-up
    entries before any entry is read: branch scope copies the path from the
    root to `tip` (nothing when `tip` is None); tree scope copies every entry."""

    scope: ForkScope
    tip: str | None
    lanes: tuple[tuple[str, str | None], ...]


def resolve_fork_lookups(registers: Sequence[Register], entry_id: str | None) -> list[str]:
    """The entry ids `resolve_fork` looks up: every lane leaf and the fork entry."""
    wanted = {leaf for r in registers if r.namespace == "lane.leaf" if (leaf := _leaf_value(r))}
    if entry_id is not None:
        wanted.add(entry_id)
    return sorted(wanted)


def resolve_fork(
    registers: Sequence[Register],
    lookup: Callable[[Sequence[str]], Mapping[str, Entry]],
    scope: ForkScope = "branch",
    entry_id: str | None = None,
    position: ForkPosition = "at",
) -> ForkShape:
    """The fork rules of `plan_fork` without a snapshot: `lookup(ids)` returns
    the source entries among `ids` (the lane leaves and the fork entry)."""
    if scope not in ("branch", "tree"):
        raise InvalidSessionWriteError(f"fork scope must be 'branch' or 'tree', got {scope!r}")
    if position not in ("at", "before"):
        raise InvalidSessionWriteError(f"fork position must be 'at' or 'before', got {position!r}")
    if scope == "tree" and (entry_id is not None or position != "at"):
        raise InvalidSessionWriteError("entry_id and position='before' apply to branch scope only")
    if entry_id is not None and not isinstance(entry_id, str):
        raise InvalidSessionWriteError(f"fork entry_id must be a string, got {entry_id!r}")
    found = lookup(resolve_fork_lookups(registers, entry_id))
    leaves = validate_lanes(registers, found)
    if scope == "tree":
        # Lanes in the order the source wrote their leaves, as in `plan_fork`.
        leaf_seq = {r.key: r.seq for r in registers if r.namespace == "lane.leaf"}
        lanes = sorted(leaves.items(), key=lambda lane: leaf_seq[lane[0]])
        return ForkShape("tree", None, tuple(lanes))
    target = leaves[MAIN_LANE] if entry_id is None else entry_id
    if target is None:
        # An empty main lane forks to an empty session, 'at' or 'before' alike.
        return ForkShape("branch", None, ((MAIN_LANE, None),))
    entry = found.get(target)
    if entry is None:
        raise UnknownEntryError(f"fork entry {target!r} does not exist in the source session")
    tip = entry.parent_id if position == "before" else entry.id
    return ForkShape("branch", tip, ((MAIN_LANE, tip),))


def checked_path(entries: Iterable[Entry], tip: str) -> Iterator[Entry]:
    """Pass a branch path (root first, seq order) through, checking that it is
    one unbroken chain from a root to `tip`."""
    previous: Entry | None = None
    for entry in entries:
        if previous is None and entry.parent_id is not None:
            raise UnknownEntryError(f"entry {entry.id!r} has a missing parent {entry.parent_id!r}")
        if previous is not None and (entry.parent_id != previous.id or entry.seq <= previous.seq):
            raise UnknownEntryError(f"entry {entry.id!r} has an invalid parent chain")
        previous = entry
        yield entry
    if previous is None or previous.id != tip:
        raise UnknownEntryError(f"entry {tip!r} has an invalid parent chain")


def checked_seq_order(entries: Iterable[Entry]) -> Iterator[Entry]:
    """Pass entries through, checking that seqs strictly increase (parents are
    checked where they are written: a parent must already be there)."""
    last = None
    for entry in entries:
        if last is not None and entry.seq <= last:
            raise UnknownEntryError(f"entry {entry.id!r} has seq {entry.seq} out of order")
        last = entry.seq
        yield entry


@dataclass(slots=True)
class ForkStream:
    """A fork to write with bounded memory: `entries` (seq order, read lazily)
    and what the registers are planned from once they are written
    (`plan_registers`, labels kept for the entries the destination has)."""

    entries: Iterable[Entry]
    lanes: tuple[tuple[str, str | None], ...]
    source_registers: tuple[Register, ...]
    parent_session_id: str | None
    scope: ForkScope = "branch"

    def registers(
        self, last_entry_seq: int, copied_ids: Collection[str]
    ) -> tuple[tuple[Register, ...], int]:
        return plan_registers(self.source_registers, self.lanes, last_entry_seq, copied_ids)

    def close(self) -> None:
        """Stop reading the source (a generator's cursor is closed now, not by GC)."""
        close = getattr(self.entries, "close", None)
        if close is not None:
            close()

    def label_keys(self) -> list[str]:
        """The entry ids that carry a `fact.label` (kept if the entry is copied)."""
        return sorted(r.key for r in self.source_registers if r.namespace == "fact.label")
