"""Waiting rooms: the blocked `acquire` calls of one process on one resource share
one watcher subscription, and a release wakes one of them, not all.

Without this every waiter opened its own watcher, and every `lease.released`
woke every waiter of the process at once: N claims for one free lease, N - 1
refused (the thundering herd). A room is keyed by (process, store, resource,
event loop for asyncio). It owns one change feed of the store's runtime
driver (`driver.changes`: on PostgreSQL a `Watcher`, one subscription on the
process's watch hub; on SQLite the store's polling watcher, which sees other
processes' writes to the file too) for the resource's release/expiry events,
and hands each event to exactly one member:

* the member with the lowest *rank*: fair waiters are ranked in the order
  their queue entries were created (their first attempts run one at a time
  per room, so local rank order is the database's arrival order), unfair
  waiters in the order they joined;
* if that member already has an unconsumed wake-up, nobody else is woken: its
  next attempt starts after the event was delivered, so it sees the release.

Why no wake-up is lost. A member consumes its wake-up (clears the flag) right
before an attempt, so for every delivered event some member starts an attempt
after the release committed. If that attempt is refused, somebody else holds
the lease (or, fair, is ahead in the queue) and that holder's release is the
next event. A member leaving without a claim (timeout, cancellation, error)
while holding an unconsumed wake-up passes it to the next member. Events that
say nothing (a release nobody needs) cost one attempt. Expiry without a release
event (a dead holder and no reaper) is covered by each member's own timer to
the holder's known expiry, as before; fair waiters also keep their queue-entry
refresh timer. The room only decides who is woken early.

A room lingers `LINGER` seconds after its last member left, so a process that
acquires the same resource over and over does not re-subscribe every time.
The linger is measured on the waiters' `pglease.clock.Clock` (rooms are keyed
by it too); the room re-reads it whenever its watcher's read returns, at
least every ``LINGER / 2`` real seconds.
If its watcher cannot start or fails, the room is "broken": members fall back
to their timers plus a coarse re-check, and the next acquire builds a new room.

The code is written once: `_room_async` is the source, `_room` its generated
blocking twin (tools/async_to_sync.py), `_room_core` the sans-I/O part; this
module names them all (`SyncRoom`/`join_sync` are the twin's `Room`/`join`).
"""

from __future__ import annotations

from ._room import Room, join
from ._room import _lock as _sync_lock
from ._room import _rooms as _sync_rooms
from ._room_async import AsyncRoom, join_async
from ._room_async import _lock as _async_lock
from ._room_async import _rooms_async as _async_rooms
from ._room_core import LINGER, READY_TIMEOUT, WAKE_EVENTS, Member, RoomCore, _Flag

SyncRoom = Room
join_sync = join

__all__ = [
    "LINGER",
    "READY_TIMEOUT",
    "WAKE_EVENTS",
    "AsyncRoom",
    "Member",
    "Room",
    "RoomCore",
    "SyncRoom",
    "_Flag",
    "_async_lock",
    "_async_rooms",
    "_sync_lock",
    "_sync_rooms",
    "join",
    "join_async",
    "join_sync",
]
