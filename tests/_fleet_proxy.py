"""A TCP proxy in front of the test server that can freeze its open connections.

A frozen connection stays open and its bytes are acknowledged by the kernel,
but nothing is forwarded either way: to the client it looks like a server
that hung or a network path that went dark mid-statement. Connections opened
after the freeze work normally, so a client that gives up on a frozen one and
reconnects recovers.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo


def _target(dsn: str) -> tuple[int, Any]:
    info = conninfo_to_dict(dsn)
    host = str(info.get("host") or "/tmp").split(",")[0]
    port = int(str(info.get("port") or 5432).split(",")[0])
    if host.startswith("/"):
        return socket.AF_UNIX, f"{host}/.s.PGSQL.{port}"
    return socket.AF_INET, (host, port)


class FreezingProxy:
    """``with FreezingProxy(dsn) as proxy:`` connect to ``proxy.dsn``; call `freeze()`."""

    def __init__(self, dsn: str) -> None:
        self._family, self._address = _target(dsn)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        self.dsn = make_conninfo(dsn, host="127.0.0.1", port=str(port), hostaddr="127.0.0.1")
        self._lock = threading.Lock()
        self._pipes: list[_Pipe] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def __enter__(self) -> FreezingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def freeze(self) -> int:
        """Freeze every connection open now; return how many."""
        with self._lock:
            for pipe in self._pipes:
                pipe.frozen.set()
            return len(self._pipes)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for pipe in self._pipes:
                pipe.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket(self._family, socket.SOCK_STREAM)
            upstream.connect(self._address)
            pipe = _Pipe(client, upstream)
            with self._lock:
                self._pipes.append(pipe)
            threading.Thread(target=pipe.run, daemon=True).start()


class _Pipe:
    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.a, self.b = a, b
        self.frozen = threading.Event()
        self.done = threading.Event()
        self.closed = False

    def run(self) -> None:
        peers = {self.a: self.b, self.b: self.a}
        try:
            while not self.closed:
                if self.frozen.is_set():
                    # Read nothing, forward nothing, close nothing.
                    self.done.wait()
                    return
                readable, _, _ = select.select(list(peers), [], [], 0.05)
                for sock in readable:
                    if self.frozen.is_set():
                        break
                    data = sock.recv(65536)
                    if not data:
                        self.close()
                        return
                    peers[sock].sendall(data)
        except OSError:
            self.close()

    def close(self) -> None:
        self.closed = True
        self.done.set()
        for sock in (self.a, self.b):
            with contextlib.suppress(OSError):
                sock.close()
