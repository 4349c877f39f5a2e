"""Canonical JSON: the one byte form in which payloads are hashed and stored.

Limits on what a writer may store: at most `MAX_PAYLOAD_BYTES` of canonical
JSON, nested at most `MAX_PAYLOAD_DEPTH` arrays/objects deep. Readers decode
every payload ever stored, including ones written before the depth limit
existed: what `json.loads` cannot decode comes back as a `RawPayload`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .errors import InvalidPayloadError, PayloadTooLargeError
from .json_text import dumps

MAX_PAYLOAD_BYTES = 1024 * 1024
#: Arrays and objects nested deeper than this are refused. Python's json module
#: recurses once per level, so a payload much deeper than this would make
#: writers and, worse, every later reader of the log raise RecursionError.
MAX_PAYLOAD_DEPTH = 64

_CONTAINERS = (dict, list, tuple)


@dataclass(frozen=True, slots=True)
class CanonicalPayload:
    text: str
    sha256: bytes


@dataclass(frozen=True, slots=True)
class RawPayload:
    """A stored payload that could not be decoded into Python values.

    Only payloads stored before `MAX_PAYLOAD_DEPTH` was enforced (nested deeper
    than `json.loads` can recurse), or rows written around pglease, come back
    like this; `text` is the stored JSON exactly, so nothing is lost.
    """

    text: str
    #: Why decoding failed, e.g. "nested too deeply to decode".
    reason: str

    def __str__(self) -> str:
        return self.text


def check_payload_depth(value: Any) -> None:
    """Raise InvalidPayloadError if arrays/objects nest deeper than MAX_PAYLOAD_DEPTH.

    Iterative (an explicit stack), so a 100,000-deep list is refused without
    recursing. It also stops cycles, which json.dumps would otherwise report.
    """
    if not isinstance(value, _CONTAINERS):
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise InvalidPayloadError(
                f"payload nests arrays/objects more than {MAX_PAYLOAD_DEPTH} levels deep"
            )
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, _CONTAINERS):
                push((child, depth + 1))


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, finite numbers only, UTF-8 kept as is, and
    numbers as JavaScript writes them (`1.0` -> `1`, `1e-07` -> `1e-7`), so
    the sha256 agrees with the harness's canonical JSON of the same value."""
    check_payload_depth(value)
    try:
        return dumps(value, sort_keys=True)
    except ValueError as exc:  # NaN / Infinity, circular references, 4300+ digit ints
        raise InvalidPayloadError(f"payload is not canonical JSON: {exc}") from None
    except TypeError as exc:  # non-str keys mixed with str, unknown objects
        raise InvalidPayloadError(f"payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        # The depth is bounded above, but a caller already deep in its own
        # recursion can still run out of stack here; report it typed.
        raise InvalidPayloadError("payload is nested too deeply to serialise") from None


def canonical_payload(value: Any) -> CanonicalPayload:
    text = canonical_json(value)
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPayloadError(f"payload contains invalid text: {exc.reason}") from None
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise PayloadTooLargeError(
            f"payload is {len(raw)} bytes of canonical JSON; the limit is {MAX_PAYLOAD_BYTES}"
        )
    return CanonicalPayload(text=text, sha256=hashlib.sha256(raw).digest())


def decode_payload(body: str | None) -> Any:
    """The stored payload text as Python values; never raises.

    None stays None. Text that `json.loads` cannot decode (a payload nested
    beyond the recursion limit, stored before MAX_PAYLOAD_DEPTH; or a row
    written around pglease that is not JSON) is returned as a `RawPayload` so
    that one bad row cannot stop a reader or a watcher from delivering it.
    """
    if body is None:
        return None
    try:
        return json.loads(body)
    except RecursionError:
        return RawPayload(body, "nested too deeply to decode")
    except ValueError as exc:  # JSONDecodeError, or an int of 4300+ digits
        return RawPayload(body, f"not decodable JSON: {exc}")
