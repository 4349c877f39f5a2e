"""`pglease top`: a live terminal view of the leases, built on `rich`.

`TopModel` does no I/O. It is built from one listing of the held leases
(the states `pglease.listing.iter_resources` reads) and then follows watch
events; `render()`
turns it into a rich renderable. Time left is judged by the database clock:
the model keeps the offset between the database's `clock_timestamp()` and the
host clock (measured once by the caller) and adds it to its injectable clock,
so a host whose clock is off still shows the time the database decides by.

A heartbeat extends a lease without writing an event, so an event stream
alone cannot tell a lease that a keeper keeps alive from one that ran out.
A held lease that reaches its known expiry is therefore re-read, that one
row (`due_rechecks` / `apply_state`), at most once a second; everything
else comes from the watcher.

The I/O around it (the clock offset, the listing, the watcher, the refresh
loop, the keys) is `pglease.cli.top`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal, Protocol

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .clock import SYSTEM_CLOCK, Clock
from .types import Event, Owner, ResourceState

__all__ = ["Health", "TopModel", "TopRow"]

#: Seconds a freed lease (released, expired, revoked) stays on screen, marked.
FREED_LINGER = 5.0
#: The event rate is averaged over this many seconds.
RATE_WINDOW = 10.0
#: Recent events shown under the leases.
RECENT_EVENTS = 8
#: A lease past its known expiry is re-read at most this often (seconds).
RECHECK_INTERVAL = 1.0
#: Seconds a logged warning stays in the status line.
WARNING_SHOWN = 30.0
#: Width of the time-left bar, in characters.
BAR_WIDTH = 20

State = Literal["held", "released", "expired", "revoked"]

_FREED_BY: dict[str, State] = {
    "lease.released": "released",
    "lease.expired": "expired",
    "lease.revoked": "revoked",
}


class Health(Protocol):
    """What the view shows of a watcher's `health` (a `pglease.watch.WatchHealth`)."""

    @property
    def healthy(self) -> bool: ...
    @property
    def failing_since(self) -> datetime | None: ...
    @property
    def last_error(self) -> str | None: ...
    @property
    def lag_events(self) -> int: ...


@dataclass(slots=True)
class TopRow:
    """One lease as the view knows it."""

    resource_id: str
    type: str
    key: str
    revision: int
    generation: int
    holder: Owner | None
    #: By the database clock; None once freed.
    expires_at: datetime | None
    #: The lease's length at its last claim, renewal or heartbeat (for the bar).
    ttl: float | None
    state: State
    #: clock.monotonic() when it was freed (it disappears FREED_LINGER later).
    freed_at: float | None = None
    #: clock.monotonic() of the last re-read past its expiry.
    checked_at: float | None = None


def _ttl(expires_at: datetime | None, since: datetime | None) -> float | None:
    if expires_at is None or since is None:
        return None
    return max(0.0, (expires_at - since).total_seconds())


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


class TopModel:
    """The state behind `pglease top`: held leases, the event rate, recent events
    and the watcher's lag. Feed it `load`, `apply` and `apply_state`; read it with
    `render`. `clock` decides every time-dependent figure (FakeClock in tests)."""

    def __init__(
        self,
        *,
        schema: str = "pglease",
        clock: Clock = SYSTEM_CLOCK,
        linger: float = FREED_LINGER,
        rate_window: float = RATE_WINDOW,
        recent: int = RECENT_EVENTS,
    ) -> None:
        self.schema = schema
        self.clock = clock
        self.linger = linger
        self.rate_window = rate_window
        self.rows: dict[str, TopRow] = {}
        self.recent: deque[Event] = deque(maxlen=recent)
        #: Database clock minus host clock, in seconds (`set_db_clock`).
        self.offset = 0.0
        #: Half the round trip the offset was measured in: its uncertainty.
        self.offset_error: float | None = None
        #: Seconds from an event's creation to its arrival here (last event).
        self.lag: float | None = None
        self.health: Health | None = None
        #: The last failed re-read, shown until one succeeds.
        self.read_error: str | None = None
        #: The last warning logged while the view runs (on stderr it would garble
        #: the screen), and its clock.time(); shown for WARNING_SHOWN seconds.
        self.warning: str | None = None
        self.warning_at = 0.0
        self.events_seen = 0
        self._started = clock.monotonic()
        # (whole second of clock.monotonic(), events that arrived in it): bounded
        # by the window, however high the rate.
        self._buckets: deque[list[int]] = deque()

    # -- the clock -----------------------------------------------------------------

    def set_db_clock(self, db_now: datetime, sent: float, received: float) -> None:
        """Record the database clock `db_now`, read by a statement sent at host time
        `sent` and answered at `received` (both `clock.time()` readings)."""
        host = (sent + received) / 2
        self.offset = db_now.timestamp() - host
        self.offset_error = max(0.0, (received - sent) / 2)

    def db_now(self) -> datetime:
        """The database clock now, as estimated from the host clock and the offset."""
        return datetime.fromtimestamp(self.clock.time() + self.offset, UTC)

    def time_left(self, row: TopRow) -> float | None:
        """Seconds until `row` expires by the database clock; None when freed."""
        if row.state != "held" or row.expires_at is None:
            return None
        return max(0.0, (row.expires_at - self.db_now()).total_seconds())

    # -- input ---------------------------------------------------------------------

    def load(self, states: Iterable[ResourceState]) -> None:
        """Add the leases of a listing (only the held ones are kept)."""
        for state in states:
            self.apply_state(state)

    def apply_state(self, state: ResourceState) -> None:
        """A resource as read from the table (the listing, or a re-read)."""
        known = self.rows.get(state.id)
        # Heartbeats do not bump the revision: an equal revision may carry news.
        if known is not None and state.revision < known.revision:
            return
        lease = state.lease
        if lease.held and lease.owner is not None:
            row = TopRow(
                state.id, state.type, state.key, state.revision, lease.generation,
                lease.owner, lease.expires_at,
                _ttl(lease.expires_at, lease.heartbeat_at or lease.acquired_at), "held",
            )  # fmt: skip
            if known is not None and known.expires_at == lease.expires_at:
                row.checked_at = known.checked_at  # unchanged: not due again at once
            self.rows[state.id] = row
        elif known is not None and known.state == "held" and state.revision == known.revision:
            # Ran out with no event since (the reaper writes lease.expired later).
            # At a later revision, events are on their way and will say what it was.
            known.state, known.expires_at, known.freed_at = "expired", None, self.clock.monotonic()

    def apply(self, event: Event) -> None:
        """One watch event."""
        self.events_seen += 1
        self._count_arrival()
        self.recent.append(event)
        lag = (self.db_now() - event.created_at).total_seconds()
        self.lag = max(0.0, lag)
        known = self.rows.get(event.resource_id)
        if known is not None and event.revision <= known.revision:
            return  # already in the listing it was read after
        if event.type in ("lease.claimed", "lease.renewed") and event.actor is not None:
            self.rows[event.resource_id] = TopRow(
                event.resource_id, event.resource_type, event.resource_key, event.revision,
                event.lease_generation or 0, event.actor, event.lease_expires_at,
                _ttl(event.lease_expires_at, event.created_at), "held",
            )  # fmt: skip
        elif event.type in _FREED_BY:
            row = known or TopRow(
                event.resource_id, event.resource_type, event.resource_key, event.revision,
                event.lease_generation or 0, event.actor, None, None, "held",
            )  # fmt: skip
            row.state, row.revision, row.expires_at = _FREED_BY[event.type], event.revision, None
            if event.lease_generation is not None:
                row.generation = event.lease_generation
            row.freed_at = self.clock.monotonic()
            self.rows[event.resource_id] = row
        elif known is not None:
            known.revision = event.revision  # a mutation: the lease is unchanged

    def warn(self, message: str) -> None:
        """Show `message` in the status line for WARNING_SHOWN seconds."""
        self.warning, self.warning_at = message, self.clock.time()

    def set_health(self, health: Health) -> None:
        """The watcher's latest `health` snapshot."""
        self.health = health

    def due_rechecks(self, limit: int = 8) -> list[str]:
        """Held leases past their known expiry, not re-read within RECHECK_INTERVAL:
        a heartbeat may have extended them (it writes no event)."""
        now, mono = self.db_now(), self.clock.monotonic()
        due = [
            row
            for row in self.rows.values()
            if row.state == "held"
            and row.expires_at is not None
            and row.expires_at <= now
            and (row.checked_at is None or mono - row.checked_at >= RECHECK_INTERVAL)
        ]
        due.sort(key=lambda r: r.expires_at or now)
        for row in due[:limit]:
            row.checked_at = mono
        return [row.resource_id for row in due[:limit]]

    def forget_freed(self) -> None:
        """Drop freed leases shown for `linger` seconds."""
        mono = self.clock.monotonic()
        gone = [
            rid
            for rid, row in self.rows.items()
            if row.freed_at is not None and mono - row.freed_at >= self.linger
        ]
        for rid in gone:
            del self.rows[rid]

    # -- figures -------------------------------------------------------------------

    def _count_arrival(self) -> None:
        second = int(self.clock.monotonic())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += 1
        else:
            self._buckets.append([second, 1])
        self._trim()

    def _trim(self) -> None:
        horizon = self.clock.monotonic() - self.rate_window
        while self._buckets and self._buckets[0][0] + 1 <= horizon:
            self._buckets.popleft()

    def rate(self) -> float:
        """Events per second over the last `rate_window` seconds (or since start)."""
        self._trim()
        span = min(self.rate_window, max(1.0, self.clock.monotonic() - self._started))
        return sum(count for _, count in self._buckets) / span

    def held(self) -> list[TopRow]:
        return [row for row in self.rows.values() if row.state == "held"]

    # -- output --------------------------------------------------------------------

    def _header(self, shown: int, held: int) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("pglease top", style="bold")
        text.append(f" | schema {self.schema} | ")
        text.append(f"{held} held", style="bold")
        if shown < held:
            text.append(f" ({shown} shown)")
        text.append(f" | {self.rate():.1f} events/s | lag ")
        text.append("-" if self.lag is None else f"{self.lag * 1000:.0f} ms")
        if self.health is not None:
            text.append(f", {self.health.lag_events} queued")
        offset = round(self.offset, 3) + 0.0  # no "-0.000"
        text.append(f" | db clock {offset:+.3f}s")
        return text

    def _status(self) -> Text | None:
        health = self.health
        line: str | None = None
        style = "red"
        if health is not None and not health.healthy:
            since = health.failing_since.isoformat() if health.failing_since else "-"
            line = (
                f"watcher failing since {since} (retrying; nothing is lost):"
                f" {health.last_error or 'no detail'}"
            )
            style = "bold red"
        elif self.read_error is not None:
            line = f"re-read failed: {self.read_error}"
        elif self.warning is not None and self.clock.time() - self.warning_at < WARNING_SHOWN:
            at = datetime.fromtimestamp(self.warning_at).strftime("%H:%M:%S")
            line, style = f"warning at {at}: {self.warning}", "yellow"
        if line is None:
            return None
        return Text(" ".join(line.split()), style=style, no_wrap=True, overflow="ellipsis")

    def _bar(self, left: float | None, ttl: float | None) -> Text:
        if left is None or not ttl:
            return Text(" " * BAR_WIDTH)
        filled = round(BAR_WIDTH * min(1.0, left / ttl))
        style = "green" if left > ttl / 3 else "yellow" if left > 0 else "red"
        return Text("█" * filled, style=style) + Text("·" * (BAR_WIDTH - filled), style="dim")

    def _lease_table(self, rows: list[TopRow]) -> Table:
        table = Table(box=None, pad_edge=False, expand=False, header_style="bold")
        table.add_column("RESOURCE", no_wrap=True, overflow="ellipsis", max_width=48)
        table.add_column("HOLDER", no_wrap=True, overflow="ellipsis", max_width=32)
        table.add_column("GEN", justify="right", no_wrap=True)
        table.add_column("LEFT", justify="right", no_wrap=True)
        table.add_column("TTL", no_wrap=True, width=BAR_WIDTH)
        table.add_column("STATE", no_wrap=True)
        for row in rows:
            left = self.time_left(row)
            table.add_row(
                f"{row.type}/{row.key}",
                str(row.holder) if row.holder is not None else "-",
                str(row.generation),
                "-" if left is None else _duration(left),
                self._bar(left, row.ttl),
                Text(row.state, style="bold" if row.state == "held" else "dim"),
                style=None if row.state == "held" else "dim",
            )
        return table

    def _events_table(self) -> Table:
        table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
        for name in ("TIME", "EVENT", "RESOURCE", "REV", "GEN", "ACTOR"):
            table.add_column(name, no_wrap=True, overflow="ellipsis", max_width=48)
        for e in reversed(self.recent):
            local = e.created_at.astimezone()
            table.add_row(
                local.strftime("%H:%M:%S.") + f"{local.microsecond // 1000:03d}",
                e.type,
                f"{e.resource_type}/{e.resource_key}",
                str(e.revision),
                "-" if e.lease_generation is None else str(e.lease_generation),
                str(e.actor) if e.actor is not None else "-",
            )
        return table

    def render(self, height: int | None = None) -> RenderableType:
        """The frame: header, leases sorted by expiry (freed ones last, marked),
        recent events. `height` (terminal lines) caps the lease rows; None: all."""
        self.forget_freed()
        held = self.held()
        freed = sorted(
            (r for r in self.rows.values() if r.state != "held"),
            key=lambda r: -(r.freed_at or 0.0),
        )
        far = datetime.max.replace(tzinfo=UTC) - timedelta(days=1)
        status = self._status()
        if height is None:
            room = len(held) + len(freed)
        else:
            # header, status, blank, table header, blank, "recent events", table
            # header, the events, footer.
            fixed = 7 + (1 if status is not None else 0) + len(self.recent) + 1
            room = max(1, height - fixed)
        shown_held = heapq.nsmallest(
            min(room, len(held)), held, key=lambda r: (r.expires_at or far, r.type, r.key)
        )
        rows = shown_held + freed[: max(0, room - len(shown_held))]
        parts: list[RenderableType] = [self._header(len(shown_held), len(held))]
        if status is not None:
            parts.append(status)
        parts += [Text(""), self._lease_table(rows)]
        if len(held) > len(shown_held):
            parts.append(Text(f"... {len(held) - len(shown_held)} more held", style="dim"))
        parts += [Text(""), Text("recent events", style="bold")]
        parts.append(self._events_table() if self.recent else Text("(none yet)", style="dim"))
        parts.append(Text("q quits", style="dim"))
        return Group(*parts)
