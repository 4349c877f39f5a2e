"""The parameters of the store driver protocol: one frozen value per operation.

The store (`pglease.store`) checks every argument once and hands a driver
exactly one of these; a driver never validates again, it only turns the value
into its own statements. Each carries what both backends need, already
hashed or encoded (a token's sha256, a payload's canonical text), so no
driver repeats that work either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from time import monotonic

from ..cursors import Cursor
from ..types import Claim, Owner, Permit


@dataclass(frozen=True, slots=True)
class EnsureOp:
    """Create the resource `(resource_type, key)` if needed (no event)."""

    resource_type: str
    key: str


@dataclass(frozen=True, slots=True)
class ClaimOp:
    """Take the lease on `resource_id` for `owner`; `token` is the new claim's secret."""

    resource_id: str
    owner: Owner
    token: str
    token_sha256: bytes
    ttl: float
    expected_revision: int | None
    now: datetime | None
    #: When the call started (`time.monotonic()`): the claim is trusted until
    #: then plus `ttl` (`Claim.trusted_until`).
    started: float = field(default_factory=monotonic)

    @property
    def trusted_until(self) -> float:
        """The new claim's `Claim.trusted_until`."""
        return self.started + self.ttl


@dataclass(frozen=True, slots=True)
class RenewOp:
    """Extend `claim` by `ttl` seconds from the store's clock (or `now`)."""

    claim: Claim
    token_sha256: bytes
    ttl: float
    expected_revision: int | None
    now: datetime | None
    #: When the call started (`time.monotonic()`), as `ClaimOp.started`.
    started: float = field(default_factory=monotonic)

    @property
    def trusted_until(self) -> float:
        """The renewed claim's `Claim.trusted_until`."""
        return self.started + self.ttl


@dataclass(frozen=True, slots=True)
class ReleaseOp:
    """Give up `claim`; the generation stays."""

    claim: Claim
    token_sha256: bytes
    expected_revision: int | None
    now: datetime | None


@dataclass(frozen=True, slots=True)
class MutateOp:
    """Check `permit`, run the writer's SQL and append one `event_type` event.

    `lease_token_sha256` is the permit's lease token hash (None: an unleased
    write); `actor` is None or, for a leased write, the lease owner;
    `payload_text` the payload's canonical JSON (None: no payload)."""

    permit: Permit
    event_type: str
    lease_token_sha256: bytes | None
    actor: Owner | None
    payload_text: str | None
    now: datetime | None


@dataclass(frozen=True, slots=True)
class GetOp:
    """Read one resource with its lease state, judged at the store's clock (or `now`)."""

    resource_id: str
    now: datetime | None


@dataclass(frozen=True, slots=True)
class ListOp:
    """Read every resource (or those of `resource_type`), ordered by type and key."""

    resource_type: str | None
    now: datetime | None


@dataclass(frozen=True, slots=True)
class EventsOp:
    """Read one resource's events after `after_revision`, at most `limit`."""

    resource_id: str
    after_revision: int
    limit: int


@dataclass(frozen=True, slots=True)
class ReadLogOp:
    """Read committed events of the whole log after `cursor` (parsed; its
    position is checked against the log by the driver)."""

    cursor: Cursor
    limit: int


@dataclass(frozen=True, slots=True)
class ClaimManyOp:
    """Take the leases on `resource_ids` (distinct) for `owner`, in one transaction;
    `tokens[i]` is the secret of the claim on `resource_ids[i]`."""

    resource_ids: tuple[str, ...]
    owner: Owner
    tokens: tuple[str, ...]
    token_sha256s: tuple[bytes, ...]
    ttl: float
    now: datetime | None
    #: When the call started (`time.monotonic()`), as `ClaimOp.started`.
    started: float = field(default_factory=monotonic)

    @property
    def trusted_until(self) -> float:
        """Each new claim's `Claim.trusted_until`."""
        return self.started + self.ttl


@dataclass(frozen=True, slots=True)
class RenewManyOp:
    """Extend each of `claims` (distinct resources) by `ttl`, in one transaction."""

    claims: tuple[Claim, ...]
    token_sha256s: tuple[bytes, ...]
    ttl: float
    now: datetime | None
    #: When the call started (`time.monotonic()`), as `ClaimOp.started`.
    started: float = field(default_factory=monotonic)

    @property
    def trusted_until(self) -> float:
        """Each renewed claim's `Claim.trusted_until`."""
        return self.started + self.ttl


@dataclass(frozen=True, slots=True)
class ReleaseManyOp:
    """Give up each of `claims` (distinct resources), in one transaction."""

    claims: tuple[Claim, ...]
    token_sha256s: tuple[bytes, ...]
    now: datetime | None
