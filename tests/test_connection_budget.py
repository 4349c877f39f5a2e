"""Connection budget: more host processes than a server's connection slots.

A private PostgreSQL 15 server with few slots (``max_connections = 14``,
``superuser_reserved_connections = 3``: 11 for the client role). Eight real OS
processes each open a ``PostgresStore(min_size=1, max_size=2)`` and `hold`
three ttl-6 leases (no watcher: ``timeout=0``). Each needs two connections
(the pool's one, the keeper's one; the store's first, checking connection is
closed before the pool opens, and one thread never grows the pool), so at most
five fit and at least three cannot. The test counts them on the server.

Every process must either fail at start with a clear `PgleaseError`, exit
non-zero and claim nothing, or keep all its leases for the whole run (two
ttls): same generation, same holder, no ``lease.expired`` event. A lease lost
later would mean a host was let in that could not renew. Deadlines are
generous and nothing is timed: the test must pass on a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from psycopg import conninfo

from . import _pgcluster
from ._pgcluster import PG15, SERVER_USER, Node, _run, wait_for

PROCESSES = 8
LEASES = 3
TTL = 6.0
#: Slots for non-superusers: max_connections - superuser_reserved_connections.
MAX_CONNECTIONS = 14
RESERVED = 3
#: How long the survivors hold after everyone has started: two ttls, so a
#: lease whose heartbeats failed would have expired on the server.
HOLD_SECONDS = 2 * TTL
START_DEADLINE = 120.0
ROOT = Path(__file__).resolve().parent.parent
#: What a start failure must say: the server's refusal or the pool's timeout.
#: "cannot open the connection pool" is accepted too, though it does not carry
#: the server's reason (psycopg_pool's PoolTimeout only says "pool
#: initialization incomplete"; the refusal is only logged): a pglease gap.
CLEAR = re.compile(
    r"too many clients|remaining connection slots are reserved|too many connections"
    r"|pool_timeout|cannot open the connection pool",
)


# --------------------------------------------------------------------------- worker


def worker(dsn: str, schema: str, name: str) -> int:
    """One host process: hold LEASES leases until stdin closes.

    Prints one JSON line: {"held": {key: generation}} once all are held, then
    {"done": true} after releasing them. A PgleaseError before that line goes
    to stderr as "FAILED <class>: <message>" with exit 1; a loss later exits 2.
    """
    from pglease import Owner, PgleaseError, PostgresStore

    owner = Owner("host", name)
    try:
        with ExitStack() as stack:
            try:
                store = stack.enter_context(
                    PostgresStore(dsn, schema=schema, min_size=1, max_size=2,
                                  auto_migrate=False, connect_timeout=3, pool_timeout=3)
                )  # fmt: skip
                # timeout=0: one claim attempt and no watcher (no LISTEN hub
                # connection), so the budget is the pool plus the keeper.
                leases = {
                    key: stack.enter_context(store.hold("budget", key, owner, TTL, timeout=0))
                    for key in (f"{name}-{i}" for i in range(LEASES))
                }
            except PgleaseError as exc:
                print(f"FAILED {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                return 1
            held = {key: lease.generation for key, lease in leases.items()}
            print(json.dumps({"held": held}), flush=True)
            sys.stdin.read()  # the test closes stdin when its checks are done
            lost = [key for key, lease in leases.items() if lease.lost.is_set()]
            if lost:
                print(f"LOST {lost}", file=sys.stderr, flush=True)
                return 2
        print(json.dumps({"done": True}), flush=True)
        return 0
    except PgleaseError as exc:  # a loss noticed on release (LeaseLostError)
        print(f"LOST {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2


# --------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def small_server() -> Iterator[Node]:
    """A PG15 server with MAX_CONNECTIONS slots, on a unix socket only."""
    if reason := _pgcluster.skip_reason():
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="pglease-budget-"))
    os.chmod(base, 0o755)
    node = Node(base, "small", random.randint(20000, 60000))
    node.sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, SERVER_USER)
        shutil.chown(node.sock, SERVER_USER)
    try:
        _run([str(PG15 / "initdb"), "-D", str(node.data), "-U", "postgres", "--auth=trust",
              "--no-sync"])  # fmt: skip
        node.conf(
            [
                "listen_addresses = ''",
                f"unix_socket_directories = '{node.sock}'",
                f"port = {node.port}",
                f"max_connections = {MAX_CONNECTIONS}",
                f"superuser_reserved_connections = {RESERVED}",
                "fsync = off",
                "shared_buffers = 16MB",
            ]
        )
        node.start()
        wait_for("the server to accept connections", lambda: node.query("SELECT 1"))
        yield node
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def client_dsn(small_server: Node) -> Iterator[tuple[str, str]]:
    """(DSN of a non-superuser client role, migrated schema). Non-superuser: the
    reserved slots must stay out of its reach, and the test's own checks use them."""
    from pglease import PostgresStore
    from pglease.migrations import grant

    schema = f"b_{uuid.uuid4().hex[:10]}"
    role = f"pgl_budget_{uuid.uuid4().hex[:8]}"
    PostgresStore(small_server.dsn, schema=schema, min_size=1, max_size=1).close()
    with small_server.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        grant(conn, schema, role, "client")
    yield conninfo.make_conninfo(small_server.dsn, user=role), schema
    with small_server.connect() as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role]
        )
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


# --------------------------------------------------------------------------- the test


def test_processes_beyond_the_budget_fail_at_start_and_the_rest_keep_their_leases(
    small_server: Node, client_dsn: tuple[str, str]
) -> None:
    dsn, schema = client_dsn
    names = [f"p{i}" for i in range(PROCESSES)]
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tests.test_connection_budget", dsn, schema, name],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    }
    held: dict[str, dict[str, int]] = {}
    failed: dict[str, str] = {}
    try:
        # Each process either prints its "held" line or exits: wait for all.
        deadline = time.monotonic() + START_DEADLINE
        for name, proc in procs.items():
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()  # blocks until held or exit (EOF)
            if line:
                held[name] = json.loads(line)["held"]
            else:
                proc.wait(max(1.0, deadline - time.monotonic()))
                failed[name] = proc.stderr.read()
            assert time.monotonic() < deadline, "processes did not settle in time"

        # Shown with -s: which hosts fit and what the others were told.
        print(f"held: {sorted(held)}; failed: {failed}")
        assert held, f"no process got its connections: {failed}"
        assert failed, "every process fit: the budget was not exceeded"
        # 11 client slots, 2 per host at rest.
        assert len(held) <= (MAX_CONNECTIONS - RESERVED) // 2
        for name, err in failed.items():
            assert procs[name].returncode == 1, (name, err)
            assert "Traceback" not in err, (name, err)
            # The last line is the worker's; psycopg_pool may log its own
            # refused connect attempts (warnings) to stderr before it.
            last = err.strip().splitlines()[-1]
            assert re.match(r"FAILED (DatabaseUnavailableError|PoolExhaustedError): ", last), err
            assert CLEAR.search(last), f"{name}: unclear start failure: {err}"

        time.sleep(HOLD_SECONDS)  # heartbeats (every ttl/3) must carry the leases

        rows = small_server.query(
            f"SELECT r.key, l.generation, l.owner_id, l.expires_at > now()"
            f" FROM {schema}.leases l JOIN {schema}.resources r ON r.id = l.resource_id"
            " WHERE r.type = 'budget'"
        )
        on_server = {key: (gen, owner, live) for key, gen, owner, live in rows}
        for name, leases in held.items():
            assert len(leases) == LEASES
            for key, generation in leases.items():
                assert on_server[key] == (generation, name, True), (key, on_server.get(key))
        # The measured budget: pool min_size (1) + keeper (1) per host.
        backends = small_server.query(
            "SELECT application_name LIKE 'pglease-keeper-%%', count(*) FROM pg_stat_activity"
            " WHERE usename = %s GROUP BY 1",
            [conninfo.conninfo_to_dict(dsn)["user"]],
        )
        assert dict(backends) == {True: len(held), False: len(held)}, backends
        expired = small_server.query(
            f"SELECT count(*) FROM {schema}.events WHERE type = 'lease.expired'"
        )
        assert expired == [(0,)]
        # A host that failed at start claimed nothing (not even a resource row).
        for name in failed:
            assert not [k for k in on_server if k.startswith(f"{name}-")], name
        actors = small_server.query(f"SELECT DISTINCT actor_id FROM {schema}.events")
        assert {a for (a,) in actors} <= set(held), actors

        for name in held:
            proc = procs[name]
            assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
            proc.stdin.close()
            assert proc.wait(60) == 0, (name, proc.stderr.read())
            assert json.loads(proc.stdout.readline()) == {"done": True}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_default_hold_also_takes_a_watch_hub_connection(
    small_server: Node, client_dsn: tuple[str, str]
) -> None:
    """With the defaults (use_watcher=True, no timeout) `hold` starts the watch
    hub before its first claim: pool (min_size 1, up to 2) + keeper + hub."""
    from pglease import Owner, PostgresStore

    dsn, schema = client_dsn
    role = conninfo.conninfo_to_dict(dsn)["user"]
    with (
        PostgresStore(dsn, schema=schema, min_size=1, max_size=2, auto_migrate=False) as store,
        store.hold("budget", "default", Owner("host", "d"), TTL),
    ):
        # `hold` waits a bounded time for the room's watcher; on a loaded host it
        # may claim first and the hub connects just after: wait for it (bounded).
        deadline = time.monotonic() + 30
        while True:
            rows = small_server.query(
                "SELECT CASE WHEN application_name LIKE 'pglease-keeper-%%' THEN 'keeper'"
                " WHEN application_name = %s THEN 'pool' ELSE 'hub' END, count(*)"
                " FROM pg_stat_activity WHERE usename = %s GROUP BY 1",
                [f"pglease-{schema}", role],
            )
            found = dict(rows)
            if found.get("hub") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # The pool may have grown to its max_size of 2 while hold's first claim
        # and the waiting room's start overlapped: min_size is only the floor.
        assert found.get("keeper") == 1 and found.get("hub") == 1, rows
        assert 1 <= found.get("pool", 0) <= 2, rows


if __name__ == "__main__":
    sys.exit(worker(*sys.argv[1:4]))
