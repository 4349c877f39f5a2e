"""A LIFO stack of connections kept checked out of the pool, for the hot path.

psycopg-pool's checkout and return cost about 25 us of client CPU each
(statistics, conditions, state checks); a lease call makes one per operation,
and on a small machine that CPU is taken from PostgreSQL. Connections are
taken from the pool once and then reused from this stack under a plain lock.
A connection that comes back broken or not idle is handed to the pool, which
resets or replaces it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool


class ConnectionStack:
    def __init__(self, pool: ConnectionPool[psycopg.Connection[Any]]) -> None:
        self._pool = pool
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()

    def take(self) -> psycopg.Connection[Any]:
        """A connection for one call; hand it back with `give_back` in a `finally`."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._pool.getconn()

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
