"""The reaper: turns leases that ran out without a release into `lease.expired` events.

Any host may run one. A pglease lease on the resource (``pglease``,
``reaper``) elects one reaper at a time, to save work; correctness does not
depend on it: `reap_next` (sql/0008_reap_per_lease.sql) reaps one lease per
transaction, under the resource's advisory lock and the lease row lock like
every writer, and writes the event at most once per generation (the
`expired_generation` marker), so two reapers racing after a failover produce
no duplicate.

Bounded delay: an expired lease gets its event within `interval` (plus one
reaper-lease TTL if the reaping host died) after its TTL ran out, or sooner: a
claim that takes over an expired lease the reaper has not reached yet writes
that generation's `lease.expired` itself, in its own transaction, right before
its `lease.claimed` (sql/0007_expiry_gc.sql). Both set the same marker, so a
generation never gets two.

On SQLite (`pglease.sqlite.maintenance`) the same rules hold: one lease per
write transaction, the same marker, and a takeover that beats the reaper
records the expiry itself. Everything here goes through the store's runtime
driver (`pglease.driver.maintenance`), so it runs on every store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any, Protocol

from .. import _instrument
from .._watch_common import check_interval
from ..driver.maintenance import AsyncMaintenanceDriver, MaintenanceDriver, ReapRequest
from ..errors import ValidationError
from ..types import Claim, Owner

log = logging.getLogger("pglease.watch.reaper")

REAPER_RESOURCE = ("pglease", "reaper")
DEFAULT_LIMIT = 1000


def _check_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100_000:
        raise ValidationError("limit must be an int between 1 and 100000")
    return limit


class _Reapable(Protocol):
    def runtime_driver(self) -> MaintenanceDriver: ...


class _AsyncReapable(Protocol):
    def runtime_driver(self) -> AsyncMaintenanceDriver: ...


def reap_once(store: _Reapable, limit: int = DEFAULT_LIMIT) -> int:
    """Write `lease.expired` for up to `limit` expired, unreaped leases; return how many.

    One lease per transaction: a batch in one transaction could be refused by
    PostgreSQL's per-resource event-order guard as a whole whenever a write
    to one of its later leases committed meanwhile. Leases a writer is busy
    with are left for the next call. Works on every store (PostgreSQL and
    SQLite); leases reaped before an error stay reaped.
    """
    report = store.runtime_driver().reap(ReapRequest(_check_limit(limit)))
    _instrument.recorder.reaped(report.reaped)
    return report.reaped


async def reap_once_async(store: _AsyncReapable, limit: int = DEFAULT_LIMIT) -> int:
    """Asyncio twin of `reap_once`."""
    report = await store.runtime_driver().reap(ReapRequest(_check_limit(limit)))
    _instrument.recorder.reaped(report.reaped)
    return report.reaped


class _LeaseStore(_Reapable, Protocol):
    def ensure_resource(self, resource_type: str, key: str) -> str: ...
    def claim(self, resource_id: str, owner: Owner, ttl: float) -> Claim | None: ...
    def renew(self, claim: Claim, ttl: float) -> Claim: ...
    def release(self, claim: Claim) -> int: ...


class Reaper:
    """Run `reap_once` every `interval` seconds in a thread while holding the reaper lease.

    ``with Reaper(store, Owner("host", name)):`` or `start()` / `stop()`.
    The lease is renewed every `lease_ttl / 3`; on loss another host's reaper
    takes over within `lease_ttl`.
    """

    def __init__(
        self,
        store: Any,
        owner: Owner,
        *,
        interval: float = 0.5,
        lease_ttl: float = 15.0,
        limit: int = DEFAULT_LIMIT,
    ) -> None:
        if not isinstance(owner, Owner):
            raise ValidationError(f"owner must be an Owner, got {type(owner).__name__}")
        self.store: _LeaseStore = store
        self.owner = owner
        self.interval = check_interval(interval, "interval")
        self.lease_ttl = check_interval(lease_ttl, "lease_ttl")
        self.limit = _check_limit(limit)
        self.reaped = 0
        self._claim: Claim | None = None
        self._renewed = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """True while this reaper holds the reaper lease."""
        return self._claim is not None

    def __enter__(self) -> Reaper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pglease-reaper", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and release the reaper lease so another host takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._claim is not None:
            with contextlib.suppress(Exception):  # it expires on its own anyway
                self.store.release(self._claim)
            self._claim = None

    def run_once(self) -> int:
        """One step: hold (claim or renew) the reaper lease, then reap if held."""
        now = time.monotonic()
        if self._claim is None:
            rid = self.store.ensure_resource(*REAPER_RESOURCE)
            self._claim = self.store.claim(rid, self.owner, self.lease_ttl)
            self._renewed = now
        elif now - self._renewed >= self.lease_ttl / 3:
            try:
                self._claim = self.store.renew(self._claim, self.lease_ttl)
                self._renewed = now
            except Exception:
                self._claim = None  # lost it (or the server is away): re-claim next time
                raise
        if self._claim is None:
            return 0
        count = reap_once(self.store, self.limit)
        self.reaped += count
        return count

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception as exc:  # keep reaping after transient errors
                log.warning("pglease reaper step failed: %s", exc)
            self._stop.wait(self.interval)


async def run_reaper_async(
    store: Any,
    owner: Owner,
    *,
    interval: float = 0.5,
    lease_ttl: float = 15.0,
    limit: int = DEFAULT_LIMIT,
) -> None:
    """Asyncio twin of `Reaper`: run until cancelled (then release the reaper lease)."""
    interval = check_interval(interval, "interval")
    lease_ttl = check_interval(lease_ttl, "lease_ttl")
    claim: Claim | None = None
    renewed = 0.0
    try:
        while True:
            try:
                now = time.monotonic()
                if claim is None:
                    rid = await store.ensure_resource(*REAPER_RESOURCE)
                    claim = await store.claim(rid, owner, lease_ttl)
                    renewed = now
                elif now - renewed >= lease_ttl / 3:
                    try:
                        claim = await store.renew(claim, lease_ttl)
                        renewed = now
                    except Exception:
                        claim = None
                        raise
                if claim is not None:
                    await reap_once_async(store, limit)
            except Exception as exc:
                log.warning("pglease reaper step failed: %s", exc)
            await asyncio.sleep(interval)
    finally:
        if claim is not None:
            with contextlib.suppress(Exception):
                await store.release(claim)
