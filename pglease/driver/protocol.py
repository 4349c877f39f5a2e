"""Parameters, results and operations of the runtime driver protocol.

Every parameter and result is a frozen dataclass, so what crosses the
boundary between the runtime and a backend is a value, never a driver object.
Time is always the backend's own: a claim attempt reports the instant its
answer was judged at (`ClaimAttempt.judged_at`) next to the holder's expiry,
so a waiter turns the difference into a local delay without comparing its
wall clock with the database's.

Every operation raises only `PgleaseError`s; a driver maps its own errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from ..types import Claim, Owner
from .ops import EnsureOp

#: How a heartbeat judged one lease. 'busy': its row is locked right now (a
#: writer holds it; retry soon); 'lost': released, taken over, other token;
#: 'expired': still recorded but its ttl ran out; 'unknown': no such resource.
HeartbeatStatus = Literal["renewed", "busy", "lost", "expired", "unknown"]


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """One claim attempt of a blocking acquire.

    `token` is the secret the claim will carry (only its hash is sent). A fair
    attempt names its queue entry (`waiter`) and how long the entry lives
    without a refresh (`waiter_ttl`).
    """

    resource_id: str
    owner: Owner
    token: str
    ttl: float
    waiter: str | None = None
    waiter_ttl: float | None = None

    @property
    def fair(self) -> bool:
        return self.waiter is not None


@dataclass(frozen=True, slots=True)
class ClaimAttempt:
    """The backend's answer to a `ClaimRequest`.

    Claimed: `generation`, `expires_at` and `revision` are the new claim's.
    Refused: `expires_at` is the live holder's expiry (None when a fair
    waiter is refused for its place in the queue and nobody holds the lease),
    `holder` the holder, `position` the number of live fair waiters ahead and
    `head_expires_at` when the queue head's entry runs out.
    """

    claimed: bool
    generation: int
    expires_at: datetime | None
    revision: int
    holder: Owner | None
    position: int
    head_expires_at: datetime | None
    #: The backend's clock when it judged the attempt.
    judged_at: datetime


@dataclass(frozen=True, slots=True)
class LeaveQueue:
    """A fair waiter gives up: its queue entry goes at once."""

    resource_id: str
    waiter: str


@dataclass(frozen=True, slots=True)
class HeartbeatItem:
    """One lease of a heartbeat batch and the ttl to extend it by."""

    claim: Claim
    ttl: float


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """How a heartbeat judged one lease; `expires_at` is set when renewed,
    `generation` is the lease's current generation when known."""

    resource_id: str
    status: HeartbeatStatus
    expires_at: datetime | None
    generation: int | None


class HeartbeatChannel(Protocol):
    """A keeper's own line to the backend (never a pooled connection).

    `abort` may be called from another thread while `heartbeat` or `release`
    runs: it makes that call fail soon (a dead connection must not outlast
    the trust window); the next call reconnects.
    """

    def connect(self, timeout: float | None = None) -> None:
        """Open the line now unless it is open (`DatabaseUnavailableError`);
        `timeout` (seconds) shortens the line's own connect timeout."""

    def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        """Extend every current, unexpired lease of `batch` in one round trip."""

    def release(self, claim: Claim) -> None:
        """Release `claim` (a `LeaseLostError` when it is no longer current)."""

    def abort(self) -> None:
        """Cut off the call in flight, if any; never blocks."""

    def close(self) -> None:
        """Close the line; a later call opens a new one."""


class AsyncHeartbeatChannel(Protocol):
    """The asyncio twin of `HeartbeatChannel`; `abort` is called from a loop callback."""

    async def connect(self, timeout: float | None = None) -> None:
        """Open the line now unless it is open (at most `timeout` seconds)."""

    async def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        """Extend every current, unexpired lease of `batch` in one round trip."""

    async def release(self, claim: Claim) -> None:
        """Release `claim` (a `LeaseLostError` when it is no longer current)."""

    def abort(self) -> None:
        """Cut off the call in flight, if any; never blocks."""

    async def close(self) -> None:
        """Close the line."""


class ChangeFeed(Protocol):
    """Wake-ups for changes of one resource (its release and expiry events),
    positioned when created: a change committed afterwards is delivered."""

    def get(self, timeout: float | None = None) -> object | None:
        """The next change, or None after `timeout` seconds (bounded)."""

    def close(self) -> None:
        """Stop the feed."""


class AsyncChangeFeed(Protocol):
    """The asyncio twin of `ChangeFeed`; positioned once `start` returned."""

    async def get(self, timeout: float | None = None) -> object | None:
        """The next change, or None after `timeout` seconds (bounded)."""

    async def aclose(self) -> None:
        """Stop the feed."""


class RuntimeDriver(Protocol):
    """What the blocking runtime needs from a backend."""

    def ensure_resource(self, op: EnsureOp, timeout: float | None = None) -> str:
        """Create the resource if needed and return its id.

        `timeout` (seconds, here and below): the longest the call may wait for
        the backend's answer, on top of the store's own limits (an acquire
        spends its own timeout this way); None leaves the store's limits."""

    def attempt_claim(
        self, request: ClaimRequest, timeout: float | None = None
    ) -> ClaimAttempt | None:
        """Claim (fair: through the queue), or None when the lease row stayed
        locked past the store's lock limit (nothing changed: retry). A claim
        sent but unanswered within `timeout` raises `CommitOutcomeUnknownError`
        carrying the request's token."""

    def leave_queue(self, request: LeaveQueue, timeout: float | None = None) -> None:
        """Delete a fair waiter's queue entry (no error when it is gone)."""

    def heartbeat_channel(self, connect_timeout: float) -> HeartbeatChannel:
        """A new line for a keeper."""

    def changes(self, resource_id: str, event_types: Sequence[str]) -> ChangeFeed:
        """A feed of `event_types` events on `resource_id`, from now on."""


class AsyncRuntimeDriver(Protocol):
    """What the asyncio runtime needs from a backend."""

    async def ensure_resource(self, op: EnsureOp, timeout: float | None = None) -> str:
        """Asyncio twin of `RuntimeDriver.ensure_resource`."""

    async def attempt_claim(
        self, request: ClaimRequest, timeout: float | None = None
    ) -> ClaimAttempt | None:
        """Asyncio twin of `RuntimeDriver.attempt_claim`."""

    async def leave_queue(self, request: LeaveQueue, timeout: float | None = None) -> None:
        """Asyncio twin of `RuntimeDriver.leave_queue`."""

    def heartbeat_channel(self, connect_timeout: float) -> AsyncHeartbeatChannel:
        """A new line for an asyncio keeper."""

    async def changes(self, resource_id: str, event_types: Sequence[str]) -> AsyncChangeFeed:
        """A started feed of `event_types` events on `resource_id`, from now on."""
