"""The runtime's entry points, for the stores' facade methods.

The stores sit below the runtime (tests/test_layering.py): a store module may
not import `pglease.runtime` or `pglease.watch`. So each hands its entry points
to this module when it is imported (`pglease/__init__.py` imports both, and
every ``pglease.*`` import runs that first), and the stores' `hold`,
`acquire`, `elect`, `leader` and `watch` call them from here: the store
depends on this interface, the runtime provides it. (The stores name the
runtime's result types in annotations only, under ``TYPE_CHECKING``.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import PgleaseError
from ..types import Claim, Owner


@dataclass(frozen=True, slots=True)
class Leader:
    """The current leader of an election and its term (the lease generation)."""

    owner: Owner
    generation: int
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class RuntimeEntryPoints:
    """`pglease.runtime`'s functions, each taking the store as its first argument."""

    hold: Callable[..., AbstractContextManager[Any]]
    hold_async: Callable[..., AbstractAsyncContextManager[Any]]
    acquire: Callable[..., Claim]
    acquire_async: Callable[..., Awaitable[Claim]]
    elect: Callable[..., Any]
    elect_async: Callable[..., Awaitable[Any]]
    leader: Callable[[Any, str], Leader | None]
    leader_async: Callable[[Any, str], Awaitable[Leader | None]]


@dataclass(frozen=True, slots=True)
class WatchEntryPoints:
    """`pglease.watch`'s watcher constructors, each taking the store first."""

    watch: Callable[..., Any]
    watch_async: Callable[..., Any]


_provided: list[RuntimeEntryPoints] = []
_watch_provided: list[WatchEntryPoints] = []


def provide(entry_points: RuntimeEntryPoints) -> None:
    """Called once by `pglease.runtime` when it is imported."""
    _provided[:] = [entry_points]


def runtime() -> RuntimeEntryPoints:
    """The fleet runtime's entry points (a `PgleaseError` if it was never imported)."""
    if not _provided:
        raise PgleaseError("the fleet runtime is not loaded: import pglease.runtime first")
    return _provided[0]


def provide_watch(entry_points: WatchEntryPoints) -> None:
    """Called once by `pglease.watch` when it is imported."""
    _watch_provided[:] = [entry_points]


def watch_runtime() -> WatchEntryPoints:
    """The watch package's entry points (a `PgleaseError` if it was never imported)."""
    if not _watch_provided:
        raise PgleaseError("the watch runtime is not loaded: import pglease.watch first")
    return _watch_provided[0]
