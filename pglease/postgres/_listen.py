"""`PgChangeListener`: the watch hub's own connection to PostgreSQL (the listen
protocol, `pglease.driver.listen`).

One autocommit connection per hub, never a pooled one: notifications reach
a session only while it is connected and between transactions. LISTEN comes
first (it commits at once in autocommit), then every read: any event
committed after `open` returns is either read or notifies. Behind a
transaction pooler nothing is LISTENed and nothing is prepared (the hub polls).

Every round trip on the line is bounded by the request's `stall_timeout`
(issue 31): a path that stops forwarding bytes leaves the socket open, and
psycopg (or libpq's blocking exec) would wait for as long as it stays so. At
the deadline `_stall.arm` shuts the socket down, the call fails at once, and
the error names the silence: the hub records it (health turns unhealthy),
drops the line and reconnects, the connect bounded the same way.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.abc import Transformer as AdaptContextTransformer
from psycopg.adapt import Transformer
from psycopg.errors import error_from_result

from .. import cursor_check
from ..cursors import Cursor, Position
from ..driver.listen_ops import ListenRequest, LogPage, LogReadError, PageOp
from ..errors import ValidationError
from . import _stall
from ._watch_sql import (
    WatchQueries,
    channel_name,
    log_read_error,
    parse_page,
    read_args,
    silence,
    silence_error,
)

#: The name of the hub's prepared read on its own connection.
READ_STATEMENT = b"pglease_watch_read"
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
#: What the errors of this listener say failed.
_WHAT = "the watch stream's connection"
#: Where a stall was, in the error that names it.
_WHERE = "the watch connection"
#: libpq's (and psycopg's) smallest connect_timeout: lower values count as 2 s.
_MIN_CONNECT_TIMEOUT = 2


def connect_timeout(stall_timeout: float) -> int:
    """The connect_timeout (whole seconds, libpq's rule) for a stall bound."""
    return max(_MIN_CONNECT_TIMEOUT, math.ceil(stall_timeout))


def check_result(conn: psycopg.Connection[Any], result: pq.abc.PGresult, expected: int) -> None:
    """Raise the psycopg error of a failed libpq call (mapped by the caller)."""
    if result.status == expected:
        return
    if conn.pgconn.status == pq.ConnStatus.BAD:
        raise psycopg.OperationalError(
            (conn.pgconn.error_message or b"connection lost").decode(errors="replace").strip()
        )
    raise error_from_result(result, encoding=conn.info.encoding)


class PgChangeListener:
    """A `ChangeListener` on one dedicated psycopg connection."""

    def __init__(self, request: ListenRequest) -> None:
        if request.pooler and request.listen:
            # The watcher refuses this first, saying why; a listener must not try.
            raise ValidationError("a listener in pooler mode cannot LISTEN")
        self.request = request
        self._q = WatchQueries(request.schema)
        self._channel = sql.Identifier(channel_name(request.schema))
        self._conn: psycopg.Connection[Any] | None = None
        self._loader: AdaptContextTransformer | None = None
        #: A NOTIFY reached us during a read: the next wait must not block.
        self._woken = False

    def _live(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise LogReadError(f"{_WHAT} is not open", permanent=False)
        return self._conn

    def open(self) -> None:
        """Connect, LISTEN (listen mode) and prepare the read; on failure
        nothing stays open."""
        request = self.request
        options: dict[str, Any] = {"autocommit": True}
        if request.pooler:
            options["prepare_threshold"] = None
        stall = request.stall_timeout
        if stall is not None:
            # A paused path accepts the TCP connection and then answers nothing:
            # without a bound psycopg waits 130 s (its default) per attempt.
            options["connect_timeout"] = connect_timeout(stall)
        try:
            conn = psycopg.connect(request.source, **options)
        except psycopg.errors.ConnectionTimeout as exc:
            if stall is None:
                raise log_read_error(exc, _WHAT) from exc
            cause = silence(exc, options["connect_timeout"], f"{_WHERE} while connecting")
            raise silence_error(cause, _WHAT) from cause
        except psycopg.Error as exc:
            raise log_read_error(exc, _WHAT) from exc
        try:
            with self._bounded(conn):
                if request.listen:
                    # LISTEN first, then read: nothing committed after this can slip by.
                    conn.execute(sql.SQL("LISTEN {}").format(self._channel))
                # The read goes straight through libpq as a prepared statement, its
                # rows loaded by psycopg's C loaders: psycopg's cursor machinery
                # would cost more client CPU per read than the server spends on it.
                # Behind a transaction pooler it is an unnamed statement (parsed
                # each time): a named one would exist on one server connection only.
                if not request.pooler:
                    result = conn.pgconn.prepare(READ_STATEMENT, self._q.read_prepared)
                    check_result(conn, result, _COMMAND_OK)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        self._loader = Transformer.from_context(conn)
        self._woken = False
        self._conn = conn

    @contextlib.contextmanager
    def _bounded(
        self, conn: psycopg.Connection[Any], seconds: float | None = None
    ) -> Iterator[psycopg.Connection[Any]]:
        """One round trip on `conn` under the stall timeout (`seconds`, else the
        request's); psycopg's errors become `LogReadError`s."""
        if seconds is None:
            seconds = self.request.stall_timeout
        deadline: _stall.Deadline | None = None
        try:
            # Inside the try: a line libpq already dropped has no socket to arm.
            deadline = _stall.arm(conn, seconds)
            yield conn
        except psycopg.Error as exc:
            if deadline is not None and deadline.fired:
                cause = silence(exc, deadline.seconds, _WHERE)
                raise silence_error(cause, _WHAT) from cause
            raise log_read_error(exc, _WHAT) from exc
        finally:
            if deadline is not None:
                # Before anyone may close the connection (its descriptor could be reused).
                deadline.cancel()

    def set_listening(self, on: bool) -> None:
        with self._bounded(self._live()) as conn:
            conn.execute(sql.SQL("LISTEN {}" if on else "UNLISTEN {}").format(self._channel))

    def wait(self, timeout: float) -> bool:
        if self._woken:
            self._woken = False
            return True
        conn = self._live()
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                for _ in conn.notifies(timeout=left, stop_after=1):
                    return True
        except psycopg.Error as exc:
            raise log_read_error(exc, _WHAT) from exc

    def frontier(self) -> Position:
        with self._bounded(self._live()) as conn:
            row = conn.execute(self._q.frontier).fetchone()
        assert row is not None  # the view has one row
        return Position(int(row[0]), 0)

    def read_log(self, op: PageOp) -> LogPage:
        conn = self._live()
        args = [str(arg).encode() for arg in read_args(op.after, op.upto, op.limit)]
        # Any notification received before this read starts is covered by its
        # snapshot (its writer had committed).
        self._woken = False
        pgconn = conn.pgconn
        with self._bounded(conn, op.stall_timeout):
            if self.request.pooler:
                result = pgconn.exec_params(self._q.read_prepared, args)
            else:
                result = pgconn.exec_prepared(READ_STATEMENT, args)
            check_result(conn, result, _TUPLES_OK)
            # libpq keeps a NOTIFY that arrived with the result in its own
            # buffer, where psycopg's `notifies()` (which waits on the socket
            # first) would not see it until more data came: take it out now, or
            # its writer's event would wait for the fallback poll.
            while pgconn.notifies() is not None:
                self._woken = True
            loader = self._loader
            assert loader is not None
            loader.set_pgresult(result)
            rows = loader.load_rows(0, result.ntuples, tuple)
        return parse_page(rows, op.limit)

    def check_position(self, cursor: Cursor) -> None:
        queries = cursor_check.pg_queries(self.request.schema)
        with self._bounded(self._live()) as conn:
            row = conn.execute(queries.check, cursor_check.pg_check_args(cursor)).fetchone()
        assert row is not None  # the check returns one row
        cursor_check.pg_verify(cursor, row, refuse_expired=False)

    def session_id(self) -> int | None:
        conn = self._conn
        return None if conn is None or conn.closed else conn.info.backend_pid

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken line closes anyway
                conn.close()
