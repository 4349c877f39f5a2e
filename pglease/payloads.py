"""Canonical JSON: the one byte form in which payloads are hashed and stored."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .errors import InvalidPayloadError, PayloadTooLargeError

MAX_PAYLOAD_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class CanonicalPayload:
    text: str
    sha256: bytes


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, finite numbers only, UTF-8 kept as is."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:  # NaN / Infinity, circular references
        raise InvalidPayloadError(f"payload is not canonical JSON: {exc}") from None
    except TypeError as exc:  # non-str keys mixed with str, unknown objects
        raise InvalidPayloadError(f"payload is not JSON-serialisable: {exc}") from None


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
