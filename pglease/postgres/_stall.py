"""A client-side deadline for a statement run through psycopg (issue 31).

The server's `statement_timeout` cannot end a call whose path went silent (a
network stall, a hung server): psycopg then waits for as long as the socket
stays open. At the deadline (`Limits.client_deadline`) the connection's socket
is shut down (not closed: the descriptor stays the connection's), so
psycopg's wait wakes at once with a lost connection, which the pool then
replaces. `Deadline.fired` tells the caller that the deadline, not the
server, ended the call.

Asyncio arms one loop timer per call. The blocking store shares one daemon
thread (`_Watchdog`) that sleeps until the earliest armed deadline; disarming
happens before the call returns, under the watchdog's lock, so a socket is
never shut down once its call has ended (its descriptor could be reused).
A forked child starts a watchdog of its own.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import socket
import threading
import time
from typing import Any

import psycopg


def _shutdown(fd: int) -> None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()  # the descriptor stays libpq's


class Deadline:
    """One armed deadline; `cancel()` it in a `finally` before the connection goes."""

    __slots__ = ("_cancel", "fired", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.fired = False
        self._cancel: Any = None

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None


class _Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, int, Deadline]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, fd: int, deadline: Deadline) -> None:
        key = next(self._ids)
        at = time.monotonic() + deadline.seconds
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pglease-deadline", daemon=True
                )
                self._thread.start()
            first = not self._heap or at < self._heap[0][0]
            heapq.heappush(self._heap, (at, key, fd, deadline))
            self._live.add(key)
            if first:
                self._cond.notify()

        def cancel() -> None:
            with self._cond:
                self._live.discard(key)

        deadline._cancel = cancel

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                at, key, fd, deadline = self._heap[0]
                delay = at - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(key)
                deadline.fired = True
                _shutdown(fd)


_watchdog = _Watchdog()


def _renew_after_fork() -> None:
    # A thread does not survive a fork: a child that inherited a started
    # watchdog (its thread gone, its lock perhaps held at the fork) would arm
    # deadlines that never fire. The child gets a fresh one; its inherited
    # deadlines belong to the parent's calls.
    global _watchdog
    _watchdog = _Watchdog()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_renew_after_fork)


def arm(conn: psycopg.Connection[Any], seconds: float | None) -> Deadline | None:
    """Shut `conn`'s socket down `seconds` from now unless cancelled first."""
    if seconds is None:
        return None
    deadline = Deadline(seconds)
    _watchdog.arm(conn.pgconn.socket, deadline)
    return deadline


def arm_async(conn: psycopg.AsyncConnection[Any], seconds: float | None) -> Deadline | None:
    """`arm` for a connection of the running event loop."""
    if seconds is None:
        return None
    deadline = Deadline(seconds)
    fd = conn.pgconn.socket

    def fire() -> None:
        deadline.fired = True
        _shutdown(fd)

    handle = asyncio.get_running_loop().call_later(seconds, fire)
    deadline._cancel = handle.cancel
    return deadline
