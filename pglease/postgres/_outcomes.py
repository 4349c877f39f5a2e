"""What a driver error in a store call becomes when the call may have committed.

A connection lost after a write was sent leaves its outcome unknown; these
builders word the `CommitOutcomeUnknownError` with what to read to find out
(claim, renew, release, mutate), and map mutation errors by phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import psycopg

from ..errors import CommitOutcomeUnknownError, LeaseExpiredError, PgleaseError
from ..types import Claim, Owner, Permit
from ._core import (
    NOTHING_COMMITTED,
    Limits,
    _detail,
    driver_error,
    lost,
    outcome_unknown,
    translate,
)


def claim_unknown(
    resource_id: str, owner: Owner, token: str, ttl: float, dsn: str | None
) -> Callable[[psycopg.Error], PgleaseError]:
    def unknown(exc: psycopg.Error) -> PgleaseError:
        check = (
            f"read get({resource_id!r}).lease: if it shows {owner.type}:{owner.id} holding it,"
            " the claim probably committed (renew or release it with this error's `.token`"
            f" and that generation); a lease taken this way and never renewed runs out after"
            f" its ttl of {ttl:g} s"
        )
        return outcome_unknown(exc, "claim", resource_id, check, dsn, owner=owner, token=token)

    return unknown


def renew_unknown(claim: Claim, dsn: str | None) -> Callable[[psycopg.Error], PgleaseError]:
    def unknown(exc: psycopg.Error) -> PgleaseError:
        check = (
            f"read get({claim.resource_id!r}): revision {claim.revision + 1} with generation"
            f" {claim.generation} held means it committed; otherwise the lease still runs"
            f" out at {claim.expires_at.isoformat()}"
        )
        return outcome_unknown(exc, "renew", claim.resource_id, check, dsn, owner=claim.owner)

    return unknown


def release_unknown(claim: Claim, dsn: str | None) -> Callable[[psycopg.Error], PgleaseError]:
    def unknown(exc: psycopg.Error) -> PgleaseError:
        check = (
            f"read get({claim.resource_id!r}).lease: generation {claim.generation} no longer"
            " held means it is released (or ran out); otherwise release again"
        )
        return outcome_unknown(exc, "release", claim.resource_id, check, dsn, owner=claim.owner)

    return unknown


def mutate_unknown(
    exc: psycopg.Error, permit: Permit, event_type: str, dsn: str | None
) -> CommitOutcomeUnknownError:
    expected = permit.expected_revision
    check = (
        f"read get({permit.resource_id!r}).revision (or its events): the {event_type!r} event"
        f" at revision {expected + 1} means it committed, revision {expected} that it did not"
    )
    owner = permit.lease.owner if permit.lease is not None else None
    return outcome_unknown(exc, "mutate", permit.resource_id, check, dsn, owner=owner)


BEGIN, APPLY, COMMIT = "begin", "apply", "commit"  # the phases of a mutation

#: How the server ends a fenced transaction that outlives its lease
#: (_bound_by_lease): a statement timeout cancels the statement; the idle and
#: transaction timeouts end the session (so the connection is broken too).
_SERVER_CUTS = frozenset({"57014", "25P03", "25P04"})


@dataclass(frozen=True, slots=True)
class Fence:
    """The time of a fenced mutation's transaction, on this host's monotonic clock.

    `left`: the seconds its lease had left by the database clock when
    mutate_begin checked it; `begun`: when that result arrived here, so after the
    check; `commit_sent`: when the block was left to send COMMIT. Whatever the
    network delays, `begun + left` is no earlier than the lease's expiry: a
    COMMIT sent after it reaches the server after the expiry, where the fence at
    commit refuses it or the server has already ended the transaction.
    """

    left: float
    begun: float
    commit_sent: float | None = None

    @classmethod
    def of(cls, left: object, now: float) -> Fence | None:
        """From mutate_begin's `pglease.lease_left`; None for an unfenced mutation."""
        if left is None or left == "":
            return None
        return cls(float(str(left)), now)

    def at_commit(self, now: float) -> Fence:
        return replace(self, commit_sent=now)

    def overran(self, now: float) -> bool:
        """Whether the lease had run out when COMMIT was sent (if it was), else by `now`."""
        at = self.commit_sent if self.commit_sent is not None else now
        return at - self.begun >= self.left


def lease_ran_out(exc: psycopg.Error, permit: Permit, dsn: str | None) -> LeaseExpiredError:
    """A fenced transaction the server ended because its lease ran out."""
    lease = permit.lease
    what = f"lease generation {lease.generation} on {permit.resource_id}" if lease else "lease"
    return LeaseExpiredError(
        f"{what} ran out during the fenced mutation: the server ends such a transaction"
        f" just after the lease's expiry; nothing was committed ({_detail(exc, dsn)})"
    )


def mutate_error(
    exc: psycopg.Error,
    broken: bool,
    phase: str,
    permit: Permit,
    event_type: str,
    limits: Limits,
    dsn: str | None,
    overran: bool = False,
) -> PgleaseError | None:
    """What a driver error in `mutate` becomes; None: re-raise it unchanged.

    The caller's own SQL in `apply` is theirs: its errors (a UniqueViolation,
    a syntax error) reach them as psycopg raised them, as any exception of
    `apply` does. Mapped are the failures pglease causes or must explain: a
    lost connection, the store's time limits, pglease's own SQLSTATEs.

    `overran`: a fenced mutation's lease had run out (`Fence.overran`). Then a
    lost connection or a timeout is the server ending the transaction at the
    lease's expiry (or a COMMIT too late to be accepted): nothing committed.
    """
    if overran and (broken or exc.diag.sqlstate in _SERVER_CUTS):
        return lease_ran_out(exc, permit, dsn)
    if broken:
        if phase == COMMIT:
            return mutate_unknown(exc, permit, event_type, dsn)
        # COMMIT was never sent: the server rolls the open transaction back.
        return lost(exc, dsn, NOTHING_COMMITTED)
    if phase == APPLY:
        return translate(exc, limits)
    return driver_error(exc, limits, dsn)
