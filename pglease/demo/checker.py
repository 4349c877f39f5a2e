"""Invariant checks over a resource's event log (the database's own record).

Used by the demo and the multi-process tests: the log alone must show that
there were never two live holders and that generations only ever rose by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ..types import Event


@dataclass
class History:
    resource_id: str
    claims: int = 0
    takeovers: int = 0
    releases: int = 0
    writes: int = 0
    final_generation: int = 0
    violations: list[str] = field(default_factory=list)


def check_history(resource_id: str, events: list[Event]) -> History:
    """Replay one resource's events in revision order and record every violation."""
    h = History(resource_id)
    generation = 0
    holder: tuple[int, datetime | None] | None = None  # (generation, expires_at)
    expected_revision = 1
    for e in events:
        if e.revision != expected_revision:
            h.violations.append(f"revision {e.revision} follows {expected_revision - 1}")
        expected_revision = e.revision + 1
        if e.type == "lease.claimed":
            h.claims += 1
            if e.lease_generation != generation + 1:
                h.violations.append(
                    f"claim at revision {e.revision} has generation {e.lease_generation},"
                    f" expected {generation + 1}"
                )
            if holder is not None:
                expires = holder[1]
                if expires is None or expires > e.created_at:
                    h.violations.append(
                        f"two holders: generation {e.lease_generation} claimed at"
                        f" {e.created_at.isoformat()} while generation {holder[0]} ran to"
                        f" {expires.isoformat() if expires else 'forever'}"
                    )
                h.takeovers += 1
            generation = e.lease_generation or 0
            holder = (generation, e.lease_expires_at)
        elif e.type == "lease.renewed":
            if holder is None or holder[0] != e.lease_generation:
                h.violations.append(f"renew by a non-holder at revision {e.revision}")
            elif holder[1] is not None and holder[1] <= e.created_at:
                h.violations.append(f"renew after expiry at revision {e.revision}")
            holder = (generation, e.lease_expires_at)
        elif e.type == "lease.released":
            h.releases += 1
            if holder is None or holder[0] != e.lease_generation:
                h.violations.append(f"release by a non-holder at revision {e.revision}")
            holder = None
        elif e.type.startswith("lease."):
            continue  # informational lease events (e.g. expiry) change no holder
        elif e.lease_generation is not None:
            h.writes += 1
            if holder is None or holder[0] != e.lease_generation:
                h.violations.append(
                    f"write at revision {e.revision} with generation {e.lease_generation}"
                    f" while the current generation is {generation}"
                )
            elif holder[1] is not None and holder[1] <= e.created_at:
                h.violations.append(f"write after expiry at revision {e.revision}")
    h.final_generation = generation
    return h
