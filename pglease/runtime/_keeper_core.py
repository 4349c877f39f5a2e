"""The keeper's bookkeeping, free of I/O, shared by the thread and the task twins."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .. import _instrument
from ..clock import Clock
from ..driver import HeartbeatItem, HeartbeatResult
from ..types import Claim
from .lease import _LeaseBase

log = logging.getLogger("pglease.runtime")

L = TypeVar("L", bound=_LeaseBase)

#: Row-locked leases ('busy') are retried after this many seconds at most.
BUSY_RETRY = 0.05
#: Transient errors: retry after 50 ms, doubling, at most a quarter interval.
ERROR_RETRY = 0.05
#: A beat is never abandoned sooner than this (seconds).
MIN_BEAT_LIMIT = 0.05

TRUST_CLOSED = "the local trust window closed without a successful renewal"
#: Why a held lease is lost when this host claims a newer generation of its resource.
SUPERSEDED = "a newer generation of the same resource was claimed on this host"
_STATUS_REASON = {
    "lost": "the database no longer has it (released, taken over, or another token)",
    "expired": "its ttl ran out in the database before a heartbeat reached it",
    "unknown": "the resource does not exist",
}
#: The leases_lost_total cause of each heartbeat status that means the lease is gone.
_STATUS_CAUSE = {"lost": "not_current", "expired": "expired", "unknown": "unknown_resource"}


@dataclass
class KeeperStats:
    """Counters a keeper keeps; read them for monitoring or in benchmarks."""

    beats: int = 0
    late_beats: int = 0
    errors: int = 0
    renewed: int = 0
    lost: int = 0
    #: Real duration of the last beat's round trip, seconds (measured with
    #: `time.monotonic()` whatever the keeper's clock: it describes the host).
    last_beat_seconds: float = 0.0
    #: Leases in the last beat.
    last_beat_size: int = 0
    #: Beats (or releases) abandoned because they outlasted their limit, e.g.
    #: on a dead connection; the keeper reconnects and retries.
    aborted: int = 0


class KeeperCore(Generic[L]):
    """Which leases are due, and what a beat's answer means for each.

    Every instant here (`now`, `started`, due times, deadlines) is a reading of
    `clock`; the keeper turns the differences into real waits (`real_wait`).
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.leases: dict[str, L] = {}
        #: Counts `leases` in the leases-held gauge until the keeper closes.
        self.tracked = _instrument.track_keeper(self.leases)
        self.stats = KeeperStats()
        self._error_streak = 0
        #: Leases lost by the local clock while maybe still current in the
        #: database: released (best effort) so that others need not wait.
        self.to_release: list[L] = []
        #: Claims never handed out (won after their trust window): released too.
        self.give_back: list[Claim] = []

    def take_releases(self) -> list[Claim]:
        """The claims to release now (lost leases', then those never handed out)."""
        claims = [lease.claim for lease in self.to_release] + self.give_back
        self.to_release, self.give_back = [], []
        return claims

    def add(self, lease: L) -> L | None:
        """Track `lease`; return a lease it supersedes (same resource, older generation)."""
        old = self.leases.get(lease.resource_id)
        self.leases[lease.resource_id] = lease
        return old if old is not lease else None

    def remove(self, lease: L) -> None:
        if self.leases.get(lease.resource_id) is lease:
            del self.leases[lease.resource_id]

    def sweep(self, now: float) -> list[L]:
        """Drop leases that are lost or past their trust deadline; return the newly lost."""
        lost: list[L] = []
        for rid, lease in list(self.leases.items()):
            if lease.lost_error is None and lease.deadline <= now:
                lost.append(lease)
            if lease.lost_error is not None or lease.deadline <= now:
                del self.leases[rid]
                self.to_release.append(lease)
        return lost

    def next_due(self) -> float | None:
        return min((lease.next_due for lease in self.leases.values()), default=None)

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leases.values()), default=None)

    def due_batch(self, now: float) -> list[L]:
        """Every lease due within half its interval: beats coalesce into one round trip."""
        earliest = self.next_due()
        if earliest is None or earliest > now:
            return []
        batch = [
            lease
            for lease in self.leases.values()
            if lease.lost_error is None and lease.next_due - lease.timing.interval / 2 <= now
        ]
        late = now - earliest
        if batch:
            _instrument.recorder.heartbeat_lateness(max(0.0, late))
        if batch and late > min(lease.timing.late_after for lease in batch):
            self.stats.late_beats += 1
            log.warning(
                "heartbeat late by %.3fs for %d lease(s): the keeper was starved"
                " (blocked event loop, GIL, GC pause, overloaded host?)",
                late,
                len(batch),
            )
        return batch

    def beat_limit(self, batch: Sequence[L], started: float) -> float:
        """How long a beat started at `started` may take before it is abandoned.

        Half the time left until the batch's first trust window closes: a beat
        stuck on a dead connection (a partition, a frozen server, a lost TCP
        peer) is cut off while the other half still leaves room to reconnect
        and renew; a beat that is merely slow usually finishes first. The
        length comes from the clock; the keeper spends it as a real-time bound
        (a frozen fake clock must not leave a dead connection hanging).
        """
        window = min(lease.deadline for lease in batch) - started
        return max(MIN_BEAT_LIMIT, window / 2)

    def items(self, batch: Sequence[L]) -> list[HeartbeatItem]:
        """The batch as the driver's heartbeat parameters."""
        return [lease.heartbeat_item for lease in batch]

    def on_rows(
        self,
        batch: Sequence[L],
        rows: Sequence[HeartbeatResult],
        started: float,
        round_trip: float,
    ) -> list[tuple[L, str, str]]:
        """Apply a beat's answer; return the leases the database says are gone, with
        why and the cause to count them under (`_LeaseBase._lose`).

        `started` is the beat's start on the clock, `round_trip` its real duration.
        """
        recorder = _instrument.recorder
        recorder.heartbeat(round_trip)
        self._error_streak = 0
        self.stats.beats += 1
        self.stats.last_beat_size = len(batch)
        self.stats.last_beat_seconds = round_trip
        by_id = {row.resource_id: row for row in rows}
        gone: list[tuple[L, str, str]] = []
        for lease in batch:
            row = by_id.get(lease.resource_id)
            status = row.status if row is not None else "unknown"
            if status == "renewed":
                assert row is not None and row.expires_at is not None
                if lease._renewed(started, row.expires_at):
                    self.stats.renewed += 1
                    recorder.renewal("keeper", "renewed")
                else:
                    # The answer came after the trust window closed (or the holder
                    # already saw it lost): lost for good, and handed back.
                    self.remove(lease)
                    self.to_release.append(lease)
                    recorder.renewal("keeper", "lost")
                    if lease.lost_error is None:
                        gone.append((lease, TRUST_CLOSED, "trust_window"))
            elif status == "busy":
                # Locked by a writer (usually the holder's own mutation): soon again.
                recorder.renewal("keeper", "busy")
                lease.next_due = self.clock.monotonic() + min(BUSY_RETRY, lease.timing.interval / 4)
            else:
                reason = _STATUS_REASON.get(status, status)
                if row is not None and status == "lost" and row.generation != lease.generation:
                    reason += f" (current generation {row.generation})"
                self.remove(lease)
                self.stats.lost += 1
                recorder.renewal("keeper", "lost")
                gone.append((lease, reason, _STATUS_CAUSE.get(status, "not_current")))
        return gone

    def on_error(self, batch: Sequence[L], exc: BaseException) -> None:
        """A transient failure: retry soon, until each lease's trust window closes."""
        self.stats.errors += 1
        _instrument.recorder.heartbeat_failed()
        self._error_streak += 1
        delay = ERROR_RETRY * 2 ** min(self._error_streak - 1, 6)
        if self._error_streak == 1:
            log.warning("heartbeat failed, retrying until the trust windows close: %s", exc)
        now = self.clock.monotonic()
        for lease in batch:
            lease.next_due = now + min(delay, lease.timing.interval / 4)
