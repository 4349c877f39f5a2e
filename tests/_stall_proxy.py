"""A fault-injecting TCP proxy in front of the test server (issue 31).

`StallProxy` listens on 127.0.0.1 (an ephemeral port) and forwards each
connection to the server behind a DSN (TCP, or the server's unix socket). It
runs its own asyncio loop in a background thread, so blocking tests and
asyncio tests drive it the same way. No root, no iptables. Faults:

* `pause()`: no byte is forwarded either way, every socket stays open, and
  connections accepted meanwhile pause too: a network path gone dark, or a
  hung server. `resume()` lets the held bytes through.
* `reset()`: close every open connection (both sides).
* `refuse()`: stop listening, so a new connection is refused (the server is
  down); `accept()` listens on the same port again (the server is back).
* `hold_replies_after(marker)`: the next request whose bytes contain `marker`
  goes through, but nothing more comes back on its connection until
  `release_replies()`: the server did the work, the answer is late (a claim
  granted on the server whose answer is delayed by the path).

Unlike `FreezingProxy` (tests/_fleet_proxy.py), whose frozen connections stay
frozen for good while new ones work, a pause is undone by `resume()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from psycopg.conninfo import make_conninfo

from ._fleet_proxy import _target

T = TypeVar("T")


class StallProxy:
    """``with StallProxy(dsn) as proxy:`` connect to ``proxy.dsn``; inject faults."""

    def __init__(self, dsn: str) -> None:
        self._family, self._address = _target(dsn)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event = self._call(self._new_event())
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: `hold_replies_after`'s armed marker, and the reply gates it closed.
        self._marker: bytes | None = None
        self._held: list[asyncio.Event] = []
        self.port = 0
        self._call(self._listen())
        self.dsn = make_conninfo(dsn, host="127.0.0.1", port=str(self.port), hostaddr="127.0.0.1")

    def __enter__(self) -> StallProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ faults

    def pause(self) -> None:
        """Stop forwarding in both directions; keep every socket open. In force
        when this returns: bytes sent after it are held."""
        self._call(self._switch(False))

    def resume(self) -> None:
        """Forward again, the bytes held during the pause first."""
        self._call(self._switch(True))

    def reset(self) -> int:
        """Close every open connection, both sides; return how many there were."""
        return self._call(self._reset())

    def refuse(self) -> None:
        """Stop listening: new connections are refused (open ones are kept)."""
        self._call(self._unlisten())

    def accept(self) -> None:
        """Listen again, on the same port."""
        self._call(self._listen())

    def hold_replies_after(self, marker: bytes) -> None:
        """Let the next request containing `marker` through, then hold every byte
        its connection's server sends back until `release_replies()`."""
        self._call(self._arm(marker))

    def release_replies(self) -> None:
        """Let the held replies through (and disarm a marker not seen yet)."""
        self._call(self._release())

    @property
    def replies_held(self) -> int:
        """How many connections have their replies held right now."""
        return self._call(self._held_count())

    @property
    def connections(self) -> int:
        """How many client connections are open through the proxy."""
        return self._call(self._count())

    def close(self) -> None:
        """Refuse, reset, and stop the proxy's loop."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            self._call(self._unlisten())
            self._call(self._reset())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    # ---------------------------------------------------------------- the loop

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _new_event(self) -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _switch(self, flowing: bool) -> None:
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _count(self) -> int:
        return len(self._writers) // 2

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _unlisten(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            # Connections already accepted are not the listener's to wait for.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 0.5)

    async def _arm(self, marker: bytes) -> None:
        self._marker = marker

    async def _release(self) -> None:
        self._marker = None
        held, self._held = self._held, []
        for gate in held:
            gate.set()

    async def _held_count(self) -> int:
        return len(self._held)

    async def _reset(self) -> int:
        count = len(self._writers) // 2
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._writers):
            self._abort(writer)
        self._writers.clear()
        return count

    @staticmethod
    def _abort(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._family == socket.AF_UNIX:
                up_reader, up_writer = await asyncio.open_unix_connection(self._address)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self._address)
        except OSError:
            self._abort(writer)
            return
        self._writers.update((writer, up_writer))
        replies = asyncio.Event()  # closed by `hold_replies_after`'s marker
        replies.set()
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer, watch=replies)),
            asyncio.ensure_future(self._pump(up_reader, writer, gate=replies)),
        ]
        self._tasks.update(pumps)
        try:
            # Either side hanging up ends the connection on both.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
                self._tasks.discard(pump)
            for side in (writer, up_writer):
                self._abort(side)
                self._writers.discard(side)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        watch: asyncio.Event | None = None,
        gate: asyncio.Event | None = None,
    ) -> None:
        """Forward one direction. `watch` (client to server): the reply gate this
        direction closes when it carries the armed marker; `gate` (server to
        client): wait for it to be open before forwarding a chunk."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                # Paused: hold this chunk and read no more, so the kernel's
                # buffers fill and the sender sees a silent peer.
                await self._flowing.wait()
                if watch is not None and self._marker is not None and self._marker in data:
                    self._marker = None  # one request only
                    watch.clear()
                    self._held.append(watch)
                if gate is not None:
                    await gate.wait()
                writer.write(data)
                await writer.drain()
