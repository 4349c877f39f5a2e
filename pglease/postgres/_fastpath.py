"""Claim, renew and release over libpq prepared statements.

These three calls are the hot path of every host. Going through psycopg's
cursor machinery costs about 100 us of client CPU per call (result setup,
parameter adaptation, prepared-statement bookkeeping), more than the server
spends on the call itself; on a shared 2-core machine that CPU is taken from
PostgreSQL. Here each call is one `exec_prepared` on the borrowed connection
with text parameters, the token hash in binary, and a result of a few text
columns; timestamps come back as integer microseconds so they convert exactly.

The statements are prepared when the pool opens a connection (`prepare_on_connect`,
from the pool's configure callback), so a fresh connection's first call finds
them: preparing on demand instead would make the server log an ERROR
("prepared statement does not exist") for every new connection, which trips
log-based alerting. They are prepared again when the server says they do not
exist, after a DEALLOCATE ALL or DISCARD ALL; the store's session settings
(time limits) are applied again with them, since DISCARD ALL resets those too.

Pooler mode (``pooler=True``): a transaction-pooling pooler runs each call on
whichever server connection is free, where a statement prepared earlier does
not exist, and a session SET would stay behind on it. Each call is then one
simple-protocol query string, ``SET LOCAL statement_timeout = ...; SET LOCAL
lock_timeout = ...; SELECT ...``, with the arguments as escaped literals: the
server runs a multi-statement string as one implicit transaction, so the
limits bound this call only and end with it, in the same single round trip
(an extended-protocol statement cannot carry a second one). Without limits
(both None) the call is an unnamed statement (`exec_params`).

A failure before the call's own statement reached the server (sending it was
refused, or preparing failed) raises `NotSentError`: such a call certainly did
nothing and may be retried on another connection. Anything after that is the
driver's error, and a broken connection then means the outcome is unknown.

A call whose answer does not come within the store's client deadline
(`Limits.client_deadline`: statement_timeout plus a grace) closes its
connection and raises `StalledError`: the statement was sent, so its outcome
is unknown, and the connection never goes back to the pool. The blocking
calls wait through psycopg's `Connection.wait`, which a store connection
bounds (`_reuse.StoreConnection`); the asyncio calls wait on their own
(`results_async`) with the same bound. A call may pass a shorter `timeout`
(a renew, the end of its claim's trust window).
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import generators, pq
from psycopg.errors import error_from_result

from ..driver import ops
from ..types import Claim
from . import _core

CLAIM = b"pglease_claim"
RENEW = b"pglease_renew"
RELEASE = b"pglease_release"

_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_ACTIVE = pq.TransactionStatus.ACTIVE
_OK = pq.ConnStatus.OK
#: What psycopg's own wait treats as an interruption of a query in flight.
_INTERRUPTED = (asyncio.CancelledError, KeyboardInterrupt, SystemExit)
_NO_SUCH_STATEMENT = b"26000"  # invalid_sql_statement_name
_ALREADY_PREPARED = b"42P05"  # duplicate_prepared_statement
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROS = "(extract(epoch FROM expires_at) * 1000000)::bigint"
_PARAM = re.compile(rb"\$(\d+)")


def from_micros(value: bytes) -> datetime:
    return _EPOCH + timedelta(microseconds=int(value))


#: A call's parameters as libpq takes them: text, the token hash in binary, NULL as None.
Values = list[bytes | None]


# The parameters are built straight from the checked operation: a generic
# per-value encoder (`_encode`) costs a call and a type dispatch per value, and
# this runs twice in every claim/release cycle.
def _optional(revision: int | None, now: datetime | None) -> Values:
    """The two optional trailing parameters every call takes."""
    return [
        None if revision is None else str(revision).encode(),
        None if now is None else now.isoformat().encode(),
    ]


def _lease(claim: Claim, token_sha256: bytes) -> Values:
    """The lease a renew or release names: its first five parameters."""
    owner = claim.owner
    return [
        claim.resource_id.encode(),
        owner.type.encode(),
        owner.id.encode(),
        str(claim.generation).encode(),
        token_sha256,
    ]


def claim_values(op: ops.ClaimOp) -> Values:
    """`claim`'s parameters, in the statement's order."""
    owner = op.owner
    head: Values = [
        op.resource_id.encode(),
        owner.type.encode(),
        owner.id.encode(),
        op.token_sha256,
        repr(op.ttl).encode(),
    ]
    return head + _optional(op.expected_revision, op.now)


def renew_values(op: ops.RenewOp) -> Values:
    """`renew`'s parameters, in the statement's order."""
    return [
        *_lease(op.claim, op.token_sha256),
        repr(op.ttl).encode(),
        *_optional(op.expected_revision, op.now),
    ]


def release_values(op: ops.ReleaseOp) -> Values:
    """`release`'s parameters, in the statement's order."""
    return _lease(op.claim, op.token_sha256) + _optional(op.expected_revision, op.now)


class NotSentError(Exception):
    """The call's statement never reached the server; `cause` is the driver's error."""

    def __init__(self, cause: psycopg.Error) -> None:
        super().__init__(str(cause))
        self.cause = cause


class StalledError(psycopg.OperationalError):
    """No answer within the client deadline; the connection has been closed."""


def stalled(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    timeout: float,
    why: str | None = None,
) -> StalledError:
    """Close `conn` (its state is unknown: broken now, never reused) and say why.

    `why`: what the `timeout` was, when not the client deadline."""
    conn.pgconn.finish()
    if why is None:
        why = f"statement_timeout + {_core.CLIENT_GRACE:g} s"
    return StalledError(
        f"no answer from PostgreSQL within {timeout:g} s ({why}); the connection was closed"
    )


class _Expired(Exception):
    """A fast-path wait ran past the client deadline (`_Watch.complete`)."""


class FastPath:
    """Prepared claim/renew/release for one schema.

    `setup` (SET statements) runs before the statements are prepared, and
    `limits` words the time-limit errors. With `pooler` nothing is prepared:
    every call is an unnamed statement."""

    def __init__(
        self,
        schema: str,
        setup: bytes | None = None,
        limits: _core.Limits | None = None,
        *,
        pooler: bool = False,
    ) -> None:
        s = f'"{schema}"'
        self._setup = setup
        self._limits = limits
        self.pooler = pooler
        self.statements = {
            CLAIM: f"SELECT claimed, generation, {_MICROS}, revision FROM {s}.claim("
            "$1, $2, $3, $4, $5::float8, $6::bigint, $7::timestamptz)",
            RENEW: f"SELECT {_MICROS}, revision FROM {s}.renew("
            "$1, $2, $3, $4::bigint, $5, $6::float8, $7::bigint, $8::timestamptz)",
            RELEASE: f"SELECT revision FROM {s}.release("
            "$1, $2, $3, $4::bigint, $5, $6::bigint, $7::timestamptz)",
        }
        self._texts = {name: text.encode() for name, text in self.statements.items()}
        # Text for every parameter but the token hash (bytea, sent as binary).
        self._formats = {CLAIM: [0, 0, 0, 1, 0, 0, 0], RENEW: [0, 0, 0, 0, 1, 0, 0, 0],
                         RELEASE: [0, 0, 0, 0, 1, 0, 0]}  # fmt: skip
        #: Pooler mode: the limits as SET LOCALs sent ahead of each call.
        self._local = limits.local_settings if pooler and limits is not None else None
        #: Seconds to wait for a call's answer (None: as long as the socket is open).
        self._deadline = limits.client_deadline if limits is not None else None

    def _bounded(self, conn: Any, name: bytes, values: Values) -> bytes:
        """Pooler mode: the call with its limits, as one query string of literals
        (escaped by libpq for this connection; the binary token hash as hex)."""
        escaping = pq.Escaping(conn.pgconn)
        formats = self._formats[name]
        literals = [
            b"NULL"
            if value is None
            else escaping.escape_literal(b"\\x" + value.hex().encode() if binary else value)
            for value, binary in zip(values, formats, strict=True)
        ]
        body = _PARAM.sub(lambda m: literals[int(m[1]) - 1], self._texts[name])
        assert self._local is not None
        return self._local + b"; " + body

    def prepare_on_connect(self, conn: psycopg.Connection[Any]) -> None:
        """Prepare the statements on a new connection (nothing in pooler mode);
        raises the driver's error, which makes the pool discard the connection."""
        if self.pooler:
            return
        for name, text in self._texts.items():
            conn.pgconn.send_prepare(name, text)
            self._check(conn, self._results(conn), pq.ExecStatus.COMMAND_OK)

    def _prepare(
        self, conn: psycopg.Connection[Any], until: float | None = None, why: str | None = None
    ) -> None:
        try:
            if self._setup is not None:
                conn.pgconn.send_query(self._setup)
                self._check(conn, self._results(conn, until, why), pq.ExecStatus.COMMAND_OK)
            for name, text in self.statements.items():
                conn.pgconn.send_prepare(name, text.encode())
                result = self._results(conn, until, why)
                if result.error_field(pq.DiagnosticField.SQLSTATE) != _ALREADY_PREPARED:
                    self._check(conn, result, pq.ExecStatus.COMMAND_OK)
        except psycopg.Error as exc:
            raise NotSentError(exc) from exc

    def _check(
        self,
        conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
        result: pq.abc.PGresult,
        expected: int,
    ) -> None:
        check_result(conn, result, expected, self._limits)

    def call(
        self,
        conn: psycopg.Connection[Any],
        name: bytes,
        values: Values,
        until: float | None = None,
        why: str | None = None,
    ) -> pq.abc.PGresult:
        """Run one call (`values` from `claim_values` and its siblings); return its
        result, whose one row holds the statement's columns as text.

        `until`: a `time.monotonic()` instant at which to give up waiting even
        before the connection's own deadline (`why` says what it is)."""
        formats = self._formats[name]
        if self._local is not None:
            self._send(conn.pgconn.send_query, self._bounded(conn, name, values))
            result = self._results(conn, until, why)
            self._check(conn, result, _TUPLES_OK)
            return result
        if self.pooler:
            self._send(conn.pgconn.send_query_params, self._texts[name], values, formats)
            result = self._results(conn, until, why)
            self._check(conn, result, _TUPLES_OK)
            return result
        self._send(conn.pgconn.send_query_prepared, name, values, formats)
        result = self._results(conn, until, why)
        if result.status != _TUPLES_OK:
            if result.error_field(pq.DiagnosticField.SQLSTATE) == _NO_SUCH_STATEMENT:
                # First use on this connection, or psycopg sent DEALLOCATE ALL after
                # a rollback (e.g. a failed mutate), which drops these statements too.
                self._prepare(conn, until, why)
                self._send(conn.pgconn.send_query_prepared, name, values, formats)
                result = self._results(conn, until, why)
            self._check(conn, result, _TUPLES_OK)
        return result

    @staticmethod
    def _send(send: Any, *args: Any) -> None:
        """Queue the query with libpq (`send` is one of its send_* methods)."""
        try:
            send(*args)
        except psycopg.Error as exc:
            raise NotSentError(exc) from exc  # libpq refused to queue it: never sent

    @staticmethod
    def _results(
        conn: psycopg.Connection[Any], until: float | None = None, why: str | None = None
    ) -> pq.abc.PGresult:
        """The last result of the query just sent (the error's, for a failed one),
        waited for through psycopg: a store connection bounds the wait by its
        deadline (`StoreConnection`), `until` bounds it further. libpq's own
        blocking calls would wait for as long as the socket stays open."""
        timeout = _left(until)
        try:
            results: list[pq.abc.PGresult] = conn.wait(
                generators.execute(conn.pgconn), timeout=timeout
            )
        except psycopg.errors._WaitTimeout:
            assert timeout is not None
            raise stalled(conn, timeout, why) from None
        return results[-1]


def _left(until: float | None) -> float | None:
    """Seconds from now to `until` (a `time.monotonic()` instant), never below 1 ms."""
    if until is None:
        return None
    return max(until - time.monotonic(), 0.001)


class AsyncFastPath(FastPath):
    """The same prepared calls on an `AsyncConnection`, without blocking the loop:
    libpq's non-blocking send, then `results_async` (which also cancels the
    query server-side when the task is interrupted, as psycopg's wait does)."""

    async def _exec_async(
        self,
        conn: psycopg.AsyncConnection[Any],
        name: bytes,
        values: list[Any],
        formats: list[int],
        until: float | None,
        why: str | None,
    ) -> pq.abc.PGresult:
        try:
            if self._local is not None:
                conn.pgconn.send_query(self._bounded(conn, name, values))
            elif self.pooler:
                conn.pgconn.send_query_params(self._texts[name], values, param_formats=formats)
            else:
                conn.pgconn.send_query_prepared(name, values, formats)
        except psycopg.Error as exc:
            raise NotSentError(exc) from exc  # libpq refused to queue it: never sent
        timeout = self._deadline
        if (left := _left(until)) is not None and (timeout is None or left < timeout):
            timeout = left
        else:
            why = None  # the client deadline is the nearer bound
        return (await results_async(conn, timeout, why))[-1]

    async def prepare_on_connect_async(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Asyncio twin of `FastPath.prepare_on_connect`."""
        if self.pooler:
            return
        for name, text in self._texts.items():
            conn.pgconn.send_prepare(name, text)
            result = (await conn.wait(generators.execute(conn.pgconn)))[-1]
            self._check(conn, result, pq.ExecStatus.COMMAND_OK)

    async def _prepare_async(
        self, conn: psycopg.AsyncConnection[Any], until: float | None = None, why: str | None = None
    ) -> None:
        unwatch(conn)  # psycopg's waits below register the socket themselves
        try:
            if self._setup is not None:
                conn.pgconn.send_query(self._setup)
                result = (await self._wait_async(conn, until, why))[-1]
                self._check(conn, result, pq.ExecStatus.COMMAND_OK)
            for name, text in self.statements.items():
                conn.pgconn.send_prepare(name, text.encode())
                result = (await self._wait_async(conn, until, why))[-1]
                if result.error_field(pq.DiagnosticField.SQLSTATE) != _ALREADY_PREPARED:
                    self._check(conn, result, pq.ExecStatus.COMMAND_OK)
        except psycopg.Error as exc:
            raise NotSentError(exc) from exc

    @staticmethod
    async def _wait_async(
        conn: psycopg.AsyncConnection[Any], until: float | None, why: str | None
    ) -> list[pq.abc.PGresult]:
        timeout = _left(until)
        try:
            results: list[pq.abc.PGresult] = await conn.wait(
                generators.execute(conn.pgconn), timeout=timeout
            )
        except psycopg.errors._WaitTimeout:
            assert timeout is not None
            raise stalled(conn, timeout, why) from None
        return results

    async def call_async(
        self,
        conn: psycopg.AsyncConnection[Any],
        name: bytes,
        values: Values,
        until: float | None = None,
        why: str | None = None,
    ) -> pq.abc.PGresult:
        """Asyncio twin of `FastPath.call`."""
        formats = self._formats[name]
        result = await self._exec_async(conn, name, values, formats, until, why)
        if result.status != _TUPLES_OK:
            if (
                not self.pooler
                and result.error_field(pq.DiagnosticField.SQLSTATE) == _NO_SUCH_STATEMENT
            ):
                await self._prepare_async(conn, until, why)
                result = await self._exec_async(conn, name, values, formats, until, why)
            self._check(conn, result, _TUPLES_OK)
        return result


async def results_async(
    conn: psycopg.AsyncConnection[Any], timeout: float | None = None, why: str | None = None
) -> list[pq.abc.PGresult]:
    """Every result of the query just sent on `conn`, read without blocking the loop.

    What ``await conn.wait(generators.execute(conn.pgconn))`` does, made cheaper
    for the hot path's case (the query fits the socket buffer, its results come
    back in one or a few reads): psycopg's wait also arms and cancels a 0.1 s
    timer and polls the socket for writing on every call, and drives a generator
    per wake-up; and the socket stays registered with the loop between calls
    (`_Watch`) instead of being added and removed for each. On the loop's own
    thread that CPU is taken from the other tasks (bench/RESULTS.md). A query
    that does not fit goes psycopg's general way. Interrupted (the task
    cancelled), the query is cancelled on the server as psycopg's wait does
    (`_interrupted`). No answer within `timeout` seconds: the connection is
    closed and `StalledError` raised (`why`: what the timeout is, when not
    the client deadline).
    """
    pgconn = conn.pgconn
    if pgconn.flush() != 0:  # the socket buffer was full: let psycopg send the rest
        unwatch(conn)  # psycopg's wait registers the socket itself
        try:
            results: list[pq.abc.PGresult] = await conn.wait(
                generators.execute(pgconn), timeout=timeout
            )
        except psycopg.errors._WaitTimeout:
            assert timeout is not None
            raise stalled(conn, timeout, why) from None
        return results
    results = []
    watch = None
    deadline = None
    try:
        while True:
            if pgconn.is_busy():
                if watch is None:
                    watch = _watch(conn)
                    if timeout is not None:
                        deadline = watch.loop.time() + timeout
                try:
                    await watch.complete(deadline)
                except psycopg.DatabaseError:
                    # As psycopg: an error already read (a FATAL) is what the
                    # caller reports; the lost connection comes after it.
                    if any(r.status == _FATAL_ERROR for r in results):
                        unwatch(conn)
                        return results
                    raise
            if (result := pgconn.get_result()) is None:
                if pgconn.status != _OK:
                    unwatch(conn)
                return results
            results.append(result)
    except _INTERRUPTED:
        unwatch(conn)
        await _interrupted(conn)
        raise
    except _Expired:
        unwatch(conn)
        assert timeout is not None
        raise stalled(conn, timeout, why) from None
    except OSError as exc:  # the socket went away under the event loop
        unwatch(conn)
        raise psycopg.OperationalError("connection socket closed") from exc
    except BaseException:
        # libpq closes the socket of a connection it finds lost: the loop must
        # forget it first, or a new socket given the same number is never seen.
        unwatch(conn)
        raise


class _Watch:
    """A store connection's socket, registered with the event loop for reading
    while the connection is on the fast path or idle in the store's stack.

    Adding and removing a reader costs about 6 us a call (the selector's Python
    bookkeeping and two epoll_ctl calls); kept registered, a call only sets the
    future it waits on. The loop's callback reads what arrived into libpq
    itself (`consume_input`) and wakes the call only once a whole result is
    there: read at once, the socket is not reported again on the next turn
    (the loop polls before it runs the woken call), so no report is ever
    stale and none needs a check. Readable with no call waiting means the
    server is hanging up (an idle store connection is sent nothing else): the
    watch then ends, since the report would come again on every turn, and
    `alive` finds the connection dead before its next use. Whoever uses the
    connection otherwise (psycopg's own waits, the pool) must call `unwatch`
    first: psycopg's wait replaces and then removes the reader.
    """

    __slots__ = ("conn", "fd", "loop", "waiter")

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.fd = conn.pgconn.socket
        self.waiter: asyncio.Future[None] | None = None
        self.loop.add_reader(self.fd, self._wake)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is None:
            unwatch(self.conn)
            return
        if waiter.done():
            return  # interrupted: its task unwatches and cancels the query
        pgconn = self.conn.pgconn
        try:
            pgconn.consume_input()
        except psycopg.Error as exc:  # the connection is lost: the call reports it
            unwatch(self.conn)
            waiter.set_exception(exc)
            return
        if not pgconn.is_busy():
            waiter.set_result(None)

    async def complete(self, deadline: float | None = None) -> None:
        """Wait until libpq has a whole result (`pgconn.is_busy()` is false); raise
        `_Expired` at `deadline` (the loop's time) if it has not come by then."""
        waiter = self.waiter = self.loop.create_future()
        timer = None if deadline is None else self.loop.call_at(deadline, _expire, waiter)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        self.loop.remove_reader(self.fd)  # a no-op once the loop is closed


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(_Expired())


#: The connections whose socket is registered: at most one `_Watch` each. A
#: plain dict: a watch holds its connection anyway, so weak keys would never
#: expire, and every path that lets a connection go calls `unwatch` first.
_watches: dict[psycopg.AsyncConnection[Any], _Watch] = {}


def _watch(conn: psycopg.AsyncConnection[Any]) -> _Watch:
    watch = _watches.get(conn)
    # A connection outlives a loop only if the loop ended (closed): checking that
    # is a flag read, where asking for the running loop costs a getpid() call.
    if watch is not None and not watch.loop.is_closed():
        return watch
    unwatch(conn)  # registered with an ended loop, or not at all
    watch = _watches[conn] = _Watch(conn)
    return watch


def unwatch(conn: psycopg.AsyncConnection[Any]) -> None:
    """Stop watching `conn`'s socket (if it was): before anything but the fast path
    uses the connection, and before it goes back to its pool or is closed."""
    watch = _watches.pop(conn, None)
    if watch is not None:
        watch.close()


async def _interrupted(conn: psycopg.AsyncConnection[Any]) -> None:
    """A query interrupted in flight: cancel it on the server and read its end, as
    psycopg's own wait does, so the connection can be reused; if that fails or
    takes over 5 s, close the connection, whose state is then unknown. The
    interruption itself propagates (the caller re-raises it)."""
    if conn.pgconn.transaction_status != _ACTIVE:
        return
    try:
        await conn.cancel_safe(timeout=5.0)
        await conn.wait(generators.fetch_many(conn.pgconn), timeout=5.0)
    except BaseException:  # a second interruption, or the cancel failed: the
        conn.pgconn.finish()  # connection is dropped; the first interruption wins


def check_result(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    result: pq.abc.PGresult,
    expected: int,
    limits: _core.Limits | None = None,
) -> None:
    """Raise for a failed result: pglease's own error class where there is one,
    else the driver's error (OperationalError when the connection broke)."""
    if result.status == expected:
        return
    if conn.pgconn.status == pq.ConnStatus.BAD:
        # The pool sees the broken connection on return and replaces it.
        raise psycopg.OperationalError(
            (conn.pgconn.error_message or b"connection lost").decode(errors="replace").strip()
        )
    exc = error_from_result(result, encoding=conn.info.encoding)
    raise _core.translate(exc, limits) or exc from None
