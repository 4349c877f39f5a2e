"""Leader election on top of leases: the leader is whoever holds the lease on
(``election``, name); its generation is the leader's fencing token (a term).

A candidate campaigns with a blocking acquire (woken by release/expiry events
and the known expiry, not a poll), then keeps the lease with the keeper. It
is deposed the moment the lease is lost (taken over, or its trust window
closed) and then campaigns again. Stopping with ``resign=True`` releases the
lease so another candidate is elected at once.

A candidate takes its keeper's connection before each campaign: while none can
be had it does not claim, it logs and tries again. ``clock=`` (default: the
keeper's, else the system clock) decides the trust window, as for `hold`.

The code is written once: `_election_async` is the source, `_election` its
generated blocking twin (tools/async_to_sync.py), `_election_core` what both
share; this module names them all.
"""

from __future__ import annotations

from ..driver.runtime_api import Leader as Leader
from ._election import Election, elect, leader
from ._election_async import AsyncElection, elect_async, leader_async
from ._election_core import _RETRY, ELECTION_TYPE, _call, _leader_of

__all__ = [
    "ELECTION_TYPE",
    "_RETRY",
    "AsyncElection",
    "Election",
    "Leader",
    "_call",
    "_leader_of",
    "elect",
    "elect_async",
    "leader",
    "leader_async",
]
