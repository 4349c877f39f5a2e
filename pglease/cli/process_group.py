"""A command run as its own process group, stopped as a whole (`pglease hold`).

The command starts in a new session (``setsid``), so it leads a process group
of its own and every process it starts (a shell's background jobs, the stages
of a pipeline, grandchildren) is in that group unless it leaves on purpose.
Signals go to the whole group (``killpg``), and the group counts as gone only
when ``killpg(pgid, 0)`` finds no member left, zombies included.

Zombies: a member that exits stays in the group until its parent reaps it.
On Linux the runner makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``)
for as long as the group runs, so members orphaned by their parent's death
are reparented to the runner, not to pid 1, and the runner reaps them itself
(``waitpid(-pgid)``). Elsewhere orphans go to pid 1 (or the nearest
subreaper), which reaps them; the runner then polls until the group is gone.

What a group cannot cover: a process that leaves it (``setsid``,
``setpgid``, a daemon's double fork into a new session) is no longer
signalled and no longer waited for. Run such commands under a supervisor
that tracks every descendant, e.g. a systemd unit with
``KillMode=control-group`` (the default) or a cgroup of their own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Callable

#: How long `alive` waits for a reaped leader's status to be recorded: the
#: reaping thread records it right after its waitpid returns.
_RECORD_WAIT = 10.0
#: linux/prctl.h
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


class Subreaper:
    """Make this process a child subreaper while the context is open (Linux;
    a no-op elsewhere), then restore the previous setting."""

    def __init__(self) -> None:
        self._prctl = _prctl()
        self._previous: int | None = None
        #: True when orphaned descendants are reparented to this process.
        self.active = False

    def __enter__(self) -> Subreaper:
        if self._prctl is not None:
            current = ctypes.c_int(0)
            if self._prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(current), 0, 0, 0) == 0:
                self._previous = current.value
                self.active = self._prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prctl is not None and self.active and not self._previous:
            self._prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class ProcessGroup:
    """The command's process group: signal it, reap it, tell when it is gone.

    `returncode` is the leader's (the command's own) as `subprocess` reports
    it (negative: killed by that signal), None while it runs. The leader is
    reaped here, never through `Popen.poll`/`wait`, which would lose its status
    to a concurrent ``waitpid(-pgid)``.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pgid = proc.pid
        #: Guards `returncode`; notified when the leader's status is recorded.
        self._recorded = threading.Condition()
        self.returncode: int | None = None

    @classmethod
    def spawn(cls, command: list[str], env: dict[str, str]) -> ProcessGroup:
        """Start `command` as the leader of a new session (raises OSError as Popen)."""
        return cls(subprocess.Popen(command, env=env, start_new_session=True))

    def _record(self, pid: int, status: int) -> None:
        if pid == self.pgid:
            with self._recorded:
                self.returncode = os.waitstatus_to_exitcode(status)
                # Popen must not wait for it again (it would read ECHILD as 0).
                self.proc.returncode = self.returncode
                self._recorded.notify_all()

    def reap(self) -> None:
        """Reap every member that is this process's child and has exited."""
        while True:
            try:
                pid, status = os.waitpid(-self.pgid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._record(pid, status)

    def reap_in_background(self, wake: threading.Event) -> None:
        """A thread that reaps members as they exit and sets `wake` each time."""

        def run() -> None:
            while True:
                try:
                    pid, status = os.waitpid(-self.pgid, 0)
                except ChildProcessError:
                    # None of the group is this process's child (any more):
                    # the supervisor polls from here on.
                    wake.set()
                    return
                self._record(pid, status)
                wake.set()

        threading.Thread(target=run, name="pglease-reap", daemon=True).start()

    def signal(self, signum: int) -> None:
        """Send `signum` to every member of the group (nothing when it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def alive(self) -> bool:
        """Whether any member is left (a member no one reaped yet counts)."""
        self.reap()
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            # The leader is gone, so it was reaped; the reaping thread may sit
            # between its waitpid and recording the status: wait for that.
            with self._recorded:
                self._recorded.wait_for(lambda: self.returncode is not None, timeout=_RECORD_WAIT)
            return False
        except PermissionError:
            return True  # a member we may not signal is still a member
        return True
