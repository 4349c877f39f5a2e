"""`pglease hold TYPE KEY --owner O --ttl S -- COMMAND ARGS...`: run a command under a lease.

The runner acquires the lease (waiting up to ``--timeout``; default forever),
keeps it alive with a keeper thread, and runs the command with
``PGLEASE_FENCE`` (the generation, to pass to downstream systems),
``PGLEASE_RESOURCE_ID``, ``PGLEASE_OWNER`` and ``PGLEASE_TTL`` in its
environment. When the lease is lost the command gets SIGTERM, then SIGKILL
after ``--kill-after`` seconds. SIGTERM/SIGINT sent to the runner are passed
on to the command; the lease is released once it exits.

Exit codes: the command's own; 128+N when it died of signal N (or the runner
was stopped by signal N before it started); 75 when the lease was lost
(the command was stopped); 3 when ``--timeout`` ran out before the lease was
acquired; 2 usage; 1 other errors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

from ..cli_support import EXIT_HELD, EXIT_USAGE, fail, open_store, owner_arg
from ..errors import AcquireTimeoutError, LeaseLostError
from .acquire import hold

#: Exit code when the lease was lost while the command ran (EX_TEMPFAIL).
EXIT_LEASE_LOST = 75
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Interrupted(BaseException):
    """A signal arrived before the command started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def register(subparsers: Any) -> None:
    """Add the `hold` subcommand to the `pglease` parser."""
    p = subparsers.add_parser(
        "hold",
        help="run a command while holding a lease (exit 75 when the lease is lost)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("type", help="resource type, e.g. run")
    p.add_argument("key", help="resource key")
    p.add_argument("--owner", type=owner_arg, required=True, help="OWNER_TYPE:OWNER_ID")
    p.add_argument("--ttl", type=float, required=True, help="lease length in seconds")
    p.add_argument("--timeout", type=float, help="give up acquiring after S seconds (exit 3)")
    p.add_argument("--fair", action="store_true", help="wait in arrival order across hosts")
    p.add_argument("--interval", type=float, help="renew interval (default ttl/3)")
    p.add_argument("--margin", type=float, help="local safety margin (default ttl/10)")
    p.add_argument(
        "--kill-after", type=float, default=5.0, help="SIGKILL this long after SIGTERM (5 s)"
    )
    p.add_argument("command", nargs="+", help="-- COMMAND ARGS... (after a literal --)")
    p.set_defaults(func=cmd_hold)


def _stop_child(child: subprocess.Popen[bytes], kill_after: float, signum: int) -> int:
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)
        try:
            child.wait(kill_after)
        except subprocess.TimeoutExpired:
            child.kill()
    return child.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def cmd_hold(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        return fail("hold needs a command after --", EXIT_USAGE)
    child: subprocess.Popen[bytes] | None = None
    wake = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        wake.set()
        if child is None:
            raise _Interrupted(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {s: signal.signal(s, on_signal) for s in _SIGNALS}
    try:
        with open_store(args) as store:
            try:
                with hold(
                    store, args.type, args.key, args.owner, args.ttl, timeout=args.timeout,
                    fair=args.fair, interval=args.interval, margin=args.margin,
                    on_lost=lambda _e: wake.set(),
                ) as lease:  # fmt: skip
                    env = {
                        **os.environ,
                        "PGLEASE_FENCE": str(lease.generation),
                        "PGLEASE_RESOURCE_ID": lease.resource_id,
                        "PGLEASE_OWNER": str(lease.owner),
                        "PGLEASE_TTL": repr(lease.timing.ttl),
                    }
                    child = subprocess.Popen(command, env=env)
                    proc = child

                    def reap() -> None:
                        proc.wait()
                        wake.set()

                    threading.Thread(target=reap, daemon=True).start()
                    while proc.poll() is None and not received:
                        # The clock decides even if no thread noticed yet.
                        try:
                            lease.check()
                        except LeaseLostError:
                            break
                        wake.wait(max(0.01, min(0.5, lease.time_left())))
                        wake.clear()
                    if proc.poll() is None and lease.lost_error is not None and not received:
                        print(f"pglease: {lease.lost_error}; stopping the command", file=sys.stderr)
                        _stop_child(proc, args.kill_after, signal.SIGTERM)
                        return EXIT_LEASE_LOST
                    if received:
                        return _exit_code(_stop_child(proc, args.kill_after, received[0]))
                    return _exit_code(proc.wait())
            except AcquireTimeoutError as exc:
                return fail(str(exc), EXIT_HELD)
    except _Interrupted as exc:
        return 128 + exc.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
