"""Input checks shared by every backend: each raises before anything is sent."""

from __future__ import annotations

import math
import re
import reprlib
from numbers import Real

from .errors import (
    InvalidEventTypeError,
    InvalidKeyError,
    InvalidOwnerError,
    InvalidResourceIdError,
    InvalidResourceTypeError,
    InvalidRevisionError,
    InvalidSchemaNameError,
    InvalidTokenError,
    InvalidTTLError,
    ValidationError,
)

#: Resource types, owner types: lowercase identifiers, e.g. ``run``, ``turn_intent``.
IDENTIFIER_PATTERN = r"[a-z][a-z0-9_]{0,62}"
_IDENTIFIER = re.compile(IDENTIFIER_PATTERN)
#: Event types: dotted lowercase identifiers, e.g. ``run.started``.
_EVENT_TYPE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*")
_RESOURCE_ID = re.compile(IDENTIFIER_PATTERN + r"-[0-9a-f]{40}")
#: Tokens are 32 random bytes, URL-safe base64 without padding.
_TOKEN = re.compile(r"[A-Za-z0-9_-]{43}")

MAX_KEY_BYTES = 1024
MAX_OWNER_ID_BYTES = 256
MAX_EVENT_TYPE_LENGTH = 128
MIN_TTL_SECONDS = 0.001
MAX_TTL_SECONDS = 7 * 24 * 3600.0
#: The most leases one `claim_many`, `renew_many` or `release_many` takes (the
#: SQL functions in sql/functions/15_batch.sql refuse more too).
MAX_BATCH = 1000
RESERVED_EVENT_PREFIX = "lease."
#: Schemas pglease must never install into: PostgreSQL's own and the shared default.
RESERVED_SCHEMAS = frozenset({"public", "information_schema"})
RESERVED_SCHEMA_PREFIX = "pg_"


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = 80


def describe(value: object) -> str:
    """repr() for error messages about caller input: bounded in length and nesting,
    and never raising. A plain ``f"{value!r}"`` of junk can itself fail: RecursionError
    for a list nested 2,000 deep, ValueError for an int of 4,300+ digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        sign = "negative " if value < 0 else ""
        return f"<{sign}int of {value.bit_length()} bits>"
    try:
        return _REPR.repr(value)
    except Exception:  # a broken __repr__ is the caller's; the refusal must still be typed
        return f"<{type(value).__name__}>"


def _text_bytes(value: object, what: str, error: type[Exception]) -> bytes:
    if not isinstance(value, str):
        raise error(f"{what} must be a str, got {type(value).__name__}")
    if value == "":
        raise error(f"{what} must not be empty")
    if "\x00" in value:
        raise error(f"{what} must not contain NUL characters")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not valid UTF-8 text: {exc.reason}") from None


def check_resource_type(value: object) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise InvalidResourceTypeError(
            f"resource type {describe(value)} must match {IDENTIFIER_PATTERN}"
            " (lowercase identifier)"
        )
    return value


def check_key(value: object) -> str:
    raw = _text_bytes(value, "resource key", InvalidKeyError)
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"resource key is {len(raw)} bytes; the limit is {MAX_KEY_BYTES}")
    assert isinstance(value, str)
    return value


def check_resource_id(value: object) -> str:
    if not isinstance(value, str) or not _RESOURCE_ID.fullmatch(value):
        raise InvalidResourceIdError(
            f"resource id {describe(value)} is not of the form TYPE-<40 hex digits>"
            " (use ensure_resource(type, key) to get one)"
        )
    return value


def check_owner_type(value: object) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise InvalidOwnerError(f"owner type {describe(value)} must match {IDENTIFIER_PATTERN}")
    return value


def check_owner_id(value: object) -> str:
    raw = _text_bytes(value, "owner id", InvalidOwnerError)
    if len(raw) > MAX_OWNER_ID_BYTES:
        raise InvalidOwnerError(f"owner id is {len(raw)} bytes; the limit is {MAX_OWNER_ID_BYTES}")
    assert isinstance(value, str)
    return value


def check_ttl(value: object) -> float:
    """Return the TTL in seconds; reject zero, negative, NaN, infinite and huge."""
    if type(value) is float and MIN_TTL_SECONDS <= value <= MAX_TTL_SECONDS:
        return value  # the common case, without the ABC check below
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidTTLError(f"ttl must be a number of seconds, got {type(value).__name__}")
    ttl = _to_float(value, "ttl", InvalidTTLError)
    if not math.isfinite(ttl):
        raise InvalidTTLError(f"ttl must be finite, got {ttl}")
    if ttl < MIN_TTL_SECONDS:
        raise InvalidTTLError(f"ttl must be at least {MIN_TTL_SECONDS} s, got {ttl}")
    if ttl > MAX_TTL_SECONDS:
        raise InvalidTTLError(f"ttl must be at most {MAX_TTL_SECONDS:.0f} s, got {ttl}")
    return ttl


def _to_float(value: Real, what: str, error: type[ValidationError]) -> float:
    """float(value), with the conversion's own failures (an int or Fraction beyond
    the float range, a broken __float__) reported as the typed refusal."""
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        raise error(f"{what} is out of range: not representable as seconds") from None


def check_timeout(value: object, what: str = "timeout") -> float | None:
    """A wait limit in seconds: None (no limit), or a number >= 0; +inf also means
    no limit. NaN, bools, non-numbers and numbers beyond the float range
    (``10**400``) raise ValidationError, never OverflowError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValidationError(f"{what} must be a number of seconds or None, got {describe(value)}")
    seconds = _to_float(value, what, ValidationError)
    if math.isnan(seconds):
        raise ValidationError(f"{what} must be a number of seconds or None, got {describe(value)}")
    if seconds < 0:
        raise ValidationError(f"{what} must not be negative")
    return seconds


def check_positive_seconds(
    value: object, what: str, error: type[ValidationError] = ValidationError
) -> float:
    """A positive, finite number of seconds (intervals, margins); huge ints and
    non-numbers raise `error`, never OverflowError or TypeError."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise error(f"{what} must be a number of seconds, got {describe(value)}")
    seconds = _to_float(value, what, error)
    if not math.isfinite(seconds) or seconds <= 0:
        raise error(f"{what} must be a positive, finite number of seconds")
    return seconds


def check_token(value: object) -> str:
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidTokenError(
            "lease token is malformed (expected the 43-character token from claim)"
        )
    return value


def check_revision(value: object, what: str = "expected_revision") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRevisionError(f"{what} must be an int, got {type(value).__name__}")
    if value < 0:
        raise InvalidRevisionError(f"{what} must be >= 0, got {describe(value)}")
    if value >= 2**63:
        raise InvalidRevisionError(f"{what} is out of range: {describe(value)}")
    return value


def check_optional_revision(value: object) -> int | None:
    return None if value is None else check_revision(value)


def check_event_type(value: object) -> str:
    if (
        not isinstance(value, str)
        or len(value) > MAX_EVENT_TYPE_LENGTH
        or not _EVENT_TYPE.fullmatch(value)
    ):
        raise InvalidEventTypeError(
            f"event type {describe(value)} must be dotted lowercase identifiers, e.g. 'run.started'"
        )
    if value.startswith(RESERVED_EVENT_PREFIX):
        raise InvalidEventTypeError(
            f"event type {describe(value)} uses the reserved prefix 'lease.'"
        )
    return value


def check_schema_name(value: object) -> str:
    """A lowercase identifier that is not reserved. pglease creates tables named
    ``resources``, ``events``... in its schema, so ``public`` would mix them with
    the application's own; ``information_schema`` and ``pg_*`` belong to
    PostgreSQL (CREATE SCHEMA refuses ``pg_`` names)."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise InvalidSchemaNameError(
            f"schema name {describe(value)} must match {IDENTIFIER_PATTERN}"
        )
    if value in RESERVED_SCHEMAS or value.startswith(RESERVED_SCHEMA_PREFIX):
        raise InvalidSchemaNameError(
            f"schema name {describe(value)} is reserved (public, information_schema and pg_* belong"
            " to PostgreSQL or to everything else in the database); pick a schema of pglease's"
            " own, e.g. 'pglease'"
        )
    return value


def check_apply(apply: object) -> None:
    """`apply` of a mutation: None or a callable. Checked before any I/O, so a
    wrong argument never opens a transaction."""
    if apply is not None and not callable(apply):
        raise ValidationError(
            "apply must be a callable taking the transaction's connection, or None;"
            f" got {describe(apply)}"
        )


def utf8_encodable(value: str) -> bool:
    """Whether `value` can be stored as UTF-8 text: false for a lone surrogate
    (``"\\ud800"``), which Python strings allow and no database or file does."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
