"""`pglease embedded status|stop`: the embedded PostgreSQL the CLI starts on demand.

``status`` reports the data directory, the socket or port, the pid, the
PostgreSQL version and the size on disk; it exits 3 (and says "not running")
when the server is not running. ``stop`` stops it (``pg_ctl stop -m fast``, as
the data directory's owner) and exits 0 when it stopped or was not running.
Neither ever starts the server. The data directory is ``$PGLEASE_EMBEDDED_DIR``,
else ``$XDG_DATA_HOME/pglease/postgres`` (``~/.local/share/pglease/postgres``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..embedded import EmbeddedStatus, embedded_status, stop_embedded
from .support import EXIT_OK, print_json

#: `status` when the server is not running.
EXIT_NOT_RUNNING = 3


def register(subparsers: Any) -> None:
    """Add `embedded status` and `embedded stop` to the `pglease` parser."""
    p = subparsers.add_parser(
        "embedded",
        help="status or stop of the embedded PostgreSQL (never starts it)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=["status", "stop"])
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="stop: wait this long for the server to shut down (default 60)",
    )
    # connects=False: main resolves no DSN (that could start the server `status` reports on).
    p.set_defaults(func=cmd_embedded, connects=False)


def _view(status: EmbeddedStatus) -> dict[str, object]:
    return {
        "running": status.running,
        "data_dir": str(status.data_dir),
        "initialised": status.initialised,
        "pid": status.pid,
        "port": status.port,
        "socket_dir": status.socket_dir,
        "host": status.host,
        "dsn": status.dsn,
        "version": status.version,
        "size_bytes": status.size_bytes,
    }


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def cmd_embedded(args: argparse.Namespace) -> int:
    if args.action == "stop":
        stopped = stop_embedded(timeout=args.timeout)
        status = embedded_status(details=False)
        if args.json:
            print_json({"stopped": stopped, "was_running": stopped, **_view(status)})
        elif stopped:
            print(f"stopped the embedded PostgreSQL in {status.data_dir}")
        else:
            print(f"the embedded PostgreSQL in {status.data_dir} was not running")
        return EXIT_OK
    status = embedded_status()
    if args.json:
        print_json(_view(status))
    elif status.running:
        where = (
            f"socket {status.socket_dir}/.s.PGSQL.{status.port or 5432}"
            if status.socket_dir
            else f"{status.host}:{status.port}"
        )
        print("embedded PostgreSQL: running")
        print(f"data directory: {status.data_dir}")
        print(f"listening:      {where}")
        print(f"pid:            {status.pid}")
        print(f"version:        PostgreSQL {status.version or '-'}")
        print(f"size on disk:   {_size(status.size_bytes)}")
        print(f"dsn:            {status.dsn}")
        print("stop it with:   pglease embedded stop")
    else:
        state = "" if status.initialised else ", no cluster there yet"
        print(f"embedded PostgreSQL: not running (data directory {status.data_dir}{state})")
    return EXIT_OK if status.running else EXIT_NOT_RUNNING
