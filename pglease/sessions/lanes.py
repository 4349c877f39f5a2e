"""Register names and pure helpers of the session layer (`Session`, `AsyncSession`).

Nothing here does I/O: the names of the registers a harness uses
(SESSION_FORMAT.md, "Registers"), argument checks shared by the two twins,
and reading the usage an entry carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..validation import describe, utf8_encodable
from .errors import InvalidSessionWriteError, SessionCorruptError
from .model import Entry, Register, SessionSnapshot, empty_usage, sum_usage
from .schema import MAIN_LANE

#: lane name -> entry id or null: where the lane appends next.
LANE_LEAF = "lane.leaf"
#: lane name -> `{model: {provider, modelId}, thinkingLevel, activeToolNames[]}`.
LANE_CONFIG = "lane.config"
#: lane name -> `{currentOperationId, pendingNextRun[]}`.
LANE_STATE = "lane.state"
#: lane name -> outcome of the lane's last operation.
LANE_LAST_RESULT = "lane.lastResult"
#: key "" -> the session name.
FACT_NAME = "fact.name"
#: entry id -> the label on that entry.
FACT_LABEL = "fact.label"
#: application key -> any JSON value.
FACT_CUSTOM = "fact.custom"

#: The value of `lane.state` for a lane with no operation running.
IDLE_LANE_STATE: dict[str, Any] = {"currentOperationId": None, "pendingNextRun": []}


def check_lane(lane: object) -> str:
    """A lane name is a non-empty string without NUL (it is a register key)."""
    if not isinstance(lane, str) or lane == "" or "\x00" in lane or not utf8_encodable(lane):
        raise InvalidSessionWriteError(
            f"lane name must be a non-empty UTF-8 string without NUL, got {describe(lane)}"
        )
    return lane


def check_label(label: object) -> str:
    if not isinstance(label, str) or label == "" or "\x00" in label or not utf8_encodable(label):
        raise InvalidSessionWriteError(
            f"a label must be a non-empty UTF-8 string without NUL, got {describe(label)}"
        )
    return label


def leaf_value(lane: str, register: Register) -> str | None:
    """The entry id a `lane.leaf` register holds (None for an empty lane)."""
    try:
        value = register.value
    except ValueError:
        raise SessionCorruptError(
            f"lane {lane!r}: lane.leaf holds invalid JSON {register.value_json!r}"
        ) from None
    if value is not None and not isinstance(value, str):
        raise SessionCorruptError(f"lane {lane!r}: lane.leaf must be an entry id, got {value!r}")
    return value


def label_map(registers: Sequence[Register]) -> dict[str, str]:
    """`fact.label` registers as {entry id: label}."""
    out: dict[str, str] = {}
    for register in registers:
        value = register.value
        if not isinstance(value, str):
            raise SessionCorruptError(
                f"fact.label of entry {register.key!r} is not a string: {value!r}"
            )
        out[register.key] = value
    return out


def sorted_lanes(registers: Sequence[Register]) -> list[str]:
    """Lane names of `lane.leaf` registers, main first, then by name."""
    return sorted((r.key for r in registers), key=lambda name: (name != MAIN_LANE, name))


def entry_usage(entry: Entry) -> Mapping[str, Any] | None:
    """The usage an entry carries: a message's `message.usage` (assistant
    messages carry one), or the `usage` of a compaction or branch summary (the
    model call that produced it). None when it carries no usage object."""
    payload = entry.payload
    if entry.type == "message":
        message = payload.get("message")
        usage = message.get("usage") if isinstance(message, Mapping) else None
    elif entry.type in ("compaction", "branch_summary"):
        usage = payload.get("usage")
    else:
        usage = None
    return usage if isinstance(usage, Mapping) else None


def branch_usage(entries: Sequence[Entry]) -> dict[str, Any]:
    """The summed usage the entries carry (the ledger total's shape)."""
    total = empty_usage()
    for entry in entries:
        usage = entry_usage(entry)
        if usage is None:
            continue
        try:
            total = sum_usage(total, usage)
        except InvalidSessionWriteError as exc:
            raise SessionCorruptError(
                f"entry {entry.id!r} carries malformed usage: {exc}"
            ) from None
    return total


def with_empty_main(snapshot: SessionSnapshot) -> SessionSnapshot:
    """The snapshot with main's leaf set to null, so that a branch fork of it
    copies no entries (used to fork an empty lane other than main)."""
    registers = tuple(
        Register(r.namespace, r.key, r.seq, "null")
        if (r.namespace, r.key) == (LANE_LEAF, MAIN_LANE)
        else r
        for r in snapshot.registers
    )
    return SessionSnapshot(snapshot.entries, registers, snapshot.parent_session_id)


__all__ = [
    "FACT_CUSTOM",
    "FACT_LABEL",
    "FACT_NAME",
    "IDLE_LANE_STATE",
    "LANE_CONFIG",
    "LANE_LAST_RESULT",
    "LANE_LEAF",
    "LANE_STATE",
    "branch_usage",
    "check_label",
    "check_lane",
    "entry_usage",
]
