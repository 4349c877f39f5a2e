"""Watching a SQLite store: polling the event table with the store's cursors.

SQLite has no LISTEN/NOTIFY, and one writer at a time makes event ids
commit-ordered, so a poll of `events_after(cursor)` every `interval` seconds
delivers every committed event exactly once, in order, with no gap; a saved
cursor resumes exactly where the watcher stopped, also in another process.

The arguments are `PostgresStore.watch`'s, with what they mean here:

- `mode`: None (the default) or ``"poll"``, which is what a SQLite watcher
  does; ``"listen"`` is refused with `ValidationError` (there is nothing to
  listen to), as it is for a PostgreSQL store in pooler mode.
- `interval`: the poll period (50 ms by default).
- `max_pending`: the bound on events read from the file and not yet handed
  out. A poll reads at most that many (and at most a page, 1000); a watcher
  further behind leaves the rest in the file and reads it with its next
  polls, so memory stays bounded and nothing is lost or repeated.
  `overflows` counts the stretches in which the bound held events back (the
  queue full, more waiting in the file); `health.lag_events` is the queue.
- `retry_window`, `clock`: as for PostgreSQL (below).
- `tuning`: accepted (a `HubTuning` or None) so that code written for either
  store runs on both; a SQLite watcher has no hub, so nothing is tuned.
- `stall_timeout`: checked as for PostgreSQL (seconds in (0, 3600]) and
  ignored: a local file has no network path that could go silent.

Errors, as for PostgreSQL watchers: a failed poll is logged and retried
(``database is locked``, a file that cannot be opened for a moment) until
`retry_window` seconds pass, then raised as `WatchFailedError`; errors that
cannot heal raise at once: the file deleted or replaced (the store's pooled
connections would go on reading the old, unlinked file and see nothing, a
silent stall), not a database, corrupt, no events table, access denied.
A file made unreadable (chmod) while the watcher runs is noticed only when a
new connection is opened: pooled connections keep their open file.

A cursor is checked once, when the watcher starts: one that is not a position
in this file's log (`CursorAheadError`, `HistoryDivergedError`: another file,
or this file replaced by an older copy) is refused. The polls after it are not
checked again.

`AsyncSqliteWatcher` is written once, in `_watch_async`; the blocking
`SqliteWatcher` (`_watch`) is generated from it by `tools/async_to_sync.py`.
"""

from __future__ import annotations

from ._watch import SqliteWatcher
from ._watch_async import AsyncSqliteWatcher
from ._watch_base import DEFAULT_INTERVAL, PAGE, _cannot_heal

__all__ = ["DEFAULT_INTERVAL", "PAGE", "AsyncSqliteWatcher", "SqliteWatcher", "_cannot_heal"]
