"""A keeper's line to a repository's session files (`AsyncFileLeaseSource`,
the source of `_file_channel.py`): what `AsyncKeeper` / `Keeper` need in
place of a store's runtime driver, so file-session leases are held by a
keeper like every other lease.

There is nothing to connect to: each handle keeps its file open, and a beat
uses that connection (`FileLeases`), in a worker thread under asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._compat_async import to_thread
from ..driver import HeartbeatItem, HeartbeatResult
from ..types import Claim
from ._file_leases import FileLeases


class AsyncFileHeartbeatChannel:
    """The `AsyncHeartbeatChannel` over a repository's open files."""

    def __init__(self, leases: FileLeases) -> None:
        self._leases = leases

    async def connect(self, timeout: float | None = None) -> None:
        """Nothing to open: the files are open while their handles are."""

    async def heartbeat(self, batch: Sequence[HeartbeatItem]) -> list[HeartbeatResult]:
        return await to_thread(self._leases.heartbeat, batch)

    async def release(self, claim: Claim) -> None:
        await to_thread(self._leases.release, claim)

    def abort(self) -> None:
        self._leases.abort()

    async def close(self) -> None:
        """Nothing to close: the files belong to their handles."""


class AsyncFileLeaseSource:
    """Stands in for a store when a keeper is made (`runtime_driver()`): its
    heartbeat channel renews the leases of `leases`."""

    def __init__(self, leases: FileLeases) -> None:
        self.leases = leases

    def runtime_driver(self) -> AsyncFileLeaseSource:
        return self

    def heartbeat_channel(self, connect_timeout: float) -> AsyncFileHeartbeatChannel:
        return AsyncFileHeartbeatChannel(self.leases)
