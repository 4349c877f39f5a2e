"""ensure_resource never waits for a writer of the resource.

`hold()` and `acquire()` ensure the resource before they claim, and the
runtime counts a lease row locked past `lock_timeout` as busy (it retries).
The stall soak saw `hold()` raise `LockTimeoutError` instead: the ensure
step's INSERT ... ON CONFLICT DO NOTHING waits for an in-progress
transaction that updated the conflicting `resources` row (every event once
bumped the revision there), and a fenced mutation in flight holds that
update until it commits. A stalled holder then made every rival's `hold()`
fail instead of wait.
"""

from __future__ import annotations

import threading

import pytest

from pglease import Owner, Permit, PostgresStore
from pglease.errors import AcquireTimeoutError
from pglease.runtime import hold

A = Owner("host", "a")
B = Owner("host", "b")
#: Bound on every wait here.
DEADLINE = 60.0


def test_ensure_and_hold_do_not_wait_for_a_mutation_in_flight(
    pg_dsn: str, schema: str
) -> None:
    with PostgresStore(pg_dsn, schema=schema, max_size=4, lock_timeout=1.0) as store:
        store.migrate()
        rid = store.ensure_resource("job", "busy")
        claim = store.claim(rid, A, 60)
        assert claim is not None
        inside = threading.Event()
        leave = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            def apply(conn: object) -> None:
                inside.set()
                leave.wait(DEADLINE)  # the holder's own work, in its transaction

            try:
                store.mutate(Permit(rid, claim.revision, claim), "job.step", apply)
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            inside.wait(DEADLINE)
            assert inside.is_set() and not errors, errors
            assert store.ensure_resource("job", "busy") == rid  # no lock wait
            # Held by A: a timeout, never a lock error from the ensure step.
            with pytest.raises(AcquireTimeoutError), hold(store, "job", "busy", B, 5, timeout=1.5):
                pass
        finally:
            leave.set()
            thread.join(DEADLINE)
        assert not errors, errors
