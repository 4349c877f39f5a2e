"""The same API on one SQLite file, for a single host (README "SQLite store")."""

import tempfile
from pathlib import Path

from pglease import Owner, SqliteStore

directory = tempfile.mkdtemp()  # e.g. /var/lib/myapp in production
with SqliteStore(Path(directory) / "leases.sqlite") as store:
    rid = store.ensure_resource("controller", "main")
    claim = store.claim(rid, Owner("host", "h1"), ttl=10)
    assert claim is not None
    assert store.claim(rid, Owner("host", "h2"), ttl=10) is None  # h1 holds it
    store.release(claim)
    print("held by h1, refused to h2, released")
