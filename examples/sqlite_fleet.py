"""hold, acquire and elect on a SQLite file (README "Fleet runtime on SQLite")."""

import tempfile
import threading
from pathlib import Path

from pglease import Owner, SqliteStore

path = Path(tempfile.mkdtemp()) / "leases.sqlite"
with SqliteStore(path) as store:
    with store.hold("job", "nightly", Owner("host", "h1"), ttl=10) as lease:
        lease.check()  # raises LeaseLostError once lost
        print("holding generation", lease.generation)
        # Another waiter blocks until this block releases the lease.
        waiter = threading.Thread(
            target=lambda: print(
                "then", store.acquire("job", "nightly", Owner("host", "h2"), 10, timeout=30)
            )
        )
        waiter.start()
    waiter.join()
    election = store.elect("scheduler", Owner("host", "h1"), ttl=10)
    election.wait_elected(30)
    print("leader", store.leader("scheduler"))
    election.stop()  # resigns: the lease is released
