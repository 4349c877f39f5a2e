"""Value types returned and accepted by every store backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .errors import InvalidOwnerError
from .validation import check_owner_id, check_owner_type, describe


@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds a lease or acts: an owner type (``host``, ``session``...) and an id."""

    type: str
    id: str

    def __post_init__(self) -> None:
        check_owner_type(self.type)
        check_owner_id(self.id)

    @classmethod
    def parse(cls, text: str) -> Owner:
        """Parse ``TYPE:ID`` (the id may itself contain colons)."""
        if not isinstance(text, str):
            raise InvalidOwnerError(f"owner must be TYPE:ID text, got {type(text).__name__}")
        owner_type, sep, owner_id = text.partition(":")
        if not sep:
            raise InvalidOwnerError(
                f"owner {describe(text)} must be TYPE:ID (a type, a colon, an id), e.g. host:web-1"
            )
        return cls(owner_type, owner_id)

    def __str__(self) -> str:
        return f"{self.type}:{self.id}"


@dataclass(frozen=True, slots=True)
class Claim:
    """A granted lease. `token` is the secret proving ownership; keep it private.

    `generation` is the fencing token to hand to downstream systems; `revision`
    is the resource revision right after this claim (or the last renew).

    `trusted_until` is the end of the claim's local trust window: the
    `time.monotonic()` instant of this host until which the lease is certainly
    live by the database's clock (when the claim or renew request was sent,
    plus its ttl; the server set the expiry no earlier). None for a claim not
    returned by `claim` or `renew` in this process (rebuilt, or from the
    runtime). A `renew` on a silent network path gives up by then. It is
    local: not compared, not shown, meaningless in another process.
    """

    resource_id: str
    owner: Owner
    token: str = field(repr=False)
    generation: int
    expires_at: datetime
    revision: int
    trusted_until: float | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Permit:
    """A write permit: the revision the writer expects and, optionally, its lease."""

    resource_id: str
    expected_revision: int
    lease: Claim | None = None


@dataclass(frozen=True, slots=True)
class LeaseState:
    generation: int
    owner: Owner | None
    acquired_at: datetime | None
    heartbeat_at: datetime | None
    expires_at: datetime | None
    #: True when a holder is recorded and its lease is live by the database clock.
    held: bool
    #: When no one holds the lease but a claim is still refused: the last
    #: granted expiry of a revoked holder (`pglease revoke`, `resign`), by the
    #: database clock; None when a claim is not held back.
    claimable_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class ResourceState:
    id: str
    type: str
    key: str
    revision: int
    created_at: datetime
    updated_at: datetime
    lease: LeaseState


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the durable event log."""

    id: int
    cursor: str
    resource_id: str
    resource_type: str
    resource_key: str
    revision: int
    type: str
    actor: Owner | None
    lease_generation: int | None
    lease_expires_at: datetime | None
    #: The decoded JSON payload, or None. A stored payload that cannot be decoded
    #: (nested beyond Python's recursion limit, stored before MAX_PAYLOAD_DEPTH
    #: was enforced) is a `pglease.payloads.RawPayload` carrying the exact text,
    #: so reads and watchers still deliver the event.
    payload: Any
    payload_sha256: bytes | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class MutationResult:
    resource_id: str
    revision: int
    event_id: int
    #: Whatever the `apply` callback returned.
    value: Any = None
