"""Plain data of the session format, shared by every session backend.

Nothing here touches a database: entries, registers and usage rows as read
back, the write operations a commit takes, payload checks and usage summing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from ..json_text import dumps
from .errors import InvalidSessionWriteError
from .schema import ENTRY_TYPES, MAIN_LANE

EntryType: TypeAlias = Literal["message", "compaction", "branch_summary", "custom"]

# --- JSON -------------------------------------------------------------------


def dump_json(value: Any, what: str = "value") -> str:
    """Compact JSON text as JSON.stringify writes it (numbers included: `1.0`
    is `1`); rejects NaN/inf."""
    try:
        text = dumps(value)
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidSessionWriteError(f"{what} is not JSON serialisable: {exc}") from None
    except RecursionError:
        raise InvalidSessionWriteError(f"{what} is nested too deeply to store as JSON") from None
    return text


def load_json(text: str) -> Any:
    return json.loads(text)


# --- rows as read back --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of `entries`; `payload_json` holds the type-specific fields only."""

    id: str
    parent_id: str | None
    seq: int
    type: str
    custom_type: str | None
    timestamp: int
    payload_json: str

    @property
    def payload(self) -> dict[str, Any]:
        value = json.loads(self.payload_json)
        return value if isinstance(value, dict) else {"value": value}


@dataclass(frozen=True, slots=True)
class Register:
    namespace: str
    key: str
    seq: int
    value_json: str

    @property
    def value(self) -> Any:
        return json.loads(self.value_json)


@dataclass(frozen=True, slots=True)
class UsageRow:
    id: str
    seq: int
    entry_id: str | None
    adjustment: bool
    usage_json: str
    details_json: str | None

    @property
    def usage(self) -> dict[str, Any]:
        value = json.loads(self.usage_json)
        return value if isinstance(value, dict) else {}

    @property
    def details(self) -> Any:
        return None if self.details_json is None else json.loads(self.details_json)


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    owner_id: str
    fence: int
    expires_at_ms: int


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What `SessionRepository.list()` reports for a readable session file."""

    id: str
    path: str
    created_at: int
    parent_session_id: str | None
    storage_version: int
    message_count: int
    usage: dict[str, Any]
    next_seq: int
    lease: LeaseInfo | None


@dataclass(frozen=True, slots=True)
class SessionStats:
    created_at: int
    parent_session_id: str | None
    message_count: int
    usage: dict[str, Any]
    next_seq: int
    entry_count: int


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """A consistent copy of a session's entries (seq order) and registers.

    This is the backend-independent input of fork planning: every backend
    reads its source into one and writes the planned result out.
    """

    entries: tuple[Entry, ...]
    registers: tuple[Register, ...]
    parent_session_id: str | None = None

    def entry_map(self) -> dict[str, Entry]:
        return {entry.id: entry for entry in self.entries}

    def register_map(self) -> dict[tuple[str, str], Register]:
        return {(r.namespace, r.key): r for r in self.registers}


# --- write operations -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AppendEntry:
    """Insert one entry. `payload` holds the type-specific fields; the common
    fields (id, parentId, seq, timestamp, type, customType) are stripped."""

    type: str
    parent_id: str | None
    payload: Mapping[str, Any] = field(default_factory=dict)
    custom_type: str | None = None
    id: str | None = None


@dataclass(frozen=True, slots=True)
class AddUsage:
    """Insert one usage-ledger row and add it into `session.usage_payload`."""

    usage: Mapping[str, Any]
    entry_id: str | None = None
    adjustment: bool = False
    details: Any = None
    id: str | None = None


@dataclass(frozen=True, slots=True)
class SetRegister:
    namespace: str
    key: str
    value: Any


@dataclass(frozen=True, slots=True)
class DeleteRegister:
    namespace: str
    key: str


Write: TypeAlias = AppendEntry | AddUsage | SetRegister | DeleteRegister


@dataclass(frozen=True, slots=True)
class CommitResult:
    """Seqs `first_seq .. next_seq - 1` went to the writes in order; `ids` holds
    the entry/usage id of each write (None for register writes)."""

    first_seq: int
    next_seq: int
    timestamp: int
    ids: tuple[str | None, ...]


# --- payload checks -------------------------------------------------------------

COMMON_ENTRY_FIELDS = frozenset({"id", "parentId", "seq", "timestamp", "type", "customType"})

#: type -> (required fields, optional fields)
ENTRY_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "message": (frozenset({"message"}), frozenset({"terminate"})),
    "compaction": (
        frozenset({"summary", "retainedTail", "tokensBefore", "fromHook"}),
        frozenset({"details", "usage"}),
    ),
    "branch_summary": (
        frozenset({"fromId", "summary", "fromHook"}),
        frozenset({"details", "usage"}),
    ),
    "custom": (frozenset(), frozenset({"data"})),
}


def entry_payload_json(write: AppendEntry) -> str:
    """Check an entry write's type, custom type and fields; return payload JSON."""
    if write.type not in ENTRY_TYPES:
        raise InvalidSessionWriteError(
            f"entry type {write.type!r} is not one of {', '.join(ENTRY_TYPES)}"
        )
    if write.type == "custom":
        if not isinstance(write.custom_type, str) or write.custom_type == "":
            raise InvalidSessionWriteError("a custom entry needs a non-empty custom_type")
    elif write.custom_type is not None:
        raise InvalidSessionWriteError(
            f"custom_type is only allowed on custom entries, not on {write.type!r}"
        )
    if not isinstance(write.payload, Mapping):
        raise InvalidSessionWriteError("entry payload must be a mapping of fields")
    fields = {k: v for k, v in write.payload.items() if k not in COMMON_ENTRY_FIELDS}
    for key in fields:
        if not isinstance(key, str):
            raise InvalidSessionWriteError(f"entry payload key {key!r} is not a string")
    required, optional = ENTRY_FIELDS[write.type]
    missing = sorted(required - fields.keys())
    if missing:
        raise InvalidSessionWriteError(
            f"{write.type} entry payload is missing field(s): {', '.join(missing)}"
        )
    unknown = sorted(fields.keys() - required - optional)
    if unknown:
        raise InvalidSessionWriteError(
            f"{write.type} entry payload has unknown field(s): {', '.join(unknown)}"
        )
    return dump_json(fields, f"{write.type} entry payload")


# --- usage ----------------------------------------------------------------------

USAGE_FIELDS = (
    "input",
    "output",
    "cacheRead",
    "cacheWrite",
    "cacheWrite1h",
    "reasoning",
    "totalTokens",
)
USAGE_OPTIONAL = frozenset({"cacheWrite1h", "reasoning"})
COST_FIELDS = ("input", "output", "cacheRead", "cacheWrite", "cacheWrite1h", "total")
COST_OPTIONAL = frozenset({"cacheWrite1h"})


def _number(value: Any, what: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSessionWriteError(f"usage field {what} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidSessionWriteError(f"usage field {what} must be finite, got {value!r}")
    return value


def _tidy(value: int | float) -> int | float:
    # JSON.stringify writes 3.0 as 3; keep the text identical.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def check_usage(usage: Any) -> None:
    """A usage row is an object; each known counter, when present, is a number."""
    if not isinstance(usage, Mapping):
        raise InvalidSessionWriteError("usage must be a JSON object")
    for name in USAGE_FIELDS:
        if name in usage:
            _number(usage[name], name)
    cost = usage.get("cost")
    if cost is not None:
        if not isinstance(cost, Mapping):
            raise InvalidSessionWriteError("usage field cost must be an object")
        for name in COST_FIELDS:
            if name in cost:
                _number(cost[name], f"cost.{name}")


def empty_usage() -> dict[str, Any]:
    return {
        "input": 0,
        "output": 0,
        "cacheRead": 0,
        "cacheWrite": 0,
        "totalTokens": 0,
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
    }


def sum_usage(total: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """`total + row`, field by field. Optional fields appear once either has them."""
    check_usage(row)
    out: dict[str, Any] = {}
    for name in USAGE_FIELDS:
        if name in USAGE_OPTIONAL and name not in total and name not in row:
            continue
        a = _number(total.get(name, 0), name)
        b = _number(row.get(name, 0), name)
        out[name] = _tidy(a + b)
    total_cost: Mapping[str, Any] = total.get("cost") or {}
    row_cost: Mapping[str, Any] = row.get("cost") or {}
    cost: dict[str, Any] = {}
    for name in COST_FIELDS:
        if name in COST_OPTIONAL and name not in total_cost and name not in row_cost:
            continue
        a = _number(total_cost.get(name, 0), f"cost.{name}")
        b = _number(row_cost.get(name, 0), f"cost.{name}")
        cost[name] = _tidy(a + b)
    out["cost"] = cost
    return out


# --- lanes --------------------------------------------------------------------------

LANE_NAMESPACES = ("lane.leaf", "lane.config", "lane.state", "lane.lastResult")


def lane_names(registers: Sequence[Register]) -> list[str]:
    """Every lane mentioned by some lane.* register, sorted (main first)."""
    names = {r.key for r in registers if r.namespace in LANE_NAMESPACES}
    return sorted(names, key=lambda n: (n != MAIN_LANE, n))
