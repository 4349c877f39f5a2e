"""Watchers, run against every backend (PostgreSQL and SQLite) in both flavours
(blocking and asyncio): the guarantees every watcher gives, whatever it reads.

Backend-specific behaviour stays in its own files: the hub, LISTEN and
reconnects (tests/test_watch*.py), a deleted or replaced SQLite file
(tests/test_watch_health_sqlite.py), cursor identity (test_cursor_identity.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from pglease import (
    InvalidCursorError,
    InvalidResourceTypeError,
    Owner,
    Permit,
    PgleaseError,
    ValidationError,
    WatchClosedError,
)
from pglease.types import Event
from pglease.watch import HubTuning, WatchHealth

from ..backends import Backend
from .watching import DEADLINE, cycles, drain, log_of, until, watcher, write

B = Owner("host", "b")
#: Every mode each backend accepts: None (its default) and "poll".
MODES = [None, "poll"]


@pytest.fixture
def rid(backend: Backend) -> str:
    return str(backend.store.ensure_resource("run", "w1"))


# --------------------------------------------------------------------------- delivery


@pytest.mark.parametrize("mode", MODES)
def test_every_event_once_in_order(backend: Backend, rid: str, mode: str | None) -> None:
    other = backend.store.ensure_resource("job", "w2")
    with watcher(backend, mode=mode) as w:
        write(backend, rid, 5)
        cycles(backend, [rid, other], 4)
        write(backend, other, 3, "job.note")
        revision = backend.store.get(other).revision
        noted = Permit(other, revision)
        backend.store.mutate(noted, "job.note", payload={"k": [1, "x"]}, actor=B)
        expected = log_of(backend)
        assert len(expected) == 17
        got = drain(w, len(expected))
        assert got == expected  # each once, in log order, equal to the store's log
        assert got[-1].actor == B and got[-1].payload == {"k": [1, "x"]}
        assert w.get(0.2) is None  # and nothing more
        idle = w.cursor  # at or after the last event (PostgreSQL: the read frontier)
    write(backend, rid, 1, "run.last")
    with watcher(backend, after=idle) as resumed:
        assert [e.type for e in drain(resumed, 1)] == ["run.last"]
        assert resumed.get(0.2) is None


def test_now_skips_history_and_start_reads_it(backend: Backend, rid: str) -> None:
    write(backend, rid, 2, "run.old")
    with watcher(backend) as now, watcher(backend, after="start") as start:
        assert now.get(0.2) is None  # "now" (the default) skips what was there
        write(backend, rid, 1, "run.new")
        new = now.get(DEADLINE)
        assert new is not None and (new.type, new.revision) == ("run.new", 3)
        assert [e.type for e in drain(start, 3)] == ["run.old", "run.old", "run.new"]
        assert now.get(0.1) is None and start.get(0.1) is None


def test_resume_from_a_cursor_has_no_gap_and_no_repeat(backend: Backend, rid: str) -> None:
    write(backend, rid, 10)
    with watcher(backend, after="start") as w:
        head = drain(w, 4)
        # Events read but not handed out yet are not behind the cursor.
        assert w.cursor == head[-1].cursor
        saved = w.cursor
    write(backend, rid, 5)
    with watcher(backend, after=saved) as resumed:
        rest = drain(resumed, 11)
        assert resumed.get(0.2) is None
    assert [e.revision for e in head + rest] == list(range(1, 16))
    assert head + rest == log_of(backend)
    # An event's own cursor resumes right after it, too.
    with watcher(backend, after=rest[2].cursor) as again:
        assert drain(again, 8) == rest[3:]


def test_get_batch_and_iteration_share_one_position(backend: Backend, rid: str) -> None:
    with watcher(backend, after="start") as w:
        assert w.get_batch(0.1) == []
        write(backend, rid, 12)
        got = []
        for event in w:
            got.append(event)
            if len(got) == 3:
                break
        one = w.get(DEADLINE)
        assert one is not None
        got.append(one)
        while len(got) < 12:
            batch = w.get_batch(DEADLINE, max_events=4)
            assert 1 <= len(batch) <= 4
            got += batch
        assert [e.revision for e in got] == list(range(1, 13))
        assert w.get(0.2) is None


def _take(w: Any, n: int) -> list[Event]:
    out: list[Event] = []
    for event in w:
        out.append(event)
        if len(out) == n:
            break
    return out


def _first_after(backend: Backend, cursor: str) -> int:
    """The revision of the first event after `cursor`, read by a fresh watcher."""
    with watcher(backend, after=cursor) as w:
        event = w.get(DEADLINE)
    assert event is not None
    return event.revision


def test_leaving_a_loop_keeps_nothing_back(backend: Backend, rid: str) -> None:
    with watcher(backend, after="start") as w:
        write(backend, rid, 8)
        first = _take(w, 3)
        # The cursor resumes right after the last event the loop saw.
        assert _first_after(backend, w.cursor) == 4
        second = _take(iter(w), 2)
        assert _first_after(backend, w.cursor) == 6
        rest = drain(w, 3)
        assert [e.revision for e in first + second + rest] == list(range(1, 9))


def test_two_loops_interleaved_split_the_stream(backend: Backend, rid: str) -> None:
    with watcher(backend, after="start") as w:
        write(backend, rid, 6)
        one, two = iter(w), iter(w)
        got = [next(one), next(two), next(one), next(two), next(one), next(two)]
        assert [e.revision for e in got] == list(range(1, 7))


def test_close_inside_a_loop_ends_it(backend: Backend, rid: str) -> None:
    w = watcher(backend, after="start")
    write(backend, rid, 3)
    seen = []
    for event in w:
        seen.append(event.revision)
        w.close()
    assert seen == [1]


def test_filters_narrow_what_is_yielded_and_still_move_the_cursor(
    backend: Backend, rid: str
) -> None:
    job = backend.store.ensure_resource("job", "w3")
    with (
        watcher(backend, types="job") as by_type,
        watcher(backend, resources=[rid]) as by_resource,
        watcher(backend, event_types=["lease.released", "run.note"]) as by_event,
    ):
        cycles(backend, [rid], 1)
        cycles(backend, [job], 1)
        write(backend, rid, 1, "run.note")
        assert [(e.resource_id, e.type) for e in drain(by_type, 2)] == [
            (job, "lease.claimed"),
            (job, "lease.released"),
        ]
        assert [e.revision for e in drain(by_resource, 3)] == [1, 2, 3]
        assert [(e.resource_id, e.type) for e in drain(by_event, 3)] == [
            (rid, "lease.released"),
            (job, "lease.released"),
            (rid, "run.note"),
        ]
        for w in (by_type, by_resource, by_event):
            assert w.get(0.1) is None
        # Idle, every one of them stands after the last event read.
        assert by_type.cursor == by_resource.cursor == by_event.cursor
    write(backend, rid, 1, "run.later")
    with watcher(backend, after=by_type.cursor) as resumed:
        later = resumed.get(DEADLINE)
        assert later is not None and later.type == "run.later"


# --------------------------------------------------------------------------- max_pending


def test_a_slow_watcher_is_bounded_and_loses_nothing(backend: Backend) -> None:
    rids = [backend.store.ensure_resource("run", f"of{i}") for i in range(3)]
    with watcher(backend, max_pending=3) as slow, watcher(backend) as fast:
        # One cycle at a time, each seen by the fast watcher before the next:
        # the slow one is offered (PostgreSQL) or can read (SQLite) one batch
        # per cycle, taking none yet, so it overflows whatever the timing.
        for i in range(30):
            cycles(backend, [rids[i % 3]], 1)
            assert len(drain(fast, 2)) == 2
        got = drain(slow, 60)
        assert got == log_of(backend)
        assert slow.get(0.2) is None
        # It fell behind once, by more than its bound; the fast one never did.
        assert slow.overflows == 1 and fast.overflows == 0
        assert slow.health.healthy and slow.health.lag_events == 0
        # Back on the live stream afterwards.
        cycles(backend, rids, 2)
        later = drain(slow, 4)
        assert later == drain(fast, 4) == log_of(backend)[60:]


def test_a_filtered_slow_watcher_keeps_its_filter(backend: Backend) -> None:
    rids = [backend.store.ensure_resource("run", f"ff{i}") for i in range(2)]
    with watcher(backend, max_pending=2, resources=rids[0]) as slow, watcher(backend) as fast:
        # One cycle at a time, each seen by the fast watcher before the next is
        # written, so the slow one is handed one batch per cycle of rids[0] and
        # the second overflows its bound. (A batch into an empty mailbox is
        # never dropped: the 40 events read as one page would not overflow it.)
        for i in range(20):
            cycles(backend, [rids[i % 2]], 1)
            assert len(drain(fast, 2)) == 2
        got = drain(slow, 20)
        assert slow.overflows >= 1
        assert got == [e for e in log_of(backend) if e.resource_id == rids[0]]
        assert slow.get(0.2) is None


@pytest.mark.parametrize("bad", [0, -1, True, "5", 2.5, None])
def test_a_bad_max_pending_is_refused(backend: Backend, bad: object) -> None:
    with pytest.raises(ValidationError, match="max_pending"):
        watcher(backend, max_pending=bad)


# --------------------------------------------------------------------------- health


def test_health_of_a_working_watcher(backend: Backend, rid: str) -> None:
    with watcher(backend) as w:
        fresh = w.health
        assert isinstance(fresh, WatchHealth)
        assert fresh.healthy and not fresh.failed and fresh.failed_error is None
        assert fresh.last_error is None and fresh.failing_since is None
        assert fresh.reconnects == 0 and fresh.lag_events == 0 and fresh.lag_seconds == 0.0
        write(backend, rid, 2)  # both committed before the first read
        first = w.get(DEADLINE)
        assert first is not None and first.revision == 1
        # The second is at hand, not handed out: the watcher's lag.
        until(lambda: w.health.lag_events == 1, "the second event queued")
        until(lambda: w.health.last_read_at is not None, "a read")
        second = w.get(DEADLINE)
        assert second is not None and second.revision == 2
        health = w.health
        assert health.healthy and health.lag_events == 0 and health.lag_seconds == 0.0


# --------------------------------------------------------------------------- bounded waits


def test_waits_are_bounded_by_their_timeout(backend: Backend) -> None:
    with watcher(backend) as w:
        started = time.monotonic()
        assert w.get(0) is None
        assert w.get(0.05) is None
        assert w.get_batch(0) == []
        assert w.get_batch(0.05) == []
        # A bound, not a speed claim: far below the default 30 s retry window.
        assert time.monotonic() - started < DEADLINE


def test_close_from_another_thread_ends_a_waiting_get(backend: Backend) -> None:
    w = watcher(backend)
    outcome: list[Any] = []

    def consume() -> None:
        try:
            outcome.append(list(w))  # waits: nothing is written
        except BaseException as exc:  # reported by the assertion below
            outcome.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.2)  # let it block (a delay, not an assertion on speed)
    threading.Thread(target=w.close, daemon=True).start()
    consumer.join(DEADLINE)
    assert not consumer.is_alive(), "close did not end the waiting iteration"
    assert outcome == [[]]


def test_a_closed_watcher_refuses_reads(backend: Backend, rid: str) -> None:
    w = watcher(backend, after="start")
    write(backend, rid, 1)
    w.close()
    w.close()  # twice is fine
    with pytest.raises(WatchClosedError):
        w.get(0)
    with pytest.raises(WatchClosedError):
        w.get_batch(0)
    assert list(w) == []


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"after": "yesterday"}, InvalidCursorError),
        ({"after": 5}, ValidationError),
        ({"types": "Bad Type"}, InvalidResourceTypeError),
        ({"types": False}, ValidationError),
        ({"resources": ["nope"]}, ValidationError),
        ({"event_types": []}, ValidationError),
        ({"event_types": "lease."}, ValidationError),
        ({"mode": "push"}, ValidationError),
        ({"interval": 0}, ValidationError),
        ({"interval": "1"}, ValidationError),
        ({"retry_window": 0}, ValidationError),
        ({"retry_window": float("nan")}, ValidationError),
        ({"retry_window": True}, ValidationError),
        ({"retry_window": "30"}, ValidationError),
        ({"tuning": "fast"}, ValidationError),
    ],
)
def test_bad_arguments_are_refused_and_change_nothing(
    backend: Backend, rid: str, kwargs: dict[str, Any], error: type[PgleaseError]
) -> None:
    before = log_of(backend)
    with pytest.raises(error) as refused:
        watcher(backend, **kwargs)
    assert isinstance(refused.value, PgleaseError) and str(refused.value)
    assert log_of(backend) == before


def test_bad_max_events_is_refused(backend: Backend) -> None:
    with watcher(backend) as w:
        for bad in (0, -1, True, "3"):
            with pytest.raises(ValidationError, match="max_events"):
                w.get_batch(0, max_events=bad)


def test_bad_hub_tuning_is_refused() -> None:
    with pytest.raises(ValidationError, match="read_spacing"):
        HubTuning(read_spacing=-1)
    with pytest.raises(ValidationError, match="light_rate"):
        HubTuning(light_rate=10, full_rate=5)
    with pytest.raises(ValidationError, match="rate_smoothing"):
        HubTuning(rate_smoothing=2)
    with pytest.raises(ValidationError, match="min_repoll"):
        HubTuning(min_repoll=float("inf"))
    assert HubTuning(light_rate=1.0, full_rate=2.0, unlisten_rate=2.0).full_rate == 2.0


def test_mode_listen_is_refused_only_where_nothing_can_listen(backend: Backend) -> None:
    if backend.name.startswith("sqlite"):
        with pytest.raises(ValidationError, match="SQLite does not have"):
            watcher(backend, mode="listen")
        return
    with watcher(backend, mode="listen") as w:
        assert w.get(0.05) is None


def test_a_tuning_is_accepted_everywhere(backend: Backend, rid: str) -> None:
    tiny = HubTuning(light_rate=1.0, full_rate=2.0, unlisten_rate=2.0)
    with watcher(backend, tuning=tiny) as w:
        write(backend, rid, 3)
        assert [e.revision for e in drain(w, 3)] == [1, 2, 3]


def test_a_watcher_on_a_closed_store_raises_a_pglease_error(backend: Backend) -> None:
    backend.store.close()
    for after in ("now", "start"):
        with pytest.raises(PgleaseError) as refused:
            w = watcher(backend, after=after)
            w.get(DEADLINE)
        assert "closed" in str(refused.value) or "not open" in str(refused.value)
