"""The listen protocol on PostgreSQL (`pglease.driver.listen`): the hub's
listener and a store's log reader, on a real server, errors included."""

from __future__ import annotations

import socket
import time

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pglease import Owner, PostgresStore
from pglease.cursors import START, Cursor, Position, encode_cursor
from pglease.driver.listen_ops import ListenRequest, LogReadError, PageOp
from pglease.errors import CursorAheadError, ValidationError, WatchClosedError
from pglease.postgres._listen import PgChangeListener
from pglease.watch._core import END, PAGE, channel_name

A = Owner("host", "a")


def _request(
    store: PostgresStore, *, listen: bool = True, schema: str | None = None
) -> ListenRequest:
    return ListenRequest(store.dsn, schema or store.schema, listen=listen, pooler=False)


def _notify(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, '')", [channel_name(schema)])


def _closed_port_dsn(dsn: str) -> str:
    """`dsn` aimed at a local port nobody listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(port), connect_timeout="5")
    return make_conninfo(**params)


def test_listener_reads_pages_and_wakes_on_notify(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "listened")
    listener = pg_store.log_reader().listener(_request(pg_store))
    assert listener.session_id() is None
    listener.open()
    try:
        assert listener.session_id() is not None
        tip = listener.frontier()
        claim = pg_store.claim(rid, A, 30)
        assert claim is not None
        assert listener.wait(30.0)  # its writer notified (a bound, not a speed claim)
        page = listener.read_log(PageOp(tip, END, PAGE))
        assert [(e.type, e.revision) for e in page.events] == [("lease.claimed", 1)]
        assert page.positions[0] > tip and not page.full
        # Nothing new: a wait returns False within its bound.
        assert not listener.wait(0.2)
        # A page of one reads one event and says it is full.
        pg_store.release(claim)
        assert listener.wait(30.0)
        one = listener.read_log(PageOp(tip, END, 1))
        assert one.full and [e.revision for e in one.events] == [1]
    finally:
        listener.close()
    assert listener.session_id() is None
    listener.close()  # twice: harmless


def test_unlisten_stops_the_wake_ups_until_listening_again(pg_store: PostgresStore) -> None:
    listener = pg_store.log_reader().listener(_request(pg_store))
    listener.open()
    try:
        listener.set_listening(False)
        _notify(pg_store.dsn, pg_store.schema)
        assert not listener.wait(0.3)
        listener.set_listening(True)
        _notify(pg_store.dsn, pg_store.schema)
        assert listener.wait(30.0)
    finally:
        listener.close()


def test_a_missing_schema_cannot_heal(pg_store: PostgresStore) -> None:
    listener = PgChangeListener(_request(pg_store, schema="no_such_schema_here"))
    with pytest.raises(LogReadError) as info:
        listener.open()
    assert info.value.permanent
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert info.value.__cause__.sqlstate == "3F000"
    assert listener.session_id() is None  # nothing stays open


def test_a_server_away_may_heal(pg_store: PostgresStore) -> None:
    listener = PgChangeListener(
        ListenRequest(_closed_port_dsn(pg_store.dsn), pg_store.schema, listen=True, pooler=False)
    )
    with pytest.raises(LogReadError) as info:
        listener.open()
    assert not info.value.permanent
    assert isinstance(info.value.__cause__, psycopg.OperationalError)


def test_a_lost_connection_is_a_log_read_error(pg_store: PostgresStore) -> None:
    listener = pg_store.log_reader().listener(_request(pg_store))
    listener.open()
    try:
        pid = listener.session_id()
        with psycopg.connect(pg_store.dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        with pytest.raises(LogReadError) as info:
            # The server hung up: the next read (or wait) fails; retrying can heal.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                listener.read_log(PageOp(START, END, PAGE))
                listener.wait(0.05)
        assert not info.value.permanent
    finally:
        listener.close()


def test_unopened_listener_and_pooler_listen_are_refused(pg_store: PostgresStore) -> None:
    listener = PgChangeListener(_request(pg_store))
    with pytest.raises(LogReadError, match="not open"):
        listener.read_log(PageOp(START, END, PAGE))
    with pytest.raises(LogReadError, match="not open"):
        listener.wait(0.01)
    with pytest.raises(ValidationError, match="pooler"):
        PgChangeListener(ListenRequest(pg_store.dsn, pg_store.schema, listen=True, pooler=True))


def test_pooler_listener_polls_with_unnamed_reads(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "polled")
    listener = PgChangeListener(
        ListenRequest(pg_store.dsn, pg_store.schema, listen=False, pooler=True)
    )
    listener.open()
    try:
        tip = listener.frontier()
        pg_store.claim(rid, A, 30)
        got: list[int] = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = [e.revision for e in listener.read_log(PageOp(tip, END, PAGE)).events]
        assert got == [1]
    finally:
        listener.close()


def test_check_position_refuses_a_position_this_log_never_had(pg_store: PostgresStore) -> None:
    listener = pg_store.log_reader().listener(_request(pg_store))
    listener.open()
    try:
        ahead = Position(2**40, 1)
        with pytest.raises(CursorAheadError):
            listener.check_position(Cursor(ahead, None, encode_cursor(ahead, None)))
        listener.check_position(Cursor(START, None, encode_cursor(START, None)))
    finally:
        listener.close()


def test_log_reader_starts_reads_and_reports_a_closed_store(pg_dsn: str, schema: str) -> None:
    store = PostgresStore(pg_dsn, schema=schema)
    reader = store.log_reader()
    try:
        assert reader.source == store.dsn and reader.schema == schema and not reader.pooler
        now = reader.start(None)
        rid = store.ensure_resource("run", "read")
        store.claim(rid, A, 30)
        page = reader.read_log(PageOp(now.position, END, PAGE))
        assert [e.type for e in page.events] == ["lease.claimed"]
        ahead = Position(2**40, 1)
        with pytest.raises(CursorAheadError):
            reader.start(Cursor(ahead, None, encode_cursor(ahead, None)))
    finally:
        store.close()
    with pytest.raises(WatchClosedError):
        reader.read_log(PageOp(now.position, END, PAGE))
