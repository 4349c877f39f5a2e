"""How a watcher's mailbox joins its process hub.

A blocking watcher's mailbox subscribes to the hub itself (`subscribe`); the
asyncio watchers of one event loop share one hub subscription, a `_LoopFanout`
(`subscribe_async`). Either way the watcher holds a `Subscription` and leaves
through it: the two flavours of watcher read alike.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, ClassVar

from ..cursors import Position
from . import hub as _hub
from ._core import Batch, Failure, Message, Start
from .mailbox import AsyncMailbox, SyncMailbox

#: (source, schema, mode, interval, options): what makes watchers share a hub.
HubKey = tuple[Any, ...]


class Subscription:
    """A mailbox's place on a hub's stream."""

    def __init__(self, hub: _hub.Hub, sub_id: int) -> None:
        self.hub = hub
        self._sub_id = sub_id

    def leave(self) -> None:
        """Stop the deliveries (the hub stops with its last subscriber)."""
        _hub.release(self.hub, self._sub_id)


def subscribe(key: HubKey, mailbox: SyncMailbox, connect: _hub.Connect) -> Subscription:
    """Subscribe a blocking watcher's mailbox to its hub (any thread); `connect`
    makes the hub's listener if the hub is new."""
    source, schema, mode, interval, options = key
    hub, sub_id = _hub.acquire(
        connect, source, schema, mode, interval, mailbox.deliver, options=options
    )
    return Subscription(hub, sub_id)


def subscribe_async(key: HubKey, mailbox: AsyncMailbox, connect: _hub.Connect) -> Subscription:
    """Join an asyncio watcher's mailbox to its loop's fan-out (on the loop)."""
    fanout = _LoopFanout.get(asyncio.get_running_loop(), key, connect)
    return _Member(fanout, fanout.join(mailbox))


class _Member(Subscription):
    def __init__(self, fanout: _LoopFanout, member: int) -> None:
        super().__init__(fanout.hub, member)
        self._fanout = fanout

    def leave(self) -> None:
        self._fanout.leave(self._sub_id)


class _LoopFanout:
    """The async watchers of one event loop on one hub.

    One hub subscription per loop: the hub thread makes one cross-thread call
    per batch, and the loop hands the batch to every member queue, instead of
    one wake-up per watcher. Used only from the loop's own thread, so messages
    reach members in hub order and a member joining late starts at the last
    tip the loop processed.
    """

    _all: ClassVar[dict[tuple[Any, ...], _LoopFanout]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop, key: HubKey, connect: _hub.Connect) -> None:
        self.loop = loop
        self.key = key
        self.members: dict[int, AsyncMailbox] = {}
        self.tip: Position | None = None
        self.failure: Failure | None = None
        self._next = 0
        source, schema, mode, interval, options = key
        self.hub, self.sub = _hub.acquire(
            connect, source, schema, mode, interval, self._deliver, self.members.__len__, options
        )

    @classmethod
    def get(
        cls, loop: asyncio.AbstractEventLoop, key: HubKey, connect: _hub.Connect
    ) -> _LoopFanout:
        fanout = cls._all.get((id(loop), *key))
        # A fan-out whose hub gave up gets nothing more: new watchers need a new hub.
        if fanout is None or fanout.loop is not loop or fanout.hub.failure is not None:
            fanout = cls._all[(id(loop), *key)] = cls(loop, key, connect)
        return fanout

    def _deliver(self, message: Message) -> None:
        # Hub thread. RuntimeError: the loop is closed, nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._dispatch, message)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Start | Batch):
            self.tip = message.tip
        elif isinstance(message, Failure):
            self.failure = message
        for mailbox in self.members.values():
            mailbox.deliver(message)

    def join(self, mailbox: AsyncMailbox) -> int:
        member = self._next
        self._next += 1
        self.members[member] = mailbox
        if self.failure is not None:
            mailbox.deliver(self.failure)
        elif self.tip is not None:
            mailbox.deliver(Start(self.tip))
        return member

    def leave(self, member: int) -> None:
        self.members.pop(member, None)
        if not self.members:
            _hub.release(self.hub, self.sub)
            if self._all.get((id(self.loop), *self.key)) is self:
                del self._all[(id(self.loop), *self.key)]
