"""Live when the network stalls (issue 31): a store behind a fault-injecting
proxy (tests/_stall_proxy.py) fails fast while the server is unreachable and
is back as soon as the server is."""

from __future__ import annotations

import threading

import psycopg
import pytest

from ._stall_proxy import StallProxy


def test_the_proxy_pauses_resets_and_refuses(stall_proxy: StallProxy) -> None:
    with psycopg.connect(stall_proxy.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert stall_proxy.connections == 1
        stall_proxy.pause()
        answer: list[object] = []
        reader = threading.Thread(target=lambda: answer.append(conn.execute("SELECT 2").fetchone()))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not answer  # held by the pause, socket open
        stall_proxy.resume()
        reader.join(30)
        assert answer == [(2,)]
        assert stall_proxy.reset() == 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 3")
    stall_proxy.refuse()
    with pytest.raises(psycopg.OperationalError, match="refused"):
        psycopg.connect(stall_proxy.dsn, connect_timeout=5)
    stall_proxy.accept()
    with psycopg.connect(stall_proxy.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 4").fetchone() == (4,)
