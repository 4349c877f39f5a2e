"""A LIFO stack of connections kept checked out of the pool, for the hot path.

psycopg-pool's checkout and return cost about 25 us of client CPU each
(statistics, conditions, state checks); a lease call makes one per operation,
and on a small machine that CPU is taken from PostgreSQL. Connections are
taken from the pool once and then reused from this stack under a plain lock.
A connection that comes back broken or not idle is handed to the pool, which
resets or replaces it.

Every connection is checked before use (`alive`): one the server closed while
it sat idle (pg_terminate_backend, a restart, idle_session_timeout) is dropped
before anything is sent on it, so the call runs on a live one instead of
failing with an outcome nobody can know.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool

_OK = pq.ConnStatus.OK
_IDLE = pq.TransactionStatus.IDLE


def alive(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether an idle connection can take a query: open, and nothing waiting on its socket.

    An idle connection is sent nothing unprompted except by a server that is
    hanging up (its FATAL message, then end-of-file); a LISTEN's notifications
    are the exception, and store connections do not LISTEN. A zero-timeout poll
    costs well under a microsecond and no round trip.
    """
    pgconn = conn.pgconn
    if pgconn.status != _OK or pgconn.transaction_status != _IDLE:
        return False
    try:
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError, psycopg.OperationalError):
        return False


def discard(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Close a connection found dead so its pool replaces it on return."""
    # pgconn.finish() is what close() does, without awaiting for an AsyncConnection.
    conn.pgconn.finish()


class ConnectionStack:
    def __init__(self, pool: ConnectionPool[psycopg.Connection[Any]]) -> None:
        self._pool = pool
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()

    def take(self) -> psycopg.Connection[Any]:
        """A live connection for one call; hand it back with `give_back` in a `finally`.

        Raises the pool's errors (PoolTimeout, PoolClosed), or OperationalError
        when every connection tried was dead; nothing was sent in either case.
        """
        # Every dead one is dropped, so the stack and the pool run out of them;
        # the bound only stops a server that kills each new connection at once.
        for _ in range(2 * self._pool.max_size + 2):
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._pool.getconn()
            if alive(conn):
                return conn
            discard(conn)
            self._pool.putconn(conn)
        raise psycopg.OperationalError("every connection tried had been closed by the server")

    @contextmanager
    def borrow(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self.take()
        try:
            yield conn
        finally:
            self.give_back(conn)

    def give_back(self, conn: psycopg.Connection[Any]) -> None:
        pgconn = conn.pgconn
        if (
            pgconn.status == pq.ConnStatus.OK
            and pgconn.transaction_status == pq.TransactionStatus.IDLE
            and not conn.closed
        ):
            with self._lock:
                self._idle.append(conn)
        else:
            self._pool.putconn(conn)

    def drain(self) -> None:
        """Return every kept connection to the pool (before closing it)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            self._pool.putconn(conn)
