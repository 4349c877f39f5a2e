"""`Watcher` (blocking iterator) and `AsyncWatcher` (async iterator): the same
state machine (`_core.WatchState`) driven over a sync or an asyncio connection.

`AsyncWatcher` is written once, in `_watcher_async`; the blocking `Watcher`
(`_watcher`) is generated from it by `tools/async_to_sync.py`. What both share
without I/O is in `_watcher_base`, how their mailboxes join the hub in `_fanout`.
"""

from __future__ import annotations

from ._watcher import Watcher, watch
from ._watcher_async import AsyncWatcher, watch_async
from ._watcher_base import (
    DEFAULT_FALLBACK_INTERVAL,
    DEFAULT_POLL_INTERVAL,
    AsyncWatchedStore,
    WatchedStore,
)

#: Older names of the watched-store protocols, kept for one release (the
#: reaper and prune now take any store through its maintenance driver).
Store = WatchedStore
AsyncStore = AsyncWatchedStore
SyncStore = WatchedStore

__all__ = [
    "DEFAULT_FALLBACK_INTERVAL",
    "DEFAULT_POLL_INTERVAL",
    "AsyncStore",
    "AsyncWatchedStore",
    "AsyncWatcher",
    "Store",
    "SyncStore",
    "WatchedStore",
    "Watcher",
    "watch",
    "watch_async",
]
