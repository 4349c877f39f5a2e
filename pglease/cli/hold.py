"""`pglease hold TYPE KEY --owner O --ttl S -- COMMAND ARGS...`: run a command under a lease.

The runner acquires the lease (waiting up to ``--timeout``; default forever),
keeps it alive with a keeper thread, and runs the command with
``PGLEASE_FENCE`` (the generation, to pass to downstream systems),
``PGLEASE_RESOURCE_ID``, ``PGLEASE_OWNER`` and ``PGLEASE_TTL`` in its
environment.

The command runs in a session (process group) of its own, and every signal
the runner sends goes to the whole group: a shell's background jobs, the
stages of a pipeline, anything the command started and that stayed in the
group. The runner releases the lease only once the group is gone. On Linux
the runner is a child subreaper while the command runs, so orphaned members
are reparented to it and reaped. A process that leaves the group (``setsid``,
a daemon's double fork) is beyond the runner's reach: run such commands in a
systemd unit (``KillMode=control-group``) or a cgroup of their own. The
command has no controlling terminal.

The group is dead before the lease can be claimed by another host, given
the margin exceeds clock drift plus scheduling delay: the trust window closes
at ``request start of the last renewal + ttl - margin`` (local monotonic
clock) and the database lets nobody else claim before ``ttl`` after that
request reached it. While renewals keep failing, the group gets SIGTERM
``--kill-after`` seconds before the window closes and SIGKILL when it closes;
the runner waits until it is gone and only then releases the lease. When the
database reports the lease gone (taken over, revoked), the group is killed at
once; after a revoke, nobody can claim before the revoked lease's last expiry,
by which time the runner has stopped the group. ``--kill-after`` is at most
``ttl - margin - 2 x interval``, so a healthy run, or one failed beat, is never
stopped. SIGTERM/SIGINT sent to the runner are passed on to the group (SIGKILL
``--kill-after`` later, or at the window's close if sooner). When the command
exits and leaves processes in its group, they get SIGTERM, then SIGKILL
``--kill-after`` later; the exit code is still the command's.

Exit codes: the command's own; 128+N when it died of signal N (or the runner
was stopped by signal N before it started); 75 when the lease was lost, or
about to be, while the command ran (the command was stopped); 127 when the
command was not found, 126 when it could not be run (both checked, as exec
would, before anything is claimed); 3 when ``--timeout`` ran
out before the lease was acquired; 2 usage; 1 other errors (among them: no
database connection for the keeper, reported before anything is claimed).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import psycopg

from ..errors import AcquireTimeoutError, LeaseLostError, PgleaseError
from ..runtime._timing import Timing, real_wait
from ..runtime.acquire import hold
from ..runtime.keeper import Keeper
from ..runtime.lease import HeldLease
from ..types import Claim
from .process_group import ProcessGroup, Subreaper
from .support import EXIT_HELD, EXIT_USAGE, fail, open_store, owner_arg

#: Exit code when the lease was lost while the command ran (EX_TEMPFAIL).
EXIT_LEASE_LOST = 75
#: Shell conventions: command not found / found but not executable.
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126
#: Default grace between SIGTERM and SIGKILL, when the timing allows it.
DEFAULT_KILL_AFTER = 5.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How often the runner looks at a group whose members cannot wake it (they
#: are not its children), and at a killed group until it is gone.
GROUP_POLL = 0.05


class _Interrupted(BaseException):
    """A signal arrived before the command started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _RunnerKeeper(Keeper):
    """The runner's keeper: it never gives a lost lease back itself.

    The shared keeper releases a lease lost by the local clock at once, which
    lets another host claim while the command may still be running; the
    runner releases only after it has reaped the command (`_release_after`).
    """

    def _release_quietly(self, claim: Claim) -> None:
        return None


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
        "--kill-after",
        type=float,
        help="SIGTERM this long before the trust window closes, SIGKILL when it closes"
        f" (default {DEFAULT_KILL_AFTER:g} s, or ttl - margin - 2 x interval if less)",
    )
    p.add_argument("command", nargs="+", help="-- COMMAND ARGS... (after a literal --)")
    p.set_defaults(func=cmd_hold)


def kill_after_bound(timing: Timing) -> float:
    """The longest grace the timing allows: SIGTERM at the trust window's close
    minus the grace must come after two renew intervals without a renewal."""
    return timing.ttl - timing.margin - 2 * timing.interval


def _grace(requested: float | None, timing: Timing) -> float | str:
    """The SIGTERM-to-SIGKILL grace, or the usage error's message."""
    bound = kill_after_bound(timing)
    if requested is None:
        return min(DEFAULT_KILL_AFTER, bound)
    if not requested >= 0:  # also refuses NaN
        return f"--kill-after must be a non-negative number of seconds, got {requested:g}"
    if requested > bound:
        return (
            f"--kill-after {requested:g}s exceeds ttl - margin - 2 x interval ="
            f" {bound:.3g}s (ttl {timing.ttl:g}s, interval {timing.interval:.3g}s,"
            f" margin {timing.margin:.3g}s): the command gets SIGTERM that long before"
            " the trust window closes, so a longer grace would stop healthy runs;"
            " raise --ttl or lower --interval/--margin"
        )
    return requested


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _lost_line(exc: BaseException) -> str:
    """A loss as one line (a LeaseLostError may wrap the error that caused it)."""
    return " ".join(str(exc).split())


class _NoLossRecords(logging.Filter):
    """Drops the runtime's own warning of a lost lease: the CLI tells the loss
    itself, once, on one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and args and isinstance(args[0], LeaseLostError))


@contextlib.contextmanager
def quiet_loss_log() -> Iterator[None]:
    """While open, a lost lease is not also logged by `pglease.runtime`."""
    logger = logging.getLogger("pglease.runtime")
    quiet = _NoLossRecords()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _Supervisor:
    """Runs the command group's stop schedule against the lease's trust window.

    Every instant of the schedule is read from the lease's clock (its keeper's);
    the waits between them are real (`real_wait`), so under a fake clock the
    supervisor acts at its next wake-up after the clock was advanced.
    """

    def __init__(
        self,
        group: ProcessGroup,
        lease: HeldLease,
        grace: float,
        received: list[int],
        wake: threading.Event,
    ) -> None:
        self.group = group
        self.lease = lease
        self.grace = grace
        self.received = received
        self.wake = wake
        self.clock = lease.clock
        #: The runner stopped the command because of the lease.
        self.stopped_for_lease = False
        # When the group got SIGTERM (or a forwarded signal): SIGKILL follows
        # `grace` later at the latest.
        self._term_at: float | None = None
        self._killed = False

    def run(self) -> int:
        """Wait until every member of the group is dead (and the ones that were
        this process's children reaped); return the command's returncode."""
        forwarded = 0
        while True:
            # Cleared before the state is read: a wake-up after this is not lost.
            self.wake.clear()
            now = self.clock.monotonic()
            # Signals to the runner go to the whole group, from here rather
            # than the handler: one that came while the command was being
            # started is passed on too.
            while forwarded < len(self.received):
                self.group.signal(self.received[forwarded])
                forwarded += 1
                if self._term_at is None:
                    self._term_at = now
            if not self.group.alive():
                returncode = self.group.returncode
                assert returncode is not None  # the leader is reaped here only
                return returncode
            with contextlib.suppress(LeaseLostError):
                self.lease.check()  # the clock decides even if no thread noticed yet
            now = self.clock.monotonic()
            # A loss the database reported (taken over, revoked) ends trust at
            # once, so the group is killed straight away.
            closes = self.lease.trusted_until
            if self._term_at is None and now >= closes - self.grace:
                lost = self.lease.lost_error
                self._stop(
                    f"{_lost_line(lost)}; stopping the command"
                    if lost is not None
                    else f"the lease on {self.lease.resource_id} was not renewed and its"
                    f" trust window closes in {closes - now:.3f}s; stopping the command"
                    " (SIGTERM now, SIGKILL when the window closes)"
                )
                self.group.signal(signal.SIGTERM)
                self._term_at = now
            leader_done = self.group.returncode is not None
            if self._term_at is None and leader_done:
                # The command exited and left processes in its group: they are
                # the command's too, and the lease is released only after them.
                print(
                    f"pglease: the command exited (code {_exit_code(self.group.returncode or 0)})"
                    f" and left processes in its group {self.group.pgid}; stopping them"
                    f" (SIGTERM now, SIGKILL in {self.grace:g}s at the latest)",
                    file=sys.stderr,
                    flush=True,
                )
                self.group.signal(signal.SIGTERM)
                self._term_at = now
            kill_at = closes if self._term_at is None else min(closes, self._term_at + self.grace)
            if self._killed or now >= kill_at:
                if not self._killed and now >= closes:
                    self._stop("the lease's trust window closed; killing the command")
                self._killed = True
                # Again on every pass: a member that was forking as the first
                # SIGKILL went out is killed too.
                self.group.signal(signal.SIGKILL)
                self.wake.wait(GROUP_POLL)
                continue
            wake_at = kill_at if self._term_at is not None else closes - self.grace
            delay = real_wait(self.clock, wake_at - self.clock.monotonic())
            if leader_done:
                # Members that are not this process's children wake nobody.
                delay = GROUP_POLL if delay is None else min(delay, GROUP_POLL)
            self.wake.wait(delay)

    def _stop(self, message: str) -> None:
        if not self.stopped_for_lease:
            self.stopped_for_lease = True
            print(f"pglease: {message}", file=sys.stderr, flush=True)

    def kill(self) -> None:
        """Kill the group and wait until it is gone (the way out of an error)."""
        while self.group.alive():
            self.group.signal(signal.SIGKILL)
            self.wake.wait(GROUP_POLL)


def _release_after(store: Any, lease: HeldLease) -> None:
    """Give back a lease lost by the local clock, once the group is gone:
    the database may still have it, and others need not wait for its expiry."""
    lost_at = lease.lost_at
    if lost_at is None or lost_at < lease.deadline:
        return  # still held (released on exit) or reported gone by the database
    with contextlib.suppress(LeaseLostError, PgleaseError, psycopg.Error):
        store.release(lease.claim)


def _unrunnable(command: list[str], env: dict[str, str]) -> tuple[str, int] | None:
    """Why `command` cannot be run, as exec would find out, or None: checked
    before anything is claimed, so a typo costs no generation and no event."""
    name = command[0]
    if not name:
        return "'': command not found", EXIT_NOT_FOUND
    if os.sep in name or (os.altsep is not None and os.altsep in name):
        candidates = [name]
    else:
        candidates = [os.path.join(d or os.curdir, name) for d in os.get_exec_path(env)]
    found = [c for c in candidates if os.path.exists(c)]
    if not found:
        return f"{name}: command not found", EXIT_NOT_FOUND
    for path in found:
        if not os.path.isdir(path) and os.access(path, os.X_OK):
            return None
    reason = "is a directory" if os.path.isdir(found[0]) else "permission denied"
    return f"{name}: cannot run: {reason}", EXIT_CANNOT_RUN


def _spawn(command: list[str], env: dict[str, str]) -> ProcessGroup | int:
    """Start the command in a group of its own, or return the exit code for a
    command that cannot run after all (its file changed since it was checked,
    or it is not a program: ENOEXEC)."""
    try:
        return ProcessGroup.spawn(command, env)
    except FileNotFoundError:
        return fail(f"{command[0]}: command not found", EXIT_NOT_FOUND)
    except OSError as exc:
        # EACCES (not executable, a directory), ENOEXEC (not a program): 126 as in sh.
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        return fail(f"{command[0]}: cannot run: {reason}", EXIT_CANNOT_RUN)


def cmd_hold(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        return fail("hold needs a command after --", EXIT_USAGE)
    timing = Timing.of(args.ttl, args.interval, args.margin)  # bad settings: exit 2
    grace = _grace(args.kill_after, timing)
    if isinstance(grace, str):
        return fail(grace, EXIT_USAGE)
    unrunnable = _unrunnable(command, dict(os.environ))
    if unrunnable is not None:
        return fail(*unrunnable)
    wake = threading.Event()
    received: list[int] = []
    # Until the command is being started a signal ends the runner (nothing
    # to stop yet); from then on the supervisor passes it on to the group.
    started = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        wake.set()
        if not started:
            raise _Interrupted(signum)

    supervisor: _Supervisor | None = None
    previous = {s: signal.signal(s, on_signal) for s in _SIGNALS}
    try:
        with quiet_loss_log(), open_store(args) as store, _RunnerKeeper(store) as keeper:
            try:
                with hold(
                    store, args.type, args.key, args.owner, timing.ttl, timeout=args.timeout,
                    fair=args.fair, interval=timing.interval, margin=timing.margin,
                    on_lost=lambda _e: wake.set(), keeper=keeper,
                ) as lease:  # fmt: skip
                    env = {
                        **os.environ,
                        "PGLEASE_FENCE": str(lease.generation),
                        "PGLEASE_RESOURCE_ID": lease.resource_id,
                        "PGLEASE_OWNER": str(lease.owner),
                        "PGLEASE_TTL": repr(lease.timing.ttl),
                    }
                    with Subreaper():
                        started = True
                        spawned = _spawn(command, env)
                        if isinstance(spawned, int):
                            return spawned  # released on the way out
                        spawned.reap_in_background(wake)
                        supervisor = _Supervisor(spawned, lease, grace, received, wake)
                        try:
                            returncode = supervisor.run()
                        finally:
                            supervisor.kill()  # gone already, unless run() raised
                    _release_after(store, lease)
                    if supervisor.stopped_for_lease:
                        code = EXIT_LEASE_LOST
                    else:
                        code = _exit_code(returncode)
            except AcquireTimeoutError as exc:
                return fail(str(exc), EXIT_HELD)
            except LeaseLostError as exc:
                # Lost while the command ran: the block was left after the loss.
                # The supervisor said so already if it stopped the command for it.
                if supervisor is None or not supervisor.stopped_for_lease:
                    print(f"pglease: {_lost_line(exc)}", file=sys.stderr, flush=True)
                return EXIT_LEASE_LOST
            return code
    except _Interrupted as exc:
        return 128 + exc.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
