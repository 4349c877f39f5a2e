"""Pooler mode through a real PgBouncer in transaction pooling mode.

The bouncer runs with ``server_reset_query_always``: every transaction ends
with a DISCARD ALL on its server connection, so anything that relied on
session state (a prepared statement, a SET, a LISTEN) fails at once instead of
working by luck when the same server connection happens to come back. Skipped
with the reason when no pgbouncer binary exists or it cannot start.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pglease import AsyncPostgresStore, PostgresStore
from pglease.errors import PoolerModeError, ValidationError
from pglease.types import Owner, Permit

USER = "pglease_ci"
START_DEADLINE = 20.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )


def _socket_owner(host: str) -> str | None:
    """The non-root owner of the server's socket directory, if any: the embedded
    server keeps its socket in its 0700 data directory, which only that user
    (and root) may enter, so the bouncer runs as that user there."""
    if not host.startswith("/"):
        return None
    try:
        uid = os.stat(host).st_uid
    except OSError:
        return None
    return pwd.getpwuid(uid).pw_name if uid != 0 else None


@pytest.fixture(scope="module")
def bouncer_dsn(pg_dsn: str) -> Iterator[str]:
    """A PgBouncer (transaction pooling, 2 server connections) in front of the test server."""
    binary = _bouncer_binary()
    if binary is None:
        pytest.skip("no pgbouncer binary (apt-get install pgbouncer)")
    params = conninfo_to_dict(pg_dsn)
    user = str(params.get("user") or "postgres")
    dbname = str(params.get("dbname") or "postgres")
    host = str(params.get("host") or "/tmp")
    port = str(params.get("port") or "5432")
    work = Path(tempfile.mkdtemp(prefix="pglease-bouncer-"))
    listen = _free_port()
    (work / "users.txt").write_text(f'"{user}" ""\n')
    (work / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {listen}\n"
        f"unix_socket_dir = {work}\n"
        "pool_mode = transaction\n"
        "default_pool_size = 2\nmax_client_conn = 100\n"
        f"auth_type = trust\nauth_file = {work / 'users.txt'}\n"
        # Reset every server connection after every transaction: see the docstring.
        "server_reset_query = DISCARD ALL\nserver_reset_query_always = 1\n"
        "ignore_startup_parameters = extra_float_digits\n"
        f"logfile = {work / 'pgbouncer.log'}\npidfile = {work / 'pgbouncer.pid'}\n"
    )
    command = [binary, str(work / "pgbouncer.ini")]
    if os.getuid() == 0:  # pgbouncer refuses to run as root
        run_as = _socket_owner(host) or USER
        if run_as == USER and subprocess.run(["id", "-u", USER], capture_output=True).returncode:
            made = subprocess.run(
                ["useradd", "--system", "--no-create-home", USER], capture_output=True
            )
            if made.returncode != 0:
                pytest.skip(f"cannot create user {USER} for pgbouncer: {made.stderr!r}")
        shutil.chown(work, run_as)
        for child in work.iterdir():
            shutil.chown(child, run_as)
        command = ["runuser", "-u", run_as, "--", *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    dsn = f"postgresql://{user}@127.0.0.1:{listen}/{dbname}"
    deadline = time.monotonic() + START_DEADLINE
    try:
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                log = work / "pgbouncer.log"
                out += log.read_text(errors="replace") if log.exists() else ""
                pytest.skip(f"pgbouncer could not start (exit {proc.returncode}): {out[-800:]}")
            try:
                with psycopg.connect(dsn, connect_timeout=2, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.Error as exc:
                if time.monotonic() > deadline:
                    log = work / "pgbouncer.log"
                    tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
                    pytest.skip(
                        f"pgbouncer did not answer within {START_DEADLINE:g} s: {exc}; {tail}"
                    )
                time.sleep(0.1)
        yield dsn
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def store(bouncer_dsn: str, schema: str) -> Iterator[PostgresStore]:
    with PostgresStore(bouncer_dsn, schema=schema, pooler=True, max_size=4) as s:
        yield s


class Busy:
    """Other clients keeping the bouncer's two server connections busy."""

    def __init__(self, dsn: str, clients: int = 2) -> None:
        self.dsn = dsn
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True, prepare_threshold=None) as conn:
                while not self.stop.is_set():
                    conn.execute("SELECT pg_sleep(0.002)")
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Busy:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        assert not self.errors, self.errors


def test_fast_path_from_threads_while_pool_is_busy(store: PostgresStore, bouncer_dsn: str) -> None:
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            rid = store.ensure_resource("job", f"w{n}")
            owner = Owner("worker", f"w{n}")
            for _ in range(60):
                claim = store.claim(rid, owner, 30)
                assert claim is not None
                claim = store.renew(claim, 30)
                store.release(claim)
        except BaseException as exc:
            errors.append(exc)

    with Busy(bouncer_dsn):
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    # 60 rounds x 3 writes, one revision each, per resource.
    assert all(r.revision >= 180 for r in store.list_resources("job"))


def test_mutate_get_list_events(store: PostgresStore) -> None:
    rid = store.ensure_resource("doc", "a")
    claim = store.claim(rid, Owner("w", "1"), 30)
    assert claim is not None

    def apply(conn: psycopg.Connection[Any]) -> int:
        # The limits are SET LOCAL in this transaction.
        row = conn.execute("SELECT current_setting('lock_timeout')").fetchone()
        assert row is not None and row[0] == "10s"
        return 7

    result = store.mutate(Permit(rid, claim.revision, claim), "doc.edited", apply, {"n": 1})
    assert result.value == 7 and result.revision == claim.revision + 1
    state = store.get(rid)
    assert state.revision == result.revision
    assert [r.id for r in store.list_resources()] == [rid]
    events = store.events(rid)
    assert events[-1].type == "doc.edited" and events[-1].payload == {"n": 1}
    assert store.events_after("start")[-1].id == events[-1].id


def test_hold_with_keeper_heartbeats(store: PostgresStore, bouncer_dsn: str) -> None:
    with Busy(bouncer_dsn), store.hold("svc", "k", Owner("host", "h1"), ttl=1.0) as lease:
        first = lease.expires_at
        time.sleep(2.5)  # about seven beats at ttl/3
        lease.check()
        assert lease.expires_at > first
        assert store.get(lease.resource_id).lease.owner == Owner("host", "h1")


def test_acquire_is_woken_by_release(store: PostgresStore) -> None:
    rid = store.ensure_resource("svc", "q")
    held = store.claim(rid, Owner("host", "a"), 60)
    assert held is not None
    out: dict[str, Any] = {}

    def waiter() -> None:
        started = time.monotonic()
        out["claim"] = store.acquire("svc", "q", Owner("host", "b"), 30, timeout=20)
        out["elapsed"] = time.monotonic() - started

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(1.0)  # let the waiter's poll watcher start
    store.release(held)
    released = time.monotonic()
    t.join(30)
    assert out["claim"].owner == Owner("host", "b")
    # A bound, not a speed claim: far below the 60 s expiry and the 20 s timeout.
    assert out["elapsed"] < 10 and time.monotonic() - released < 10


def test_poll_watcher_gets_every_event_while_pool_is_busy(
    store: PostgresStore, bouncer_dsn: str
) -> None:
    rid = store.ensure_resource("doc", "w")
    claim = store.claim(rid, Owner("w", "1"), 120)
    assert claim is not None
    with store.watch(resources=rid, event_types="doc.n") as watcher:
        assert watcher.mode == "poll" and watcher.interval == pytest.approx(0.05)
        got: list[int] = []
        with Busy(bouncer_dsn):
            revision = claim.revision
            for n in range(200):
                revision = store.mutate(Permit(rid, revision, claim), "doc.n", None, n).revision
            deadline = time.monotonic() + 60
            while len(got) < 200 and time.monotonic() < deadline:
                event = watcher.get(timeout=1.0)
                if event is not None:
                    got.append(event.payload)
    assert got == list(range(200))


def test_listen_is_refused_in_pooler_mode(store: PostgresStore) -> None:
    with pytest.raises(ValidationError, match="mode='poll'"):
        store.watch(mode="listen")


def test_async_store(bouncer_dsn: str, schema: str) -> None:
    async def main() -> None:
        async with AsyncPostgresStore(bouncer_dsn, schema=schema, pooler=True, max_size=3) as s:

            async def worker(n: int) -> None:
                rid = await s.ensure_resource("job", f"a{n}")
                for _ in range(30):
                    claim = await s.claim(rid, Owner("w", str(n)), 30)
                    assert claim is not None
                    claim = await s.renew(claim, 30)
                    await s.release(claim)

            await asyncio.gather(*(worker(n) for n in range(4)))
            rid = await s.ensure_resource("doc", "x")
            claim = await s.claim(rid, Owner("w", "x"), 30)
            assert claim is not None
            result = await s.mutate(Permit(rid, claim.revision, claim), "doc.x")
            assert (await s.get(rid)).revision == result.revision
            assert (await s.events(rid))[-1].type == "doc.x"
            async with s.watch(after="start", resources=rid, event_types="doc.x") as watcher:
                assert watcher.mode == "poll"
                event = await asyncio.wait_for(watcher.__anext__(), 20)
                assert event.revision == result.revision

    asyncio.run(main())


def test_pooler_errors_name_the_switch(
    bouncer_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with PostgresStore(bouncer_dsn, schema=schema, pooler=True):
        pass  # migrated through the bouncer
    monkeypatch.delenv("PGLEASE_POOLER", raising=False)
    with PostgresStore(bouncer_dsn, schema=schema) as plain:
        assert not plain.pooler
        rid = plain.ensure_resource("job", "p")
        # Prepared on one server connection, DISCARDed before the next call.
        with pytest.raises(PoolerModeError, match="pooler=True") as info:
            plain.claim(rid, Owner("w", "1"), 30)
        assert info.value.sqlstate == "26000"
    monkeypatch.setenv("PGLEASE_POOLER", "transaction")
    with PostgresStore(bouncer_dsn, schema=schema) as switched:
        assert switched.pooler
        assert switched.claim(rid, Owner("w", "1"), 30) is not None
    monkeypatch.setenv("PGLEASE_POOLER", "sometimes")
    with pytest.raises(ValidationError, match="PGLEASE_POOLER"):
        PostgresStore(bouncer_dsn, schema=schema)


def test_refused_startup_parameter_names_the_switch(bouncer_dsn: str, schema: str) -> None:
    options = "options=-c%20work_mem%3D8MB"
    with pytest.raises(PoolerModeError, match="pooler=True"):
        PostgresStore(f"{bouncer_dsn}?{options}", schema=f"{schema}_{uuid.uuid4().hex[:4]}")


def test_the_cli_through_the_pooler(store: PostgresStore, bouncer_dsn: str, schema: str) -> None:
    """claim, ls, events, hold and watch --poll through PgBouncer with --pooler."""
    import json
    import subprocess
    import sys

    def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pglease", "--pooler", "--dsn", bouncer_dsn,
             "--schema", schema, *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    claimed = cli("--json", "claim", "job", "cli", "--owner", "host:a", "--ttl", "30")
    assert claimed.returncode == 0, claimed.stderr
    assert json.loads(claimed.stdout)["generation"] == 1
    listed = cli("ls")
    assert listed.returncode == 0 and "host:a" in listed.stdout, listed.stderr
    held = cli("hold", "job", "held", "--owner", "host:b", "--ttl", "6", "--", sys.executable,
               "-c", "print('ran')")  # fmt: skip
    assert held.returncode == 0, held.stderr
    assert "ran" in held.stdout
    events = cli("--json", "events", "job", "held")
    assert events.returncode == 0, events.stderr
    types = [json.loads(line)["type"] for line in events.stdout.splitlines()]
    assert types == ["lease.claimed", "lease.released"]
    watched = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--pooler", "--dsn", bouncer_dsn, "--schema", schema,
         "--json", "watch", "--poll", "--after", "start"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert watched.stdout is not None
        first = json.loads(watched.stdout.readline())
        assert first["type"] == "lease.claimed"
    finally:
        watched.terminate()
        watched.wait(timeout=30)


# --- time limits on single statements ------------------------------------------------------


def _lock_lease_row(dsn: str, schema: str, rid: str) -> psycopg.Connection[Any]:
    """A direct connection holding the lease row's lock in an open transaction."""
    conn = psycopg.connect(dsn)
    conn.execute(f'SELECT 1 FROM "{schema}".leases WHERE resource_id = %s FOR UPDATE', [rid])
    return conn


def _raised_within(fn: Any, limit: float = 60.0) -> BaseException | None:
    """What `fn()` raised, run on a thread: a call that hangs fails the test after
    `limit` seconds instead of hanging the suite (the caller's `finally` then
    releases the lock it waits for)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert out, f"still waiting after {limit:g} s: the statement is not bounded"
    return out[0]


def test_fast_path_and_reads_are_bounded_by_lock_timeout(
    bouncer_dsn: str, pg_dsn: str, schema: str
) -> None:
    """A claim, renew or release, and a read, waiting on a lock held by another
    connection end with LockTimeoutError (no session SET bounds them here)."""
    from pglease.errors import LockTimeoutError

    with PostgresStore(bouncer_dsn, schema=schema, pooler=True, lock_timeout=0.5) as s:
        rid = s.ensure_resource("job", "locked")
        claim = s.claim(rid, Owner("w", "1"), 30)
        assert claim is not None
        blocker = _lock_lease_row(pg_dsn, schema, rid)
        try:
            # A claim of the live lease is refused without waiting for the lock;
            # one with an expected revision takes the locked path and is bounded.
            assert s.claim(rid, Owner("w", "2"), 30) is None
            raised = _raised_within(
                lambda: s.claim(rid, Owner("w", "2"), 30, expected_revision=claim.revision)
            )
            assert isinstance(raised, LockTimeoutError), raised
            assert "lock_timeout=0.5 s" in str(raised)
            assert isinstance(_raised_within(lambda: s.renew(claim, 30)), LockTimeoutError)
            assert isinstance(_raised_within(lambda: s.release(claim)), LockTimeoutError)
            # Reads: a table lock makes even a plain SELECT wait.
            blocker.execute(
                f'LOCK TABLE "{schema}".resources, "{schema}".events IN ACCESS EXCLUSIVE MODE'
            )
            for read in (
                lambda: s.get(rid),
                lambda: s.list_resources(),
                lambda: s.events(rid),
                lambda: s.ensure_resource("job", "other"),
            ):
                raised = _raised_within(read)
                assert isinstance(raised, LockTimeoutError), raised
        finally:
            blocker.rollback()
            blocker.close()
        # Nothing changed, and the limits ended with their transactions.
        state = s.get(rid)
        assert state.revision == claim.revision and state.lease.generation == claim.generation
        assert s.renew(claim, 30).revision == claim.revision + 1
    with psycopg.connect(bouncer_dsn, autocommit=True, prepare_threshold=None) as plain:
        row = plain.execute("SHOW lock_timeout").fetchone()
        assert row is not None and row[0] == "0"


def test_fast_path_is_bounded_by_statement_timeout(
    bouncer_dsn: str, pg_dsn: str, schema: str
) -> None:
    from pglease.errors import StatementTimeoutError

    async def main() -> None:
        async with AsyncPostgresStore(
            bouncer_dsn, schema=schema, pooler=True, lock_timeout=None, statement_timeout=0.5
        ) as s:
            rid = await s.ensure_resource("job", "slow")
            blocker = _lock_lease_row(pg_dsn, schema, rid)
            try:
                with pytest.raises(StatementTimeoutError, match=r"statement_timeout=0\.5 s"):
                    await asyncio.wait_for(s.claim(rid, Owner("w", "1"), 30), 30)
            finally:
                blocker.rollback()
                blocker.close()
            assert await s.claim(rid, Owner("w", "1"), 30) is not None

    asyncio.run(main())
    with PostgresStore(
        bouncer_dsn, schema=schema, pooler=True, lock_timeout=None, statement_timeout=0.5
    ) as s:
        # A free resource: the async part left "slow" held, and a claim of a
        # live lease is refused without waiting for any lock.
        rid = s.ensure_resource("job", "slow-sync")
        blocker = _lock_lease_row(pg_dsn, schema, rid)
        try:
            raised = _raised_within(lambda: s.claim(rid, Owner("w", "2"), 30))
            assert isinstance(raised, StatementTimeoutError), raised
        finally:
            blocker.rollback()
            blocker.close()


def test_a_session_set_does_not_last_a_set_local_does(bouncer_dsn: str) -> None:
    """Why pglease sends SET LOCAL only: a session SET would stay on one server
    connection (here the bouncer resets it, so it is simply gone next time)."""
    with psycopg.connect(bouncer_dsn, autocommit=True, prepare_threshold=None) as conn:
        conn.execute("SET lock_timeout = 1234")
        row = conn.execute("SHOW lock_timeout").fetchone()
        assert row is not None and row[0] == "0"  # not kept: another server connection
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = 1234")
            row = conn.execute("SHOW lock_timeout").fetchone()
            assert row is not None and row[0] == "1234ms"


# --- fleet: fair acquire, elections, the reaper and prune ----------------------------------


def test_fair_acquire_is_woken_by_release(store: PostgresStore, bouncer_dsn: str) -> None:
    rid = store.ensure_resource("svc", "fair")
    held = store.claim(rid, Owner("host", "a"), 120)
    assert held is not None
    out: dict[str, Any] = {}

    def waiter(name: str) -> None:
        try:
            started = time.monotonic()
            claim = store.acquire("svc", "fair", Owner("host", name), 60, timeout=60, fair=True)
            out[name] = (claim, time.monotonic() - started)
            time.sleep(0.3)
            store.release(claim)
        except BaseException as exc:
            out[name] = exc

    with Busy(bouncer_dsn):
        first = threading.Thread(target=waiter, args=("b",))
        first.start()
        time.sleep(1.5)  # b queues first
        second = threading.Thread(target=waiter, args=("c",))
        second.start()
        time.sleep(1.5)
        store.release(held)
        first.join(60)
        second.join(60)
    b_claim, b_waited = out["b"]
    c_claim, _ = out["c"]
    # In arrival order, far within the 120 s expiry and the 60 s timeout.
    assert b_claim.generation == held.generation + 1
    assert c_claim.generation == b_claim.generation + 1
    assert b_waited < 20


def test_acquire_behind_a_locked_lease_row_is_bounded(
    bouncer_dsn: str, pg_dsn: str, schema: str
) -> None:
    """A locked lease row is "busy" for acquire (it retries after lock_timeout)
    and its own timeout ends the wait, fair or not: no hang in pooler mode."""
    from pglease.errors import AcquireTimeoutError

    with PostgresStore(bouncer_dsn, schema=schema, pooler=True, lock_timeout=0.3) as s:
        rid = s.ensure_resource("svc", "locked")
        blocker = _lock_lease_row(pg_dsn, schema, rid)
        try:
            for fair in (False, True):
                raised = _raised_within(
                    lambda fair=fair: s.acquire(
                        "svc", "locked", Owner("host", "w"), 30, timeout=2, fair=fair
                    )
                )
                assert isinstance(raised, AcquireTimeoutError), raised
        finally:
            blocker.rollback()
            blocker.close()
        assert s.acquire("svc", "locked", Owner("host", "w"), 30, timeout=10).generation == 1

        async def main() -> None:
            async with AsyncPostgresStore(
                bouncer_dsn, schema=schema, pooler=True, lock_timeout=0.3
            ) as a:
                other = await a.ensure_resource("svc", "alocked")
                blocker = _lock_lease_row(pg_dsn, schema, other)
                try:
                    with pytest.raises(AcquireTimeoutError):
                        await asyncio.wait_for(
                            a.acquire("svc", "alocked", Owner("host", "w"), 30, timeout=2), 60
                        )
                finally:
                    blocker.rollback()
                    blocker.close()

        asyncio.run(main())


def test_elect_leader_resign(store: PostgresStore, bouncer_dsn: str) -> None:
    from pglease.runtime import ELECTION_TYPE

    elected = threading.Event()
    deposed = threading.Event()
    with Busy(bouncer_dsn):
        first = store.elect("sched", Owner("host", "a"), ttl=3, on_elected=lambda _: elected.set(),
                            on_deposed=lambda _: deposed.set())  # fmt: skip
        try:
            assert first.wait_elected(30)
            leader = store.leader("sched")
            assert leader is not None and leader.owner == Owner("host", "a")
            second = store.elect("sched", Owner("host", "b"), ttl=3)
            try:
                time.sleep(3.5)  # more than a ttl: the leader's beats keep it
                assert first.is_leader and not second.is_leader
                first.stop()  # resigns
                assert deposed.is_set()
                assert second.wait_elected(30)
                now = store.leader("sched")
                assert now is not None and now.owner == Owner("host", "b")
                assert now.generation == leader.generation + 1
            finally:
                second.stop()
        finally:
            first.stop()
    assert store.leader("sched") is None
    rid = store.ensure_resource(ELECTION_TYPE, "sched")
    assert [e.type for e in store.events(rid)][-1] == "lease.released"


def test_async_elect_hold_and_acquire(bouncer_dsn: str, schema: str) -> None:
    async def main() -> None:
        async with AsyncPostgresStore(bouncer_dsn, schema=schema, pooler=True, max_size=3) as s:
            election = await s.elect("sched", Owner("host", "a"), ttl=3)
            try:
                assert await asyncio.wait_for(_until(lambda: election.is_leader), 30)
                leader = await s.leader("sched")
                assert leader is not None and leader.owner == Owner("host", "a")
            finally:
                await election.stop()
            assert await s.leader("sched") is None

            async with s.hold("svc", "h", Owner("host", "h1"), ttl=1.0) as lease:
                first = lease.expires_at
                await asyncio.sleep(2.0)
                lease.check()
                assert lease.expires_at > first
                # acquire waits for the holder and is woken by its release
                waiter = asyncio.create_task(
                    s.acquire("svc", "h", Owner("host", "h2"), 30, timeout=30)
                )
                await asyncio.sleep(1.0)
                assert not waiter.done()
            started = time.monotonic()
            claim = await asyncio.wait_for(waiter, 30)
            assert claim.owner == Owner("host", "h2") and time.monotonic() - started < 10
            fair = asyncio.create_task(
                s.acquire("svc", "h", Owner("host", "h3"), 30, timeout=30, fair=True)
            )
            await asyncio.sleep(1.0)
            await s.release(claim)
            assert (await asyncio.wait_for(fair, 30)).owner == Owner("host", "h3")

    asyncio.run(main())


async def _until(predicate: Any) -> bool:
    while not predicate():
        await asyncio.sleep(0.05)
    return True


def test_reaper_and_prune(store: PostgresStore, bouncer_dsn: str, schema: str) -> None:
    from pglease.watch import Reaper, prune, reap_once

    rids = [store.ensure_resource("run", k) for k in ("r1", "r2")]
    for rid in rids:
        assert store.claim(rid, Owner("host", "a"), 0.05) is not None
    time.sleep(0.2)
    with Busy(bouncer_dsn):
        assert reap_once(store) == 2
        assert reap_once(store) == 0
        rid3 = store.ensure_resource("run", "r3")
        assert store.claim(rid3, Owner("host", "a"), 0.05) is not None
        with Reaper(store, Owner("host", "reaper"), interval=0.1) as reaper:
            deadline = time.monotonic() + 30
            while reaper.reaped < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert reaper.reaped == 1 and reaper.active
    for rid in [*rids, rid3]:
        assert [e.type for e in store.events(rid)] == ["lease.claimed", "lease.expired"]
    before = len(store.events_after("start"))
    assert prune(store, 3600) == 0  # nothing that old
    time.sleep(1.2)
    pruned = prune(store, 1)
    assert pruned >= 6 and len(store.events_after("start")) == before - pruned


# --- sessions in PostgreSQL ----------------------------------------------------------------


def test_postgres_sessions(store: PostgresStore, bouncer_dsn: str, tmp_path: Path) -> None:
    from pglease.sessions import (
        PostgresSessionRepository,
        SessionAlreadyClaimedError,
        SessionRepository,
        SetRegister,
    )

    with Busy(bouncer_dsn), PostgresSessionRepository(store, renew_interval=None) as repo:
        with repo.create("s1") as session:
            first = session.append_message(None, {"role": "user", "content": "hi"})
            second = session.append_message(first.id, {"role": "assistant", "content": "yo"})
            session.commit([SetRegister("lane.leaf", "main", second.id)])
            # The writer lease is held by this writer and refused to a second one.
            with pytest.raises(SessionAlreadyClaimedError, match=session.owner_id):
                repo.open("s1")
            assert [e.id for e in session.scan_branch(second.id)] == [second.id, first.id]
        path = repo.fork_to_file("s1", tmp_path, "branch", second.id, id="f1")
        assert path == tmp_path / "f1.sqlite"
        files = SessionRepository(tmp_path, renew_interval=None)
        with files.open("f1") as local:
            third = local.append_message(second.id, {"role": "user", "content": "offline"})
            local.commit([SetRegister("lane.leaf", "main", third.id)])
        with repo.import_file(path, id="back") as back:
            leaf = back.get_register("lane.leaf", "main")
            assert leaf is not None and leaf.value == third.id
            ids = [e.id for e in back.scan_branch(third.id)]
            assert ids == [third.id, second.id, first.id]
        assert sorted(repo.list().ids()) == ["back", "s1"]


def test_session_reads_are_bounded(bouncer_dsn: str, pg_dsn: str, schema: str) -> None:
    from pglease.errors import LockTimeoutError
    from pglease.sessions import PostgresSessionRepository

    with (
        PostgresStore(bouncer_dsn, schema=schema, pooler=True, lock_timeout=0.5) as s,
        PostgresSessionRepository(s, renew_interval=None) as repo,
        repo.create("b1") as session,
    ):
        entry = session.append_message(None, {"role": "user", "content": "hi"})
        blocker = psycopg.connect(pg_dsn)
        try:
            blocker.execute(f'LOCK TABLE "{schema}".session_entries IN ACCESS EXCLUSIVE MODE')
            for read in (lambda: session.get_entry(entry.id), lambda: repo.snapshot("b1")):
                raised = _raised_within(read)
                assert isinstance(raised, LockTimeoutError), raised
        finally:
            blocker.rollback()
            blocker.close()
        assert session.get_entry(entry.id) == entry


def test_import_chunks_are_bounded(
    bouncer_dsn: str, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """An import chunk's call (and the purge after it fails) run under the
    store's limits behind the pooler: with the hidden session row locked from
    a direct connection, the import ends with LockTimeoutError instead of
    waiting, and shows nothing."""
    from pglease.errors import LockTimeoutError
    from pglease.sessions import PostgresSessionRepository, SessionRepository

    with SessionRepository(tmp_path, renew_interval=None) as files, files.create("src") as src:
        parent = None
        for i in range(4):
            parent = src.append_message(parent, {"role": "user", "content": f"m{i}"}).id
    blocker = psycopg.connect(pg_dsn)

    def lock(written: int) -> None:
        if written == 1:  # the row exists (hidden) once the first chunk is in
            blocker.execute(f'SELECT 1 FROM "{schema}".sessions WHERE id = %s FOR UPDATE', ["imp"])

    with (
        PostgresStore(bouncer_dsn, schema=schema, pooler=True, lock_timeout=0.5) as s,
        PostgresSessionRepository(s, renew_interval=None) as repo,
    ):
        try:
            raised = _raised_within(
                lambda: repo.import_file(
                    tmp_path / "src.sqlite", id="imp", chunk_entries=1, on_progress=lock
                )
            )
            assert isinstance(raised, LockTimeoutError), raised
        finally:
            blocker.rollback()
            blocker.close()
        assert not repo.exists("imp")


def test_async_postgres_sessions(bouncer_dsn: str, schema: str, tmp_path: Path) -> None:
    from pglease.sessions import (
        AsyncPostgresSessionRepository,
        SessionAlreadyClaimedError,
        SetRegister,
    )

    async def main() -> None:
        async with (
            AsyncPostgresStore(bouncer_dsn, schema=schema, pooler=True, max_size=3) as s,
            AsyncPostgresSessionRepository(s, renew_interval=None) as repo,
        ):
            async with await repo.create("a1") as session:
                entry = await session.append_message(None, {"role": "user", "content": "hi"})
                await session.commit([SetRegister("lane.leaf", "main", entry.id)])
                with pytest.raises(SessionAlreadyClaimedError):
                    await repo.open("a1")
            path = await repo.fork_to_file("a1", tmp_path, "tree", id="af")
            async with await repo.import_file(path, id="aback") as back:
                leaf = await back.get_register("lane.leaf", "main")
                assert leaf is not None and leaf.value == entry.id

    with Busy(bouncer_dsn):
        asyncio.run(main())


# --- every CLI command with --pooler -------------------------------------------------------


def _cli(
    dsn: str, schema: str, *args: str, timeout: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run(
        [sys.executable, "-m", "pglease", "--pooler", "--dsn", dsn, "--schema", schema, *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def test_every_cli_command_through_the_pooler(
    store: PostgresStore, bouncer_dsn: str, schema: str, tmp_path: Path
) -> None:
    import json
    import sys

    def run(*args: str, code: int = 0) -> str:
        done = _cli(bouncer_dsn, schema, *args)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        return done.stdout

    claimed = json.loads(run("--json", "claim", "job", "c", "--owner", "host:a", "--ttl", "30"))
    token = claimed["token"]
    renewed = json.loads(run("--json", "renew", "job", "c", "--owner", "host:a",
                             f"--token={token}", "--ttl", "40"))  # fmt: skip
    assert renewed["revision"] == claimed["revision"] + 1
    run("claim", "job", "c", "--owner", "host:b", "--ttl", "30", code=3)
    got = json.loads(run("--json", "get", "job", "c"))
    assert got["lease"]["holder"] == "host:a" and got["revision"] == renewed["revision"]
    assert "resources" in run("status")
    json.loads(run("--json", "status"))
    assert "host:a" in run("ls", "--held")
    run("release", "job", "c", "--owner", "host:a", f"--token={token}")
    run("release", "job", "c", "--owner", "host:a", f"--token={token}", code=4)
    types = [json.loads(line)["type"] for line in run("--json", "events", "job", "c").splitlines()]
    assert types == ["lease.claimed", "lease.renewed", "lease.released"]
    # revoke (as the owner: this role migrated the schema)
    run("claim", "job", "r", "--owner", "host:a", "--ttl", "60")
    run("revoke", "job", "r")
    assert json.loads(run("--json", "get", "job", "r"))["lease"]["holder"] is None
    # elections: elect as a process, leader, resign
    elect = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--pooler", "--dsn", bouncer_dsn, "--schema", schema,
         "--json", "elect", "sched", "--owner", "host:e", "--ttl", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert elect.stdout is not None
        assert json.loads(elect.stdout.readline())["leader"] == "host:e"
        leader = json.loads(run("--json", "leader", "sched"))
        assert leader["leader"] == "host:e" and leader["generation"] == 1
        run("resign", "sched")
        _, err = elect.communicate(timeout=60)
        assert elect.returncode == 75, err
    finally:
        if elect.poll() is None:
            elect.kill()
            elect.wait(30)
    run("leader", "sched", code=3)
    # reap and prune
    run("claim", "job", "x", "--owner", "host:a", "--ttl", "50ms")
    time.sleep(0.2)
    run("reap", "--once")
    assert json.loads(run("--json", "events", "job", "x").splitlines()[-1])["type"] == (
        "lease.expired"
    )
    dry = json.loads(run("--json", "prune", "--older-than", "1h", "--dry-run"))
    assert dry["dry_run"] and dry["would_delete"] == 0
    # hold and watch --poll
    out = run("hold", "job", "h", "--owner", "host:h", "--ttl", "6", "--", sys.executable, "-c",
              "import os; print('fence', os.environ['PGLEASE_FENCE'])")  # fmt: skip
    assert "fence 1" in out
    watched = subprocess.Popen(
        [sys.executable, "-m", "pglease", "--pooler", "--dsn", bouncer_dsn, "--schema", schema,
         "--json", "watch", "--poll", "--after", "start", "--type", "job"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert watched.stdout is not None
        assert json.loads(watched.stdout.readline())["type"] == "lease.claimed"
    finally:
        watched.terminate()
        watched.wait(30)
    # doctor says a pooler is in between and that pooler mode is on
    report = json.loads(run("--json", "doctor", code=1))
    pooler = [c for c in report["checks"] if c["name"] == "pooler"]
    assert pooler and "pooler mode is on" in pooler[0]["detail"], pooler
    # sessions
    from pglease.sessions import PostgresSessionRepository

    with (
        PostgresSessionRepository(store, renew_interval=None) as repo,
        repo.create("cs") as session,
    ):
        session.append_message(None, {"role": "user", "content": "hi"})
    listing = json.loads(run("--json", "session", "ls"))
    assert [s["id"] for s in listing["sessions"]] == ["cs"]
    assert json.loads(run("--json", "session", "show", "cs"))["entry_count"] == 1
    forked = json.loads(run("--json", "session", "fork", "cs", "--to", str(tmp_path),
                            "--scope", "tree", "--id", "cf"))  # fmt: skip
    assert forked["entries"] == 1
    exported = json.loads(run("--json", "session", "export", "cs", "--to", str(tmp_path),
                              "--id", "ce"))  # fmt: skip
    imported = json.loads(run("--json", "session", "import", exported["path"], "--id", "ci"))
    assert imported["id"] == "ci" and imported["entries"] == 1


def test_reap_and_prune_are_bounded_by_lock_timeout(
    bouncer_dsn: str, pg_dsn: str, schema: str
) -> None:
    """Behind the pooler no session SET bounds them: each reap and each prune
    chunk runs in a transaction that sets the store's limits first."""
    from pglease.errors import DatabaseError, LockTimeoutError
    from pglease.watch import prune, prune_async, reap_once, reap_once_async

    with PostgresStore(bouncer_dsn, schema=schema, pooler=True, lock_timeout=0.5) as s:
        s.ensure_resource("job", "r")
        blocker = psycopg.connect(pg_dsn)
        try:
            blocker.execute(f'LOCK TABLE "{schema}".leases IN ACCESS EXCLUSIVE MODE')
            raised = _raised_within(lambda: reap_once(s))
            assert isinstance(raised, LockTimeoutError), raised
            blocker.rollback()
            blocker.execute(f'SELECT 1 FROM "{schema}".event_horizon FOR UPDATE')
            raised = _raised_within(lambda: prune(s, 0.0, chunk=10))
            assert isinstance(raised, DatabaseError), raised
            assert "lock timeout" in str(raised), raised
        finally:
            blocker.rollback()
            blocker.close()
        assert reap_once(s) == 0  # nothing left behind: both work again

    async def main() -> None:
        async with AsyncPostgresStore(bouncer_dsn, schema=schema, pooler=True,
                                      lock_timeout=0.5) as a:  # fmt: skip
            blocker = await psycopg.AsyncConnection.connect(pg_dsn)
            try:
                await blocker.execute(f'LOCK TABLE "{schema}".leases IN ACCESS EXCLUSIVE MODE')
                with pytest.raises(LockTimeoutError):
                    await asyncio.wait_for(reap_once_async(a), 30)
                await blocker.rollback()
                await blocker.execute(f'SELECT 1 FROM "{schema}".event_horizon FOR UPDATE')
                with pytest.raises(DatabaseError, match="lock timeout"):
                    await asyncio.wait_for(prune_async(a, 0.0, chunk=10), 30)
            finally:
                await blocker.rollback()
                await blocker.close()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["query", "commit", "statement"])
def test_a_stalled_fenced_holder_is_cut_at_its_expiry(
    bouncer_dsn: str, schema: str, how: str
) -> None:
    """The lease's bound is transaction-local, so it holds behind a transaction
    pooler too: the server ends the stalled holder's transaction (and the
    bouncer's server connection), a rival gets the lease soon after the expiry,
    the holder gets LeaseExpiredError and its next call works."""
    from pglease.errors import LeaseExpiredError

    from .test_fence_bound import RIVAL_WITHIN, assert_no_late_write, stalled_holder

    with PostgresStore(bouncer_dsn, schema=schema, pooler=True, max_size=1) as holder:
        rid = holder.ensure_resource("job", "stall")
        taken, took, error = stalled_holder(holder, bouncer_dsn, schema, rid, how, pooler=True)
        assert taken is not None and taken.generation == 2
        assert took < RIVAL_WITHIN
        assert isinstance(error, LeaseExpiredError), repr(error)
        assert_no_late_write(holder.events(rid))


def test_a_stopped_fenced_holder_behind_the_pooler(
    bouncer_dsn: str, schema: str, tmp_path: Path
) -> None:
    """A real process stopped inside its fenced mutation, through the bouncer."""
    from .test_fence_bound import assert_no_late_write, stopped_holder

    with PostgresStore(bouncer_dsn, schema=schema, pooler=True, max_size=1) as store:
        rid = store.ensure_resource("job", "stopped")
        stopped_holder(tmp_path, bouncer_dsn, bouncer_dsn, schema, rid, pooler=True)
        assert_no_late_write(store.events(rid))
