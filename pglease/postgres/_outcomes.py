"""What a driver error in a store call becomes when the call may have committed.

A connection lost after a write was sent leaves its outcome unknown; these
builders word the `CommitOutcomeUnknownError` with what to read to find out
(claim, renew, release, mutate), and map mutation errors by phase.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from ..errors import CommitOutcomeUnknownError, PgleaseError
from ..types import Claim, Owner, Permit
from ._core import NOTHING_COMMITTED, Limits, driver_error, lost, outcome_unknown, translate


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


def mutate_error(
    exc: psycopg.Error,
    broken: bool,
    phase: str,
    permit: Permit,
    event_type: str,
    limits: Limits,
    dsn: str | None,
) -> PgleaseError | None:
    """What a driver error in `mutate` becomes; None: re-raise it unchanged.

    The caller's own SQL in `apply` is theirs: its errors (a UniqueViolation,
    a syntax error) reach them as psycopg raised them, as any exception of
    `apply` does. Mapped are the failures pglease causes or must explain: a
    lost connection, the store's time limits, pglease's own SQLSTATEs.
    """
    if broken:
        if phase == COMMIT:
            return mutate_unknown(exc, permit, event_type, dsn)
        # COMMIT was never sent: the server rolls the open transaction back.
        return lost(exc, dsn, NOTHING_COMMITTED)
    if phase == APPLY:
        return translate(exc, limits)
    return driver_error(exc, limits, dsn)
