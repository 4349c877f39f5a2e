"""What both flavours of an election share and neither waits for."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..driver.runtime_api import Leader
from ..types import ResourceState

log = logging.getLogger("pglease.runtime")

#: The resource type elections use; the election name is the key.
ELECTION_TYPE = "election"
#: After a failed campaign (no connection, an error), try again after this.
_RETRY = 0.5


def _leader_of(state: ResourceState) -> Leader | None:
    lease = state.lease
    if not lease.held or lease.owner is None or lease.expires_at is None:
        return None
    return Leader(lease.owner, lease.generation, lease.expires_at)


def _call(callback: Callable[[Any], object] | None, lease: Any, what: str) -> None:
    """Run a user callback; its failure is logged, never ends the campaign."""
    if callback is not None:
        try:
            callback(lease)
        except Exception:
            log.exception("%s callback failed", what)
