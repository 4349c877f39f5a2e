"""Checking a commit's writes before any backend touches its database.

Every backend calls `prepare_writes` first, so a malformed write is refused
identically everywhere and nothing is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..validation import describe, utf8_encodable
from .errors import InvalidSessionWriteError
from .model import (
    AddUsage,
    AppendEntry,
    DeleteRegister,
    SetRegister,
    Write,
    check_usage,
    dump_json,
    entry_payload_json,
)


def check_id(value: object, what: str) -> str:
    if not isinstance(value, str) or value == "" or "\x00" in value or not utf8_encodable(value):
        raise InvalidSessionWriteError(
            f"{what} must be a non-empty UTF-8 string without NUL, got {describe(value)}"
        )
    return value


def check_text(value: object, what: str, *, allow_empty: bool) -> str:
    if (
        not isinstance(value, str)
        or (value == "" and not allow_empty)
        or "\x00" in value
        or not utf8_encodable(value)
    ):
        raise InvalidSessionWriteError(
            f"{what} must be a UTF-8 string without NUL, got {describe(value)}"
        )
    return value


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked write: `text` is the entry payload, usage or register value
    JSON (None for a delete); `details` is the usage details JSON."""

    write: Write
    text: str | None
    details: str | None = None


def prepare_writes(writes: Sequence[Write]) -> list[Prepared]:
    """Check every write of a commit and serialise its JSON; raise before writing."""
    writes = list(writes)
    if not writes:
        raise InvalidSessionWriteError("a commit needs at least one write")
    prepared: list[Prepared] = []
    for write in writes:
        if isinstance(write, AppendEntry):
            payload = entry_payload_json(write)
            if write.id is not None:
                check_id(write.id, "entry id")
            if write.parent_id is not None:
                check_id(write.parent_id, "parent id")
            prepared.append(Prepared(write, payload))
        elif isinstance(write, AddUsage):
            check_usage(write.usage)
            if write.id is not None:
                check_id(write.id, "usage id")
            if write.entry_id is not None:
                check_id(write.entry_id, "usage entry id")
            if not isinstance(write.adjustment, bool):
                raise InvalidSessionWriteError("usage adjustment must be a bool")
            details = None if write.details is None else dump_json(write.details, "details")
            prepared.append(Prepared(write, dump_json(dict(write.usage), "usage"), details))
        elif isinstance(write, SetRegister):
            check_text(write.namespace, "register namespace", allow_empty=False)
            check_text(write.key, "register key", allow_empty=True)
            prepared.append(Prepared(write, dump_json(write.value, "register value")))
        elif isinstance(write, DeleteRegister):
            check_text(write.namespace, "register namespace", allow_empty=False)
            check_text(write.key, "register key", allow_empty=True)
            prepared.append(Prepared(write, None))
        else:
            raise InvalidSessionWriteError(f"unknown write operation {write!r}")
    return prepared
