"""What differs between an asyncio module and its generated blocking twin, one name each.

`tools/async_to_sync.py` maps this module to `pglease._compat`, so source code
written against these names needs no sync-line marker where only the
flavour differs: a worker thread here is a direct call there, an asyncio task a
daemon thread, an asyncio lock a reentrant thread lock.
"""

from __future__ import annotations

import asyncio  # sync: import threading
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

# sync: import time

T = TypeVar("T")

# One task at a time runs between two awaits, so only the twin's threads need
# this lock around state a callback may touch too.
Lock = asyncio.Lock  # sync: Lock = threading.RLock
Event = asyncio.Event  # sync: Event = threading.Event


def thread_lock() -> contextlib.AbstractContextManager[Any]:
    """A lock against other threads: the twin's `threading.Lock`, nothing on one event loop."""
    return contextlib.nullcontext()  # sync: return threading.Lock()


async def to_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` off the event loop (a blocking call, say SQLite);
    a direct call in the twin."""
    return await asyncio.to_thread(fn, *args, **kwargs)  # sync: return fn(*args, **kwargs)


async def sleep(seconds: float) -> None:
    """Pause this task (the twin: this thread) for `seconds` real seconds."""
    await asyncio.sleep(seconds)  # sync: time.sleep(seconds)


def fetched_in_thread(
    fetch: Callable[[], Awaitable[list[T]]],
    *,
    wait: float,
    stalled: Callable[[], Exception],
) -> Iterator[T]:
    """The items of successive `fetch()` batches, until an empty one.

    Made for a consumer in a worker thread (`to_thread`) reading a cursor of
    this event loop: each fetch runs on the loop, which is free while it
    awaits the thread; one taking over `wait` seconds raises `stalled()`. In
    the twin the consumer runs in the caller's thread and fetches directly
    (the driver's own time limits bound a fetch there)."""
    loop = asyncio.get_running_loop()  # sync: -
    return _fetched(fetch, loop, wait, stalled)  # sync: return _fetched(fetch, wait, stalled)


def _fetched(
    fetch: Callable[[], Awaitable[list[T]]],
    loop: asyncio.AbstractEventLoop,  # sync: -
    wait: float,
    stalled: Callable[[], Exception],
) -> Iterator[T]:
    # async-only: begin
    async def one() -> list[T]:
        return await fetch()

    # async-only: end
    while True:
        # async-only: begin
        future = asyncio.run_coroutine_threadsafe(one(), loop)
        try:
            rows = future.result(wait)
        except TimeoutError:
            future.cancel()
            raise stalled() from None
        # async-only: end
        # sync: rows = fetch()
        if not rows:
            return
        yield from rows


class Background:
    """A loop beside the caller: an asyncio task (a daemon thread in the twin).

    `target(background)` runs until it returns; it sleeps through `pause`,
    which ends early once `stop()` is called.
    """

    def __init__(self, target: Callable[[Background], Awaitable[None]], name: str) -> None:
        self._stopped = Event()
        # async-only: begin
        async def run() -> None:
            await target(self)

        self._task = asyncio.get_running_loop().create_task(run(), name=name)
        # async-only: end
        # sync: self._thread = threading.Thread(target=target, args=(self,), name=name, daemon=True)
        # sync: self._thread.start()

    async def pause(self, seconds: float) -> bool:
        """Wait `seconds`, or less once stopped; True when stopped."""
        # async-only: begin
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), seconds)
        # async-only: end
        # sync: self._stopped.wait(seconds)
        return self._stopped.is_set()

    def stop(self) -> None:
        """Ask the loop to end at its next `pause`."""
        self._stopped.set()

    async def join(self) -> None:
        """Stop the loop and wait until it has ended (unless called from the loop itself)."""
        self.stop()
        # async-only: begin
        if self._task is not asyncio.current_task():
            await self._task
        # async-only: end
        # sync: if self._thread is not threading.current_thread():
            # sync: self._thread.join()
