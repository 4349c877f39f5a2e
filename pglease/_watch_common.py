"""What every watcher shares, whichever driver it reads: argument checks,
filters, the hub's load thresholds, and the error state behind `health`.

Free of I/O and of any driver, so that the PostgreSQL watchers (`pglease.watch`)
and the SQLite ones (`pglease.sqlite.watch`) both build on it without the
driver layer importing the runtime above it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from .clock import Clock
from .errors import ValidationError, WatchError, WatchFailedError
from .types import Event
from .validation import check_event_type, check_resource_id, check_resource_type, describe

Mode = Literal["listen", "poll"]

log = logging.getLogger("pglease.watch")

#: How long an error may persist (reads failing, reconnects refused) before
#: the watchers get it: long enough to ride out a server restart or failover.
DEFAULT_RETRY_WINDOW = 30.0
#: Retry delays after a failed read or connect; the last one repeats.
RETRY_DELAYS = (0.05, 0.1, 0.2, 0.5, 1.0)
#: Default bound: queued events per watcher before it reads from the log instead.
DEFAULT_MAX_PENDING = 10_000
#: How long a watcher's connection may go without an answer from the server
#: before the silence is an error (a stalled network path, a hung server).
DEFAULT_STALL_TIMEOUT = 5.0


def check_max_events(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"max_events must be an int >= 1, got {describe(value)}")
    return value


def check_max_pending(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError(f"max_pending must be an int >= 1, got {describe(value)}")
    return value


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


# ------------------------------------------------------------------ the hub's thresholds

#: First re-poll delay while a read was held back by in-flight transactions;
#: doubled while nothing changes, up to MAX_REPOLL, reset on progress.
MIN_REPOLL = 0.001
MAX_REPOLL = 0.05
#: Under load the hub spaces its reads instead of reading once per NOTIFY:
#: each read costs the server about as much as a write, and each batch costs
#: every consumer a wake-up (a thread switch or an asyncio task step, several
#: to tens of microseconds each). Above LIGHT_RATE events/s the next read
#: starts no earlier than READ_SPACING after the previous one, or
#: SPACING_PER_CONSUMER per consumer woken by a batch when that is more, up
#: to MAX_READ_SPACING; scaled down linearly between LIGHT_RATE and FULL_RATE.
#: That bounds both the wake-ups per second and the latency added. Below
#: LIGHT_RATE reads are never spaced.
READ_SPACING = 0.008
SPACING_PER_CONSUMER = 0.00025
MAX_READ_SPACING = 0.025
LIGHT_RATE = 1500.0
FULL_RATE = 3000.0
#: Listen mode: above this rate the hub UNLISTENs and polls at the read
#: spacing; it LISTENs again below LIGHT_RATE. (LIGHT_RATE is high enough
#: that a fair-queue handoff, a release then one waiter's claim, is never
#: held up by spacing: those run at a few hundred per second.)
UNLISTEN_RATE = FULL_RATE
#: Weight of the newest read in the event-rate estimate.
RATE_SMOOTHING = 0.2


@dataclass(frozen=True, slots=True)
class HubTuning:
    """The hub's thresholds and delays (the module constants above are the defaults).

    Rates are events per second on the hub's clock, the rest seconds. Tests
    use tiny rates to reach the "under load" branch with a handful of events;
    production code has no reason to change them. Every value must be a
    positive number (`rate_smoothing` at most 1, `light_rate` at most
    `full_rate`), else `ValidationError`.
    """

    light_rate: float = LIGHT_RATE
    full_rate: float = FULL_RATE
    unlisten_rate: float = UNLISTEN_RATE
    read_spacing: float = READ_SPACING
    spacing_per_consumer: float = SPACING_PER_CONSUMER
    max_read_spacing: float = MAX_READ_SPACING
    rate_smoothing: float = RATE_SMOOTHING
    min_repoll: float = MIN_REPOLL
    max_repoll: float = MAX_REPOLL

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValidationError(f"HubTuning.{name} must be a number, got {describe(value)}")
            if not 0 < value < math.inf:
                raise ValidationError(f"HubTuning.{name} must be positive and finite, got {value}")
        if self.rate_smoothing > 1:
            raise ValidationError("HubTuning.rate_smoothing must be in (0, 1]")
        if self.light_rate > self.full_rate:
            raise ValidationError("HubTuning.light_rate must not exceed full_rate")
        if self.min_repoll > self.max_repoll:
            raise ValidationError("HubTuning.min_repoll must not exceed max_repoll")


DEFAULT_TUNING = HubTuning()


def check_tuning(tuning: object) -> HubTuning:
    """`tuning` (None: the defaults), refused unless it is a `HubTuning`."""
    if tuning is None:
        return DEFAULT_TUNING
    if not isinstance(tuning, HubTuning):
        raise ValidationError(f"tuning must be a HubTuning or None, got {describe(tuning)}")
    return tuning


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


def describe_plain(exc: BaseException) -> str:
    """One line naming the error and its SQLSTATE (if any)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    state = sqlstate_of(exc)
    head = type(exc).__name__ + (f" [{state}]" if state else "")
    return f"{head}: {'; '.join(lines) or 'no detail'}"


def check_retry_window(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86400:
        raise ValidationError("retry_window must be a number of seconds in (0, 86400]")
    return float(value)


def check_stall_timeout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise ValidationError(
            f"stall_timeout must be a number of seconds in (0, 3600], got {describe(value)}"
        )
    return float(value)


def _wall(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


class Trouble:
    """The error state of one reader (the hub, or a watcher catching up).

    `record` notes an error and says whether to give up: at once when it
    cannot heal, else once errors have persisted for `window` seconds on
    `clock` (a success in between, `healed`, starts the window again).
    """

    #: How an error is worded in messages and `health` (PostgreSQL's readers
    #: use one that masks passwords: psycopg errors may quote a DSN).
    describe: Callable[[BaseException], str] = staticmethod(describe_plain)

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
        self.last_error = self.describe(exc)
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


def channel_name(schema: str) -> str:
    """The NOTIFY channel of a schema; must match `left('pglease_@schema@', 63)` in SQL."""
    return f"pglease_{schema}"[:63]
