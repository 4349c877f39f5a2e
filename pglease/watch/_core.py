"""What the sync and asyncio watchers share: SQL, filters, and the delivery state machine.

Positions are `(xid, event id)` pairs (see `pglease.cursors`). Every reader
(the process hub and each watcher catching up) reads the same immutable
prefix of the log, in position order, so a watcher can switch from its own
catch-up reads to the hub's stream by comparing positions alone.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from psycopg import sql

from ..clock import Clock
from ..cursors import START, Position, cursor_check, encode_cursor, fingerprint
from ..dsn import redact_text
from ..errors import (
    CursorExpiredError,
    ValidationError,
    WatchClosedError,
    WatchError,
    WatchFailedError,
)
from ..payloads import decode_payload
from ..types import Event, Owner
from ..validation import check_event_type, check_resource_id, check_resource_type, describe

#: The biggest position; the hub reads with no upper bound.
END = Position(2**64 - 1, 2**63 - 1)
PAGE = 1000

Mode = Literal["listen", "poll"]

log = logging.getLogger("pglease.watch")

#: How long an error may persist (reads failing, reconnects refused) before
#: the watchers get it: long enough to ride out a server restart or failover.
DEFAULT_RETRY_WINDOW = 30.0
#: Retry delays after a failed read or connect; the last one repeats.
RETRY_DELAYS = (0.05, 0.1, 0.2, 0.5, 1.0)


def channel_name(schema: str) -> str:
    """The NOTIFY channel of a schema; must match `left('pglease_@schema@', 63)` in SQL."""
    return f"pglease_{schema}"[:63]


class WatchQueries:
    """The watch SQL of one schema."""

    def __init__(self, schema: str):
        s = sql.Identifier(schema)

        def q(text: str) -> bytes:
            return sql.SQL(text).format(s=s).as_string(None).encode()

        # One round trip: skipper probe, snapshot bounds, prune horizon and a
        # page of events (see watch_read in sql/0002_watch.sql).
        self.read = q(
            "SELECT * FROM {s}.watch_read(%s::text::xid8, %s::bigint, %s::text::xid8,"
            " %s::bigint, %s::integer)"
        )
        # The same read as a libpq prepared statement (the hub's own connection).
        self.read_prepared = q(
            "SELECT * FROM {s}.watch_read($1::text::xid8, $2::bigint, $3::text::xid8,"
            " $4::bigint, $5::integer)"
        )
        self.frontier = q(
            "SELECT pg_snapshot_xmin(pg_current_snapshot())::text,"
            " pruned_xid::text, pruned_id FROM {s}.event_horizon"
        )
        self.reap_next = q("SELECT lease_resource, reaped FROM {s}.reap_next(%s)")
        self.prune = q("SELECT {s}.prune_events(make_interval(secs => %s))")


def read_args(after: Position, upto: Position, limit: int) -> list[Any]:
    return [str(after.xid), after.event_id, str(upto.xid), upto.event_id, limit]


@dataclass(frozen=True, slots=True)
class Page:
    """One read: events in position order plus what the snapshot said."""

    events: list[Event]
    positions: list[Position]
    #: Readable frontier: every event not yet committed sorts after (xmin, 0).
    frontier: Position
    #: True when some transaction was in progress below the snapshot's xmax, or
    #: a writer that skipped its NOTIFY was in flight: an event may still become
    #: readable without any further notification, so the reader must re-poll.
    held_back: bool
    #: The last position ever deleted by prune (START when none).
    horizon: Position
    full: bool


def parse_page(rows: Sequence[Sequence[Any]], limit: int) -> Page:
    first = rows[0]
    xmin, xmax, skippers = int(first[0]), int(first[1]), bool(first[2])
    horizon = Position(int(first[3]), int(first[4]))
    events: list[Event] = []
    positions: list[Position] = []
    if first[5] is not None:
        # Per event: the hub parses every event its process receives, once.
        add_event, add_position = events.append, positions.append
        for r in rows:
            event_id, xid = r[5], r[6]
            add_position(Position(int(xid), event_id))
            add_event(_event(r, f"{xid}.{event_id}.{fingerprint(r[7], r[10], r[18])}"))
    held_back = xmin != xmax or skippers
    return Page(events, positions, Position(xmin, 0), held_back, horizon, len(events) >= limit)


_owners: dict[tuple[str, str], Owner] = {}


def _event(r: Sequence[Any], cursor: str) -> Event:
    """`parse_event` for the hot path: owners read back from the database were
    validated when written, so they are cached instead of re-validated."""
    owner = None
    if r[13] is not None:
        key = (r[12], r[13])
        owner = _owners.get(key)
        if owner is None:
            if len(_owners) > 10_000:
                _owners.clear()
            owner = _owners[key] = Owner(*key)
    body, sha = r[16], r[17]
    return Event(
        id=r[5],
        cursor=cursor,
        resource_id=r[7],
        resource_type=r[8],
        resource_key=r[9],
        revision=r[10],
        type=r[11],
        actor=owner,
        lease_generation=r[14],
        lease_expires_at=r[15],
        payload=decode_payload(body) if body is not None else None,
        payload_sha256=bytes(sha) if sha is not None else None,
        created_at=r[18],
    )


def parse_frontier(row: Sequence[Any]) -> tuple[Position, Position]:
    return Position(int(row[0]), 0), Position(int(row[1]), int(row[2]))


@dataclass(frozen=True, slots=True)
class Filters:
    """Which events a watcher yields; None means no restriction."""

    types: frozenset[str] | None = None
    resources: frozenset[str] | None = None
    event_types: frozenset[str] | None = None

    @classmethod
    def build(
        cls,
        types: Iterable[str] | str | None,
        resources: Iterable[str] | str | None,
        event_types: Iterable[str] | str | None,
    ) -> Filters:
        return cls(
            _set(types, check_resource_type, "types"),
            _set(resources, check_resource_id, "resources"),
            _set(event_types, _check_watch_event_type, "event_types"),
        )

    @property
    def unfiltered(self) -> bool:
        return self.types is None and self.resources is None and self.event_types is None

    def match(self, event: Event) -> bool:
        return (
            (self.types is None or event.resource_type in self.types)
            and (self.resources is None or event.resource_id in self.resources)
            and (self.event_types is None or event.type in self.event_types)
        )


def _check_watch_event_type(value: object) -> str:
    # Watchers may ask for the reserved `lease.*` types that writers may not use.
    if isinstance(value, str) and value.startswith("lease."):
        check_event_type("x" + value[len("lease") :])
        return value
    return check_event_type(value)


def _set(
    values: Iterable[str] | str | None, check: Callable[[object], str], what: str
) -> frozenset[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    # A bool, a number or an arbitrary object (types=False) is a caller's mistake;
    # iterating it would raise a bare TypeError.
    if not isinstance(values, Iterable):
        raise ValidationError(
            f"{what} must be a str, a collection of str or None, got {type(values).__name__}"
        )
    checked = frozenset(check(v) for v in values)
    if not checked:
        raise ValidationError("an empty filter would match nothing; pass None for no filter")
    return checked


def check_interval(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise ValidationError(f"{what} must be a number of seconds in (0, 3600]")
    return float(value)


def check_mode(value: object) -> Mode:
    if value not in ("listen", "poll"):
        raise ValidationError(f"mode must be 'listen' or 'poll', got {describe(value)}")
    return "listen" if value == "listen" else "poll"


@dataclass(slots=True)
class Batch:
    """What the hub hands every subscriber after a read."""

    events: list[Event]
    positions: list[Position]
    #: The hub's position after this batch (last event or the readable frontier).
    tip: Position


@dataclass(slots=True)
class Start:
    """The first message to a subscriber: the hub position it joins at."""

    tip: Position


@dataclass(slots=True)
class Failure:
    error: BaseException


Message = Batch | Start | Failure


class WatchState:
    """The delivery state machine of one watcher, free of I/O.

    Phases: wait for the hub's `Start` (the position the stream joins at),
    catch up with our own reads from our cursor up to that position, then take
    the hub's batches, dropping anything at or before our cursor.
    """

    def __init__(
        self, position: Position, from_start: bool, filters: Filters, check: str | None = None
    ):
        self.position = position
        self.from_start = from_start
        self.filters = filters
        #: Position the hub stream joined at; None until `Start` arrives.
        self.join: Position | None = None
        self.catching_up = False
        self.pending: deque[Event] = deque()
        #: The last event handed out (None: nothing yet, `_start` applies).
        #: Public so that the watchers' per-event fast paths can set it inline.
        self.last: Event | None = None
        self._start = position
        #: The last event read (filtered out or not): the anchor a cursor at
        #: `position` carries (see `pglease.cursors`); before any, `_check`.
        self.anchor: Event | None = None
        self._check = check
        #: A watcher that failed (cursor expired) keeps failing: continuing
        #: would skip the deleted events silently.
        self.failed: BaseException | None = None

    @property
    def cursor(self) -> str:
        # Events read but not yet handed out must not be skipped on resume.
        if not self.pending:
            anchor = self.anchor
            check = cursor_check(anchor.cursor) if anchor is not None else self._check
            return encode_cursor(self.position, check)
        if self.last is not None:
            return self.last.cursor
        return encode_cursor(self._start, self._check)

    def on_message(self, message: Message) -> None:
        if isinstance(message, Failure):
            self.failed = message.error
            raise message.error
        if isinstance(message, Start):
            self.join = message.tip
            self.catching_up = self.position < message.tip
            return
        assert self.join is not None, "the hub sends Start first"
        if self.catching_up:
            # Cannot happen: catch-up finishes before the queue is read again.
            raise AssertionError("batch while catching up")
        self._take(message.events, message.positions)
        if message.tip > self.position:
            self.position = message.tip

    def rejoin(self, tip: Position) -> None:
        """The mailbox dropped batches up to `tip` (we fell behind): read that
        span from the log ourselves, then take the stream again after it.
        Called only with nothing pending, like `on_message`."""
        self.join = tip
        self.catching_up = self.position < tip

    def on_page(self, page: Page) -> None:
        """A catch-up page read from our position up to `join`."""
        self.check_horizon(page.horizon)
        self._take(page.events, page.positions)
        if not page.full:
            assert self.join is not None
            self.catching_up = False
            if self.join > self.position:
                self.position = self.join

    def check_horizon(self, horizon: Position) -> None:
        if self.position >= horizon:
            return
        if self.from_start and self.position == START:
            # "start" means the oldest retained event, not event zero.
            self.position = self._start = horizon
            self._check = None  # its event was pruned: nothing to check
            return
        self.failed = CursorExpiredError(
            f"cursor {encode_cursor(self.position)} is older than the pruned horizon"
            f" {encode_cursor(horizon)}: events after it were deleted; resume from 'now'"
            " or 'start' and resync"
        )
        raise self.failed

    def _take(self, events: list[Event], positions: list[Position]) -> None:
        if not events:
            return
        if positions[0] > self.position:
            # The common case (a live batch, all new): no per-event position checks.
            self.position = positions[-1]
            self.anchor = events[-1]
            if self.filters.unfiltered:
                self.pending.extend(events)
            else:
                self.pending.extend(e for e in events if self.filters.match(e))
            return
        for event, pos in zip(events, positions, strict=True):
            if pos <= self.position:
                continue  # already delivered (we read past the hub's join point)
            self.position = pos
            self.anchor = event
            if self.filters.match(event):
                self.pending.append(event)

    def take(self, limit: int) -> list[Event]:
        """Up to `limit` pending events, without waiting."""
        pending = self.pending
        n = min(limit, len(pending))
        if n <= 0:
            return []
        if n == len(pending):
            # The usual case: all of it, copied in C rather than popped one by one.
            out = list(pending)
            pending.clear()
        else:
            out = [pending.popleft() for _ in range(n)]
        self.last = out[-1]
        return out

    def next_event(self) -> Event | None:
        if self.pending:
            event = self.pending.popleft()
            self.last = event
            return event
        return None


def closed_error() -> WatchClosedError:
    return WatchClosedError("the watcher is closed")


# ------------------------------------------------------------------ errors and health

#: SQLSTATE classes no retry heals: 42 (access rule violation or a missing
#: object: 42501 insufficient_privilege, 42P01 undefined_table, 42883
#: undefined_function) and 28 (invalid authorization).
_PERMANENT_CLASSES = ("42", "28")
#: Single SQLSTATEs no retry heals: 3F000 invalid_schema_name, 3D000 the
#: database does not exist, 0A000 feature_not_supported (a pooler that
#: refuses LISTEN or prepared statements).
_PERMANENT_STATES = frozenset({"3F000", "3D000", "0A000"})


def sqlstate_of(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


def cannot_heal(exc: BaseException) -> bool:
    """True for errors that retrying cannot fix (privileges, missing objects)."""
    state = sqlstate_of(exc)
    return state is not None and (state in _PERMANENT_STATES or state[:2] in _PERMANENT_CLASSES)


def describe_error(exc: BaseException) -> str:
    """One line naming the error and its SQLSTATE, without any password."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    state = sqlstate_of(exc)
    head = type(exc).__name__ + (f" [{state}]" if state else "")
    return redact_text(f"{head}: {'; '.join(lines) or 'no detail'}")


def check_retry_window(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86400:
        raise ValidationError("retry_window must be a number of seconds in (0, 86400]")
    return float(value)


def _wall(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


class Trouble:
    """The error state of one reader (the hub, or a watcher catching up).

    `record` notes an error and says whether to give up: at once when it
    cannot heal, else once errors have persisted for `window` seconds on
    `clock` (a success in between, `healed`, starts the window again).
    """

    def __init__(self, clock: Clock, window: float, what: str) -> None:
        self.clock = clock
        self.window = window
        self.what = what
        self.last_error: str | None = None
        self.last_error_wall: float | None = None
        #: Monotonic and wall time of the first error of the current run; None: healthy.
        self.failing_since: float | None = None
        self.failing_since_wall: float | None = None
        self.attempts = 0

    def record(
        self, exc: BaseException, permanent: bool | None = None, hint: str = ""
    ) -> WatchFailedError | None:
        """Note `exc`; return the error for the consumers when it is time to give up.

        `permanent` overrides the SQLSTATE rule (`cannot_heal`) for non-PostgreSQL errors.
        """
        now = self.clock.monotonic()
        self.last_error = describe_error(exc)
        self.last_error_wall = self.clock.time()
        if self.failing_since is None:
            self.failing_since = now
            self.failing_since_wall = self.last_error_wall
        self.attempts += 1
        if cannot_heal(exc) if permanent is None else permanent:
            error = WatchFailedError(
                f"{self.what} failed with an error retrying cannot fix: {self.last_error}"
                f"{hint or _hint(exc)}"
            )
        elif now - self.failing_since >= self.window:
            error = WatchFailedError(
                f"{self.what} kept failing for {now - self.failing_since:.1f} s (retry window"
                f" {self.window:g} s, {self.attempts} attempts): {self.last_error}"
            )
        else:
            # Powers of two: a long outage logs a handful of lines, not one a second.
            if self.attempts & (self.attempts - 1) == 0:
                log.warning(
                    "%s: %s (attempt %d, retrying for up to %g s)",
                    self.what, self.last_error, self.attempts, self.window,
                )  # fmt: skip
            return None
        error.__cause__ = exc
        log.error("%s: giving up: %s", self.what, error)
        return error

    def healed(self) -> None:
        """A read succeeded: the current run of errors is over."""
        if self.failing_since is not None:
            log.info(
                "%s: recovered after %d failed attempts (%.1f s)",
                self.what, self.attempts, self.clock.monotonic() - self.failing_since,
            )  # fmt: skip
            self.failing_since = self.failing_since_wall = None
            self.attempts = 0

    def delay(self) -> float:
        return RETRY_DELAYS[min(self.attempts - 1, len(RETRY_DELAYS) - 1)]


def _hint(exc: BaseException) -> str:
    state = sqlstate_of(exc)
    if state == "42501":
        return " (the role lacks a privilege: grant it pglease's reader or client role)"
    if state in ("3F000", "42P01", "42883"):
        return " (the schema or its objects are missing: run `pglease migrate`)"
    if state == "0A000":
        return " (the server or pooler refuses a feature: try mode='poll' behind a pooler)"
    return ""


@dataclass(frozen=True, slots=True)
class WatchHealth:
    """A snapshot of how a watcher's reads are going (`watcher.health`)."""

    #: The watcher gave up (its get/iteration raises `failed_error`).
    failed: bool
    #: The error it gave up with, if any.
    failed_error: WatchError | None
    #: The last read or connect error, healed or not (None: none so far).
    last_error: str | None
    last_error_at: datetime | None
    #: When the current run of errors began; None while reads succeed.
    failing_since: datetime | None
    #: Events waiting in this watcher's queue, not handed out yet: a lower bound
    #: of its lag (events the hub has not read or handed over are not counted).
    lag_events: int
    #: Seconds since the stream last read the log, while it is failing; 0 otherwise.
    lag_seconds: float
    #: Connections the stream re-opened after losing one.
    reconnects: int
    #: When the stream last read the log successfully.
    last_read_at: datetime | None

    @property
    def healthy(self) -> bool:
        return not self.failed and self.failing_since is None


def make_health(
    *,
    troubles: Sequence[Trouble],
    failed: BaseException | None,
    lag_events: int,
    reconnects: int,
    last_read: float | None,
    last_read_wall: float | None,
    clock: Clock,
) -> WatchHealth:
    """Combine the error states of a watcher's readers into one `WatchHealth`."""
    seen = [t for t in troubles if t.last_error_wall is not None]
    latest = max(seen, key=lambda t: t.last_error_wall or 0.0, default=None)
    failing = [t.failing_since_wall for t in troubles if t.failing_since_wall is not None]
    lag = 0.0
    if failing or failed is not None:
        lag = clock.monotonic() - last_read if last_read is not None else 0.0
    return WatchHealth(
        failed=failed is not None,
        failed_error=failed if isinstance(failed, WatchError) else None,
        last_error=latest.last_error if latest is not None else None,
        last_error_at=_wall(latest.last_error_wall if latest is not None else None),
        failing_since=_wall(min(failing)) if failing else None,
        lag_events=lag_events,
        lag_seconds=max(0.0, lag),
        reconnects=reconnects,
        last_read_at=_wall(last_read_wall),
    )
