# Generated from pglease/_compat_async.py by tools/async_to_sync.py: do not edit.
"""What differs between an asyncio module and its generated blocking twin, one name each.

`tools/async_to_sync.py` maps this module to `pglease._compat`, so source code
written against these names needs no sync-line marker where only the
flavour differs: a worker thread here is a direct call there, an asyncio task a
daemon thread, an asyncio lock a reentrant thread lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

# One task at a time runs between two awaits, so only the twin's threads need
# this lock around state a callback may touch too.
Lock = threading.RLock
Event = threading.Event


def thread_lock() -> contextlib.AbstractContextManager[Any]:
    """A lock against other threads: the twin's `threading.Lock`, nothing on one event loop."""
    return threading.Lock()


def to_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` off the event loop (a blocking call, say SQLite);
    a direct call in the twin."""
    return fn(*args, **kwargs)


def sleep(seconds: float) -> None:
    """Pause this task (the twin: this thread) for `seconds` real seconds."""
    time.sleep(seconds)


def fetched_in_thread(
    fetch: Callable[[], list[T]],
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
    return _fetched(fetch, wait, stalled)


def _fetched(
    fetch: Callable[[], list[T]],
    wait: float,
    stalled: Callable[[], Exception],
) -> Iterator[T]:
    while True:
        rows = fetch()
        if not rows:
            return
        yield from rows


class Background:
    """A loop beside the caller: an asyncio task (a daemon thread in the twin).

    `target(background)` runs until it returns; it sleeps through `pause`,
    which ends early once `stop()` is called.
    """

    def __init__(self, target: Callable[[Background], None], name: str) -> None:
        self._stopped = Event()
        self._thread = threading.Thread(target=target, args=(self,), name=name, daemon=True)
        self._thread.start()

    def pause(self, seconds: float) -> bool:
        """Wait `seconds`, or less once stopped; True when stopped."""
        self._stopped.wait(seconds)
        return self._stopped.is_set()

    def stop(self) -> None:
        """Ask the loop to end at its next `pause`."""
        self._stopped.set()

    def join(self) -> None:
        """Stop the loop and wait until it has ended (unless called from the loop itself)."""
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join()
