"""Run the blocking session tests on the asyncio flavour as well.

`Blocking` is a blocking view of an asyncio object (a store, a session
repository, a handle): each coroutine method runs on an event loop in a
thread of its own (`LoopThread`) and returns its result, or raises its
exception; asyncio objects it returns come back as views too. Nothing is
faked: the real asyncio code runs against the real server, only the caller
waits for it (each call bounded by `CALL_WAIT`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from pglease import AsyncPostgresStore, PostgresStore
from pglease.runtime import AsyncKeeper
from pglease.sessions import (
    AsyncPostgresSession,
    AsyncPostgresSessionRepository,
    AsyncSessionRepository,
    AsyncSqliteSession,
    PostgresSession,
    PostgresSessionRepository,
)

T = TypeVar("T")

#: Generous: a loaded 2-core machine, and some calls wait for a lease on purpose.
CALL_WAIT = 120.0
FLAVOURS = ["sync", "async"]


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="test-event-loop", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (bounded)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking view was called on its own event loop (a callback?)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_WAIT)

    def task_names(self) -> list[str]:
        async def names() -> list[str]:
            return [t.get_name() for t in asyncio.all_tasks() if not t.done()]

        return self.run(names())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_WAIT)
        self.loop.close()


_WRAPPED = (
    AsyncPostgresStore,
    AsyncPostgresSessionRepository,
    AsyncPostgresSession,
    AsyncSessionRepository,
    AsyncSqliteSession,
)


class Blocking:
    """A blocking view of an asyncio object (see the module docstring)."""

    def __init__(self, target: Any, loop: LoopThread) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_loop", loop)

    def _wrap(self, value: Any) -> Any:
        return Blocking(value, self._loop) if isinstance(value, _WRAPPED) else value

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return self._wrap(value)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            if inspect.iscoroutine(result):
                result = self._loop.run(result)
            return self._wrap(result)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __enter__(self) -> Blocking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Blocking {self._target!r}>"


def unwrap(value: Any) -> Any:
    """The asyncio object behind a view (anything else as it is)."""
    return value._target if isinstance(value, Blocking) else value


class Flavour:
    """PostgreSQL sessions of one flavour, as blocking objects for the tests.

    `store()` opens a store on the test's schema, `repo()` a session
    repository (on the test's default store unless given one); everything is
    closed at the end of the test. `renewers()` names the live heartbeats.
    """

    def __init__(self, name: str, dsn: str, schema: str, default: PostgresStore) -> None:
        self.name = name
        self.dsn = dsn
        self.schema = schema
        self.loop = LoopThread() if name == "async" else None
        self._stores: list[Any] = []
        self.default = default if self.loop is None else self.store(max_size=8)

    @property
    def is_async(self) -> bool:
        return self.loop is not None

    def store(self, dsn: str | None = None, **options: Any) -> Any:
        """A new open store on the test's schema (closed at teardown); `dsn`
        overrides the server's (a proxy in front of it)."""
        dsn = self.dsn if dsn is None else dsn
        if self.loop is None:
            store: Any = PostgresStore(dsn, schema=self.schema, **options)
        else:
            loop = self.loop

            async def open_store() -> AsyncPostgresStore:
                return await AsyncPostgresStore.open(dsn, schema=self.schema, **options)

            store = Blocking(loop.run(open_store()), loop)
        self._stores.append(store)
        return store

    def repo(self, store: Any = None, **options: Any) -> Any:
        """A session repository of this flavour."""
        store = self.default if store is None else store
        if self.loop is None:
            return PostgresSessionRepository(store, **options)
        loop = self.loop

        async def make() -> AsyncPostgresSessionRepository:
            return AsyncPostgresSessionRepository(unwrap(store), **options)

        return Blocking(loop.run(make()), loop)

    def is_session(self, handle: Any) -> bool:
        kind = AsyncPostgresSession if self.is_async else PostgresSession
        return isinstance(unwrap(handle), kind)

    def renewers(self) -> list[str]:
        """Names of per-handle session renewers still running (threads or tasks): file
        sessions have them; PostgreSQL sessions are renewed by the store's keeper."""
        names = (
            [t.name for t in threading.enumerate()] if self.loop is None else self.loop.task_names()
        )
        return [n for n in names if n.startswith("pglease-session-renew")]

    def close(self) -> None:
        for store in reversed(self._stores):
            store.close()  # harmless when the test closed it already
        if self.loop is not None:
            loop = self.loop

            async def close_keepers() -> None:
                # The keepers sessions and holds shared on this loop: a task
                # left pending when the loop closes would be destroyed noisily.
                for store in self._stores:
                    per_loop = AsyncKeeper._shared.get(unwrap(store), {})
                    for (keeper_loop, _), keeper in list(per_loop.items()):
                        if keeper_loop is loop.loop:
                            await keeper.aclose()

            loop.run(close_keepers())
            loop.close()


def open_flavour(request: pytest.FixtureRequest) -> Iterator[Flavour]:
    """The body of a `flavour` fixture (`pytest.fixture(params=FLAVOURS)(open_flavour)`
    in a test module): each test once per flavour, blocking and asyncio."""
    made = Flavour(
        request.param,
        request.getfixturevalue("pg_dsn"),
        request.getfixturevalue("schema"),
        request.getfixturevalue("pg_store"),
    )
    try:
        yield made
    finally:
        made.close()
