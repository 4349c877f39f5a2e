"""`pglease revoke` and `pglease resign` are bounded (the owner's writes).

They run on a direct connection outside any store, so the store's limits
did not apply: a revoke behind a fenced mutation in flight waited for that
mutation's lease (hours, for a long one), and one on a silent path waited
forever. Now the server ends a lock wait after ADMIN_LOCK_TIMEOUT and the
statement after ADMIN_STATEMENT_TIMEOUT, and the client gives up CLIENT_GRACE
after that when no answer comes at all.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pglease import Owner, Permit, PostgresStore
from pglease.admin import revoke_lease
from pglease.cli import support
from pglease.errors import CommitOutcomeUnknownError
from pglease.postgres._core import CLIENT_GRACE

from ._stall_proxy import StallProxy

ROOT = Path(__file__).resolve().parents[1]
A = Owner("host", "a")
DEADLINE = 90.0


def _cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", dsn, "--schema", schema, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("command", "rtype", "key"), [(("revoke", "job", "busy"), "job", "busy"),
                                  (("resign", "lead"), "election", "lead")]
)  # fmt: skip
def test_an_owner_write_behind_a_mutation_in_flight_ends_at_its_lock_timeout(
    pg_dsn: str, schema: str, command: tuple[str, ...], rtype: str, key: str
) -> None:
    with PostgresStore(pg_dsn, schema=schema, max_size=4) as store:
        store.migrate()
        rid = store.ensure_resource(rtype, key)
        claim = store.claim(rid, A, 600)  # a long lease: the server would wait it out
        assert claim is not None
        inside, leave = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def apply(conn: object) -> None:
            inside.set()
            leave.wait(DEADLINE)

        def writer() -> None:
            try:
                store.mutate(Permit(rid, claim.revision, claim), "job.step", apply)
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            inside.wait(DEADLINE)
            assert inside.is_set() and not errors, errors
            started = time.monotonic()
            result = _cli(pg_dsn, schema, *command)
            took = time.monotonic() - started
        finally:
            leave.set()
            thread.join(DEADLINE)
        assert not errors, errors
        assert result.returncode == 1, result.stderr
        assert f"the lease row stayed locked for {support.ADMIN_LOCK_TIMEOUT:g} s" in result.stderr
        assert "nothing changed" in result.stderr
        assert took >= support.ADMIN_LOCK_TIMEOUT
        # Nothing changed: the holder is still current and can release.
        state = store.get(rid)
        assert state.lease.owner == A and state.lease.generation == claim.generation
        store.release(store.renew(claim, 60))


def test_an_owner_write_on_a_silent_path_gives_up_at_the_client_deadline(
    stall_proxy: StallProxy, pg_store: PostgresStore, schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # A short statement limit keeps the test short; the mechanism is the CLI's own.
    monkeypatch.setattr(support, "ADMIN_STATEMENT_TIMEOUT", 0.5)
    rid = pg_store.ensure_resource("job", "silent")
    assert pg_store.claim(rid, A, 60) is not None
    args = argparse.Namespace(dsn=stall_proxy.dsn, dsn_source="dsn", pooler=False)
    with support.connect_direct(args) as conn:
        conn.execute("SELECT 1")
        stall_proxy.pause()
        started = time.monotonic()
        with (
            pytest.raises(CommitOutcomeUnknownError) as unknown,
            support.bounded_write(conn, "revoke", rid),
        ):
            revoke_lease(conn, schema, rid)
        took = time.monotonic() - started
    stall_proxy.resume()
    assert took >= 0.5 + CLIENT_GRACE - 0.1
    assert took < DEADLINE
    assert "no answer from the server within" in str(unknown.value)
    assert (unknown.value.operation, unknown.value.resource_id) == ("revoke", rid)
    # The revoke never reached the server: the lease is A's still.
    assert pg_store.get(rid).lease.owner == A


def test_a_plain_revoke_still_works_and_commits(pg_store: PostgresStore, pg_dsn: str,
                                               schema: str) -> None:  # fmt: skip
    rid = pg_store.ensure_resource("job", "plain")
    claim = pg_store.claim(rid, A, 60)
    assert claim is not None
    result = _cli(pg_dsn, schema, "--json", "revoke", "job", "plain")
    assert result.returncode == 0, result.stderr
    state = pg_store.get(rid)
    assert state.lease.owner is None and state.lease.generation == claim.generation + 1
