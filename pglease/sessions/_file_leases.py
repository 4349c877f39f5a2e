"""The writer leases of a repository's open session files, as a keeper renews them.

Each file is its own database, so a keeper's beat is one short write
transaction per file (in resource-id order), judged there by the file's own
clock (the repository's `now_ms`), as `SqliteSession.renew` judges it:

* 'renewed': the lease row still names this handle's owner and fence and has
  not run out; its expiry moves to now + the lease length;
* 'lost': another writer took it over, or it was released;
* 'expired': still ours in the file, but it ran out before the beat came;
* 'busy': the handle is using its connection right now (a commit, which
  renews in its own transaction) or the file stayed locked past its
  `busy_timeout`: the keeper retries soon, until the trust window closes;
* 'unknown': the handle was dropped without closing: its lease runs out.
  (A file whose handle is closing answers 'busy' to a beat already under
  way: the keeper stopped tracking it, and closing is no loss.)

Blocking functions; the asyncio keeper calls them in a worker thread.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import weakref
from collections.abc import Sequence
from datetime import UTC, datetime

from ..driver import HeartbeatItem, HeartbeatResult
from ..driver.protocol import HeartbeatStatus
from ..types import Claim, Owner
from ._file_db import transaction
from ._file_ops import SessionFile
from ._file_rows import read_lease, release_lease
from .errors import SessionError, SessionFileBusyError, WriterLeaseLostError

log = logging.getLogger("pglease.sessions")

#: The owner type of a session file's writer lease, as the keeper names it.
OWNER_TYPE = "session"


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def file_claim(file: SessionFile) -> Claim:
    """The file's writer lease as a keeper's `Claim`: the fence is the
    generation; the owner id proves the holder (there is no token)."""
    return Claim(
        resource_id=file.id,
        owner=Owner(OWNER_TYPE, file.owner_id),
        token=file.owner_id,
        generation=file.fence,
        expires_at=_at(file.now_ms() + file.lease_ms),
        revision=0,
    )


class FileLeases:
    """The open files whose leases a keeper holds, by session id (weakly:
    a dropped handle's file is not kept open, and its lease runs out)."""

    def __init__(self) -> None:
        self._files: weakref.WeakValueDictionary[str, SessionFile] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._inflight: sqlite3.Connection | None = None

    def add(self, file: SessionFile) -> None:
        """Renew `file`'s lease from now on (until its handle closes or is dropped)."""
        with self._lock:
            self._files[file.id] = file

    def _current(self, claim: Claim) -> SessionFile | None:
        with self._lock:
            file = self._files.get(claim.resource_id)
        if file is None or file.owner_id != claim.owner.id or file.fence != claim.generation:
            return None
        return file

    def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        """Renew each lease of `batch` in its own file (see the module docstring)."""
        results: list[HeartbeatResult] = []
        for item in sorted(batch, key=lambda i: i.claim.resource_id):
            file = self._current(item.claim)
            if file is None:
                results.append(HeartbeatResult(item.claim.resource_id, "unknown", None, None))
            else:
                results.append(self._beat(file))
        return results

    def _beat(self, file: SessionFile) -> HeartbeatResult:
        status: HeartbeatStatus
        # Never wait for the handle's own work: a commit renews in its transaction.
        if not file.lock.acquire(blocking=False):
            return HeartbeatResult(file.id, "busy", None, None)
        try:
            if file.closing or file.closed:
                # Its handle gave it up (the keeper no longer tracks it): a beat
                # already under way must not report that as a loss.
                return HeartbeatResult(file.id, "busy", None, None)
            conn = file.conn
            with self._lock:
                self._inflight = conn
            expires = None
            with file.io(), transaction(conn):
                lease = read_lease(conn)
                now = file.now_ms()
                if lease is None or (lease.owner_id, lease.fence) != (file.owner_id, file.fence):
                    status = "lost"
                elif lease.expires_at_ms <= now:
                    status = "expired"
                else:
                    status = "renewed"
                    expires = now + file.lease_ms
                    conn.execute(
                        "UPDATE writer_lease SET expires_at_ms = ?"
                        " WHERE owner_id = ? AND fence = ?",
                        (expires, file.owner_id, file.fence),
                    )
            generation = None if lease is None else lease.fence
            return HeartbeatResult(
                file.id, status, None if expires is None else _at(expires), generation
            )
        except SessionFileBusyError:
            return HeartbeatResult(file.id, "busy", None, None)
        except SessionError as exc:
            # I/O trouble on this file alone: retried like a busy file (until
            # the trust window closes), without holding up the other files.
            log.warning("session %s: lease renewal failed, will retry: %s", file.id, exc)
            return HeartbeatResult(file.id, "busy", None, None)
        finally:
            with self._lock:
                self._inflight = None
            file.lock.release()

    def release(self, claim: Claim) -> None:
        """Give back a lease the keeper gave up on (its trust window closed):
        release the row if it is still this owner's and fence's (its fence kept)."""
        file = self._current(claim)
        if file is None:
            raise WriterLeaseLostError(f"session {claim.resource_id}: the handle is gone")
        with file.lock:
            if file.closed:
                raise WriterLeaseLostError(f"session {file.id}: the handle is closed")
            with file.io(), transaction(file.conn):
                released = release_lease(file.conn, file.owner_id, file.fence)
            if not released:
                raise WriterLeaseLostError(f"session {file.id}: the lease is no longer this one")

    def abort(self) -> None:
        """Interrupt the beat's statement (not a wait for the file's lock,
        which `busy_timeout` bounds)."""
        with self._lock:
            if self._inflight is not None:
                self._inflight.interrupt()
