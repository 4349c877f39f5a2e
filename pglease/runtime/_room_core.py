"""The sans-I/O part of the waiting rooms (`_rooms`): who is in a room and
whom an event wakes; shared by the asyncio room and its generated twin."""

from __future__ import annotations

from typing import Protocol

from ..clock import SYSTEM_CLOCK, Clock

#: Events on the waited-for resource that can make it claimable.
WAKE_EVENTS = ("lease.released", "lease.expired")
#: A room without members keeps its subscription this long (seconds).
LINGER = 1.0
#: How long a joining member waits for the room's watcher to be positioned.
READY_TIMEOUT = 5.0


class _Flag(Protocol):
    """`threading.Event` or `asyncio.Event`: the member's wake-up flag."""

    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...


class Member:
    """One waiting `acquire` call in a room."""

    __slots__ = ("flag", "joined", "rank")

    def __init__(self, flag: _Flag, joined: int) -> None:
        self.flag = flag
        self.joined = joined
        #: Lower is woken first; None until ranked (see `RoomCore.rank`).
        self.rank: int | None = None

    def consume(self) -> None:
        """Called right before an attempt: a wake-up set from now on is a new one."""
        self.flag.clear()


class RoomCore:
    """Who is in the room and whom an event wakes; no I/O, no locking (the sync
    room holds its lock around every call, the asyncio room runs on one loop)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.members: dict[int, Member] = {}
        self._joined = 0
        self._ranks = 0
        #: Instant on `clock` the room became empty (None while it has members).
        self.empty_since: float | None = clock.monotonic()
        #: Counters for tests and benchmarks.
        self.events = 0
        self.wakes = 0

    def join(self, flag: _Flag, fair: bool) -> Member:
        member = Member(flag, self._joined)
        self._joined += 1
        if not fair:
            self.rank(member)  # unfair: first come, first woken
        self.members[member.joined] = member
        self.empty_since = None
        return member

    def rank(self, member: Member) -> None:
        """Give `member` the next rank (fair: right after its queue entry was created)."""
        if member.rank is None:
            member.rank = self._ranks
            self._ranks += 1

    def leave(self, member: Member, won: bool) -> Member | None:
        """Remove `member`; return a member to wake in its place, if any."""
        if self.members.pop(member.joined, None) is None:
            return None
        if not self.members:
            self.empty_since = self.clock.monotonic()
        if not won and member.flag.is_set():
            # It was woken but will not attempt again: its wake-up passes on.
            return self.on_event()
        return None

    def on_event(self) -> Member | None:
        """A release/expiry event: the member to wake now, or None."""
        self.events += 1
        head = self.head()
        if head is None or head.flag.is_set():
            return None
        self.wakes += 1
        return head

    def head(self) -> Member | None:
        # Unranked members (a fair waiter's first attempt still in flight) come
        # last: they attempt anyway, right after joining.
        return min(
            self.members.values(),
            key=lambda m: (m.rank is None, m.rank or 0, m.joined),
            default=None,
        )

    def idle_for(self, now: float) -> float:
        return 0.0 if self.empty_since is None else now - self.empty_since

    def retire_due(self) -> bool:
        """Empty for `LINGER` seconds on the room's clock: time to go."""
        return self.idle_for(self.clock.monotonic()) >= LINGER
