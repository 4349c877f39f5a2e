"""A PostgreSQL 15 primary and a streaming standby, from the server binaries.

Used by the failover and doctor tests. Unix sockets only (no TCP port is
opened); the servers run as a non-root user because PostgreSQL refuses to run
as root. `skip_reason()` says why a cluster cannot be started here, so tests
skip with that reason instead of failing on machines without the binaries.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg

PG15 = Path(os.environ.get("PGLEASE_PG15_BIN", "/usr/lib/postgresql/15/bin"))
#: The non-root user the servers run as when the tests run as root (CI does).
SERVER_USER = "pglease_ci"

T = TypeVar("T")


def _as_server_user() -> list[str]:
    return ["runuser", "-u", SERVER_USER, "--"] if os.geteuid() == 0 else []


def _ensure_server_user() -> None:
    try:
        pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", SERVER_USER],
            check=True,
            capture_output=True,
        )


def skip_reason() -> str | None:
    """Why no cluster can run on this machine, or None when it can."""
    for tool in ("initdb", "pg_ctl", "pg_basebackup", "postgres"):
        if not os.access(PG15 / tool, os.X_OK):
            return f"PostgreSQL 15 server binaries not found ({PG15 / tool} is missing)"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "running as root without runuser: PostgreSQL refuses to run as root"
        try:
            _ensure_server_user()
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"cannot create the non-root server user {SERVER_USER}: {exc}"
    try:
        out = subprocess.run(
            [*_as_server_user(), str(PG15 / "postgres"), "--version"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {PG15 / 'postgres'}: {exc}"
    if out.returncode != 0:
        return f"cannot run {PG15 / 'postgres'}: {out.stderr.strip() or out.returncode}"
    return None


def wait_for(what: str, check: Callable[[], T], timeout: float = 30.0) -> T:
    """Poll `check` until it returns something truthy, or fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except (psycopg.Error, OSError) as exc:
            last, value = exc, None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last error: {last})")


class Node:
    """One server: its data directory, socket directory and port."""

    def __init__(self, base: Path, name: str, port: int) -> None:
        self.name = name
        self.data = base / name
        self.sock = base / f"{name}-sock"
        self.log = base / f"{name}.log"
        self.port = port

    @property
    def dsn(self) -> str:
        return f"host={self.sock} port={self.port} user=postgres dbname=postgres"

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=5, **kwargs)

    def query(self, text: str, args: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement on a fresh connection and return its rows."""
        with self.connect() as conn:
            cur = conn.execute(text, args)
            return [tuple(r) for r in cur.fetchall()] if cur.description else []

    def pid(self) -> int:
        """The postmaster's pid, from the first line of postmaster.pid."""
        return int((self.data / "postmaster.pid").read_text().splitlines()[0])

    def conf(self, lines: list[str]) -> None:
        """Append settings to postgresql.conf (later lines win)."""
        text = "".join(f"{line}\n" for line in lines)
        _run(["sh", "-c", f"cat >> {self.data / 'postgresql.conf'}"], input=text)

    def start(self) -> None:
        _run(
            [str(PG15 / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
             "start"],
        )  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run([str(PG15 / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def crash(self) -> None:
        """SIGKILL the postmaster and every process it started, as a machine dies.

        Killing only the postmaster leaves its backends to notice on their own;
        none of them may go on serving (or streaming WAL) after the "crash".
        """
        pid = self.pid()
        children = _children(pid)
        os.kill(pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)

        def gone() -> bool:
            return not any(_alive(p) for p in [pid, *children])

        wait_for(f"{self.name}'s processes to die", gone, 10)

    def promote(self) -> None:
        _run([str(PG15 / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"])


class Cluster:
    """A primary and one standby streaming from it (`pg_basebackup -R`)."""

    def __init__(self, *, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.base = Path(tempfile.mkdtemp(prefix="pglease-ha-"))
        os.chmod(self.base, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.base, SERVER_USER)
        port = random.randint(20000, 60000)
        self.primary = Node(self.base, "primary", port)
        self.standby = Node(self.base, "standby", port + 1)
        for node in (self.primary, self.standby):
            node.sock.mkdir()
            if os.geteuid() == 0:
                shutil.chown(node.sock, SERVER_USER)

    @property
    def dsn(self) -> str:
        """Both servers in one libpq DSN: connect to whichever accepts writes."""
        return (
            f"host={self.primary.sock},{self.standby.sock}"
            f" port={self.primary.port},{self.standby.port}"
            " user=postgres dbname=postgres target_session_attrs=read-write"
        )

    def start(self) -> None:
        p, s = self.primary, self.standby
        _run([str(PG15 / "initdb"), "-D", str(p.data), "-U", "postgres", "--auth=trust",
              "--no-sync"])  # fmt: skip
        names = "'FIRST 1 (standby1)'" if self.synchronous else "''"
        p.conf(
            [
                "listen_addresses = ''",
                f"unix_socket_directories = '{p.sock}'",
                f"port = {p.port}",
                "wal_level = replica",
                "max_wal_senders = 4",
                "synchronous_commit = on",
                # In postgresql.conf, as most deployments set it: pg_basebackup
                # copies it to the standby, which inherits it when promoted.
                f"synchronous_standby_names = {names}",
                # The OS never crashes here, only processes: skip fsyncs.
                "fsync = off",
                "shared_buffers = 16MB",
                "max_connections = 40",
                "wal_sender_timeout = 5s",
            ]
        )
        p.start()
        _run([str(PG15 / "pg_basebackup"), "-D", str(s.data), "-h", str(p.sock),
              "-p", str(p.port), "-U", "postgres", "-R", "-X", "stream", "-c", "fast",
              "--no-sync"])  # fmt: skip
        s.conf(
            [
                f"unix_socket_directories = '{s.sock}'",
                f"port = {s.port}",
                # What `-R` wrote, plus the name synchronous_standby_names matches.
                f"primary_conninfo = 'host={p.sock} port={p.port} user=postgres"
                " application_name=standby1'",
                "wal_receiver_status_interval = 1s",
            ]
        )
        # postgresql.auto.conf (written by -R) overrides postgresql.conf: drop
        # its primary_conninfo so ours, with the application_name, counts.
        auto = s.data / "postgresql.auto.conf"
        _run(["sed", "-i", "/^primary_conninfo/d", str(auto)])
        s.start()
        state = "sync" if self.synchronous else "async"
        wait_for(
            f"standby1 to stream ({state})",
            lambda: p.query(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = 'standby1'"
                " AND state = 'streaming' AND sync_state = %s",
                [state],
            ),
        )

    def close(self) -> None:
        for node in (self.primary, self.standby):
            node.stop()
            with contextlib.suppress(
                OSError, ValueError, IndexError, subprocess.CalledProcessError
            ):
                pid = node.pid()
                for p in [pid, *_children(pid)]:
                    os.kill(p, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def cluster(*, synchronous: bool) -> Iterator[Cluster]:
    made = Cluster(synchronous=synchronous)
    try:
        made.start()
        yield made
    finally:
        made.close()


# ---------------------------------------------------------------------- processes


def _run(argv: list[str], input: str | None = None) -> str:
    out = subprocess.run(
        [*_as_server_user(), *argv], input=input, capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise subprocess.CalledProcessError(out.returncode, argv, out.stdout, out.stderr)
    return out.stdout


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (the postmaster's backends and helpers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"  # a zombie is dead, only unreaped
