"""One blocking face for every backend's watcher, so that one suite runs on all.

A blocking backend's watcher is used as it is. An asyncio backend's watcher is
made by its store, started and driven on the backend's private event loop
(`backends.LoopThread`), each call waiting for its coroutine: the asyncio
watcher runs the same test bodies as the blocking one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from pglease import Owner, Permit
from pglease.types import Event

from ..backends import Backend, LoopThread

#: Bound on every wait: generous, since the host may be busy.
DEADLINE = 60.0
A = Owner("host", "a")


class AsyncWatcherBridge:
    """An asyncio watcher behind the blocking watcher's methods."""

    def __init__(self, watcher: Any, loop: LoopThread) -> None:
        self._w = watcher
        self._loop = loop

    async def _start(self) -> None:
        await self._w.start()

    def start(self) -> AsyncWatcherBridge:
        self._loop.run(self._start())
        return self

    def get(self, timeout: float | None = None) -> Event | None:
        return self._loop.run(self._w.get(timeout))  # type: ignore[no-any-return]

    def get_batch(self, timeout: float | None = None, max_events: int = 10_000) -> list[Event]:
        return self._loop.run(self._w.get_batch(timeout, max_events))  # type: ignore[no-any-return]

    def close(self) -> None:
        self._loop.run(self._w.aclose())

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        try:
            return self._loop.run(self._w.__anext__())  # type: ignore[no-any-return]
        except StopAsyncIteration:
            raise StopIteration from None

    def __enter__(self) -> AsyncWatcherBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def cursor(self) -> str:
        return self._w.cursor  # type: ignore[no-any-return]

    @property
    def health(self) -> Any:
        return self._w.health

    @property
    def overflows(self) -> int:
        return self._w.overflows  # type: ignore[no-any-return]

    @property
    def flavour(self) -> Any:
        """The watcher itself (its type, say)."""
        return self._w


def watcher(backend: Backend, **kwargs: Any) -> Any:
    """A started watcher on `backend` (its store's `watch(**kwargs)`), blocking face."""
    if not backend.is_async:
        return backend.store.watch(**kwargs)
    loop: LoopThread = backend._loop  # type: ignore[attr-defined]
    made = backend.store._store.watch(**kwargs)
    return AsyncWatcherBridge(made, loop).start()


def log_of(backend: Backend) -> list[Event]:
    """Every event of the store, in log order."""
    out: list[Event] = []
    while page := backend.store.events_after(out[-1].cursor if out else None, 1000):
        out += page
    return out


def write(backend: Backend, rid: str, n: int, what: str = "run.step") -> None:
    """`n` unleased writes on `rid`, one event each."""
    for _ in range(n):
        revision = backend.store.get(rid).revision
        backend.store.mutate(Permit(rid, revision), what)


def cycles(backend: Backend, rids: list[str], n: int) -> None:
    """`n` claim + release cycles (two events each) over `rids` in turn."""
    for i in range(n):
        claim = backend.store.claim(rids[i % len(rids)], A, 5)
        assert claim is not None
        backend.store.release(claim)


def drain(w: Any, n: int, timeout: float = DEADLINE) -> list[Event]:
    """Take events until `n` arrived or `timeout` seconds passed (then fewer)."""
    out: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        got = w.get_batch(max(0.0, deadline - time.monotonic()), n - len(out))
        if not got:
            break
        out += got
    return out


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
