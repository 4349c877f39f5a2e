"""Watch a SQLite store: the PostgreSQL watcher's arguments, polled (README "SQLite store")."""

import tempfile
from pathlib import Path

from pglease import Permit, SqliteStore

with SqliteStore(Path(tempfile.mkdtemp()) / "leases.sqlite") as store:
    rid = store.ensure_resource("run", "nightly")
    with store.watch(after="now", max_pending=100) as watcher:
        store.mutate(Permit(rid, store.get(rid).revision), "run.started")
        event = watcher.get(timeout=30)
        assert event is not None and event.type == "run.started"
        saved = watcher.cursor  # resume here later with watch(after=saved)
    with store.watch(after=saved) as watcher:
        assert watcher.get(timeout=0.2) is None  # nothing new since the cursor
    print("watched", event.type)
