"""Failover of a real PostgreSQL 15 primary to its standby, under load.

- Synchronous standby: no acknowledged claim or fenced write is lost, no
  generation is handed out twice, and the store and a watcher on a multi-host
  DSN carry on by themselves on the promoted standby.
- Asynchronous standby that fell behind: the events it never received are
  gone after the failover, and every cursor taken after them is refused on
  the new primary (`CursorAheadError` / `HistoryDivergedError`), never
  silently resumed past a gap.

The promotion runbook these tests follow (README, "Deployment: HA"): promote
the standby, then clear the `synchronous_standby_names` it inherited from the
primary (`pg_basebackup` copies postgresql.conf): with it set and no standby
of its own attached, every commit on the new primary waits forever.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from pglease import Owner, Permit, PostgresStore
from pglease.errors import (
    ConflictError,
    DatabaseUnavailableError,
    ForeignCursorError,
    WatchError,
)
from pglease.types import Claim, Event
from pglease.watch import Watcher

from . import _pgcluster
from ._pgcluster import Cluster, Node, wait_for

pytestmark = pytest.mark.timeout(120)

SCHEMA = "ha"


@pytest.fixture(scope="module", autouse=True)
def _pg15() -> None:
    if (reason := _pgcluster.skip_reason()) is not None:
        pytest.skip(reason)


@pytest.fixture
def sync_cluster() -> Iterator[Cluster]:
    with _pgcluster.cluster(synchronous=True) as made:
        yield made


@pytest.fixture
def async_cluster() -> Iterator[Cluster]:
    with _pgcluster.cluster(synchronous=False) as made:
        yield made


def open_store(cl: Cluster) -> PostgresStore:
    # Short pool and statement limits: calls during the outage fail fast
    # (DatabaseUnavailableError) and the callers retry, as a host would.
    return PostgresStore(
        cl.dsn,
        schema=SCHEMA,
        max_size=6,
        pool_timeout=3,
        connect_timeout=5,
        statement_timeout=10,
        lock_timeout=5,
    )


def finish_promotion(node: Node) -> None:
    """The runbook's second step: drop the inherited synchronous standby names.

    `ALTER SYSTEM RESET` would only remove a value set by ALTER SYSTEM; this
    one comes from the postgresql.conf pg_basebackup copied, so it has to be
    overridden with an empty value. Commits already waiting are released by
    the reload.
    """
    node.query("ALTER SYSTEM SET synchronous_standby_names = ''")
    node.query("SELECT pg_reload_conf()")
    wait_for(
        "synchronous_standby_names to be cleared",
        lambda: node.query("SHOW synchronous_standby_names") == [("",)],
        10,
    )


def log_of(node: Node) -> list[tuple[str, int, str, int | None]]:
    """The event log on `node`, in log order: (resource, revision, type, generation)."""
    return [
        (str(r[0]), int(r[1]), str(r[2]), None if r[3] is None else int(r[3]))
        for r in node.query(
            f"SELECT resource_id, revision, type, lease_generation FROM {SCHEMA}.events"
            " ORDER BY xid, id"
        )
    ]


@dataclass
class Load:
    """Claims, fenced writes and releases from threads; what callers were told."""

    store: PostgresStore
    rids: list[str]
    lock: threading.Lock = field(default_factory=threading.Lock)
    claims: list[Claim] = field(default_factory=list)
    #: Acknowledged fenced writes: (resource, revision, generation).
    writes: list[tuple[str, int, int]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    #: Anything else a call raised: a bug, reported by `finish`.
    unexpected: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, n: int) -> None:
        for i in range(n):
            t = threading.Thread(target=self._work, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def acked(self) -> int:
        with self.lock:
            return len(self.claims)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), "a load thread hung"
        assert not self.unexpected, f"unexpected errors: {self.unexpected!r}"

    def _work(self, n: int) -> None:
        owner = Owner("host", f"w{n}")
        i = 0
        while not self.stop.is_set():
            rid = self.rids[(n + i) % len(self.rids)]
            i += 1
            try:
                claim = self.store.claim(rid, owner, ttl=0.5)
                if claim is None:
                    time.sleep(0.005)
                    continue
                with self.lock:
                    self.claims.append(claim)
                result = self.store.mutate(
                    Permit(rid, claim.revision, claim), "job.step", payload={"n": n}
                )
                with self.lock:
                    self.writes.append((rid, result.revision, claim.generation))
                self.store.release(claim, expected_revision=result.revision)
            except (ConflictError, DatabaseUnavailableError) as exc:
                # Lost/expired leases, and the outage itself (outcome unknown
                # included): not acknowledged, so nothing to check for them.
                with self.lock:
                    name = type(exc).__name__
                    self.errors[name] = self.errors.get(name, 0) + 1
                time.sleep(0.02)
            except BaseException as exc:
                with self.lock:
                    self.unexpected.append(exc)
                return


def check_synchronous_failover(
    load: Load,
    log: list[tuple[str, int, str, int | None]],
    generation: dict[str, int],
    delivered: list[Event],
) -> None:
    """The invariants of a synchronous failover; AssertionError names a broken one.

    `log` is the new primary's `log_of`, `generation` its leases' generations by
    resource, `delivered` everything the watcher yielded. Also used by
    bench/patroni/run.py against a Patroni pair.
    """
    # No generation handed out twice.
    handed = [(c.resource_id, c.generation) for c in load.claims]
    twice = sorted(k for k, n in Counter(handed).items() if n > 1)
    assert not twice, f"generations acknowledged twice: {twice[:5]} ({len(twice)} in all)"

    # Every acknowledged claim survived: the lease rows are at or past it, and
    # its lease.claimed event is in the new primary's log.
    for rid, g in handed:
        assert generation[rid] >= g, f"{rid} is at generation {generation[rid]}, below {g}"
    claimed = {(rid, g) for rid, _, kind, g in log if kind == "lease.claimed"}
    assert set(handed) <= claimed, f"lost claims: {sorted(set(handed) - claimed)}"
    # Every acknowledged fenced write too, at its revision, under its generation.
    events = {(rid, rev): (kind, g) for rid, rev, kind, g in log}
    for rid, rev, g in load.writes:
        assert events.get((rid, rev)) == ("job.step", g), f"lost write: {rid} revision {rev}"

    # The watcher's stream is the new primary's log: nothing lost, nothing twice.
    assert [(e.resource_id, e.revision) for e in delivered] == [(r, v) for r, v, _, _ in log], (
        f"the watcher delivered {len(delivered)} events, not the new primary's {len(log)}"
    )


def test_synchronous_failover_keeps_every_acknowledged_claim(sync_cluster: Cluster) -> None:
    cl = sync_cluster
    with open_store(cl) as store:
        rids = [store.ensure_resource("job", f"k{i}") for i in range(4)]
        delivered: list[Event] = []
        with store.watch(after="start") as watcher:
            load = Load(store, rids)
            load.start(4)
            wait_for("40 acknowledged claims", lambda: load.acked() >= 40)
            delivered.extend(watcher.get_batch(timeout=5))

            cl.primary.crash()
            before = load.acked()
            cl.standby.promote()
            finish_promotion(cl.standby)
            # The same store object, with no help: its pool reconnects through the
            # multi-host DSN to the server that now accepts writes.
            wait_for("40 claims on the new primary", lambda: load.acked() >= before + 40, 60)
            load.finish()

            log = log_of(cl.standby)
            # The watcher carries on from its position on the new primary too.
            deadline = time.monotonic() + 30
            while len(delivered) < len(log) and time.monotonic() < deadline:
                delivered.extend(watcher.get_batch(timeout=1))
            assert watcher.health.reconnects >= 1

    generation = dict(cl.standby.query(f"SELECT resource_id, generation FROM {SCHEMA}.leases"))
    check_synchronous_failover(load, log, generation, delivered)
    # The load ran across the crash: 40 claims before it, 40 more on the new
    # primary (waited for above). Whether a call happened to be in flight at
    # the crash is timing (the store retries what certainly did not run), so
    # the errors the callers saw are not asserted on.
    assert len(load.claims) >= 80


def _write_round(store: PostgresStore, rids: list[str], owner: Owner) -> None:
    for rid in rids:
        claim = store.claim(rid, owner, ttl=60)
        assert claim is not None
        store.release(claim)


def _lose_a_round(
    cl: Cluster, store: PostgresStore, watcher: Watcher, rids: list[str], owner: Owner
) -> tuple[list[Event], list[Event]]:
    """Two rounds of claims and releases the watcher consumes; the standby of an
    asynchronous cluster gets only the first. Returns (kept, lost) events."""
    _write_round(store, rids, owner)
    kept = _drain(watcher, 2 * len(rids))
    # Wait until the standby has replayed everything so far: these survive.
    lsn = cl.primary.query("SELECT pg_current_wal_lsn()")[0][0]
    wait_for(
        "the standby to replay the first round",
        lambda: cl.standby.query("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [lsn])[0][0],
    )
    # Induce lag. Pausing replay (pg_wal_replay_pause) is not enough: a
    # promoted standby first replays all the WAL it has received (and a paused
    # one does not act on a new primary_conninfo). Stop it receiving instead,
    # as a partition would: an empty primary_conninfo stops its WAL receiver.
    cl.standby.query("ALTER SYSTEM SET primary_conninfo = ''")
    cl.standby.query("SELECT pg_reload_conf()")
    wait_for(
        "the standby to disconnect",
        lambda: not cl.primary.query("SELECT 1 FROM pg_stat_replication"),
    )
    _write_round(store, rids, owner)  # acknowledged by the primary alone
    lost = _drain(watcher, 2 * len(rids))
    cl.primary.crash()
    cl.standby.promote()  # no synchronous_standby_names to clear: asynchronous
    assert [(r, v) for r, v, _, _ in log_of(cl.standby)] == [
        (e.resource_id, e.revision) for e in kept
    ], "the standby should hold exactly the first round"
    return kept, lost


def test_asynchronous_failover_refuses_cursors_past_the_lost_events(
    async_cluster: Cluster,
) -> None:
    cl = async_cluster
    owner = Owner("host", "h1")
    with open_store(cl) as store:
        rids = [store.ensure_resource("job", f"k{i}") for i in range(3)]
        with store.watch(after="start") as watcher:
            kept, lost = _lose_a_round(cl, store, watcher, rids, owner)

    with open_store(cl) as store:
        # Right after the failover (the lost xids were never assigned here) and
        # after the new primary wrote events of its own (those xids reused).
        _refused_everywhere(store, lost)
        assert store.events_after(kept[-1].cursor) == []  # what it did receive resumes
        _write_round(store, rids, owner)
        _refused_everywhere(store, lost)
        after_kept = store.events_after(kept[-1].cursor)
        assert [(e.resource_id, e.revision) for e in after_kept] == [
            (rid, rev) for rid in rids for rev in (3, 4)
        ]


def test_live_watcher_across_an_asynchronous_failover_never_skips_silently(
    async_cluster: Cluster,
) -> None:
    cl = async_cluster
    owner = Owner("host", "h1")
    with open_store(cl) as store:
        rids = [store.ensure_resource("job", f"k{i}") for i in range(3)]
        with store.watch(after="start") as watcher:
            kept, _ = _lose_a_round(cl, store, watcher, rids, owner)
            for _ in range(3):
                _write_round(store, rids, owner)
            expected = [(r, v) for r, v, _, _ in log_of(cl.standby)][len(kept) :]
            got: list[tuple[str, int]] = []
            try:
                deadline = time.monotonic() + 3
                while len(got) < len(expected) and time.monotonic() < deadline:
                    got.extend((e.resource_id, e.revision) for e in watcher.get_batch(timeout=1))
            except WatchError:
                return  # refusing to go on is fine: the consumer knows to resync
    # Otherwise it must deliver the new primary's log after what it had, whole.
    assert got == expected


def _refused_everywhere(store: PostgresStore, lost: list[Event]) -> None:
    """Each lost event's cursor is refused by `events_after` and by a new watcher."""
    for event in lost:
        with pytest.raises(ForeignCursorError) as raised:
            store.events_after(event.cursor)
        kinds.add(type(raised.value).__name__)
        with pytest.raises(ForeignCursorError) as raised:
            store.watch(after=event.cursor).close()
        kinds.add(type(raised.value).__name__)


#: Which refusals the asynchronous test met (CursorAheadError, HistoryDivergedError).
kinds: set[str] = set()


def _drain(watcher: Watcher, n: int) -> list[Event]:
    """The next `n` events of a watcher, within a deadline."""
    got: list[Event] = []
    deadline = time.monotonic() + 20
    while len(got) < n and time.monotonic() < deadline:
        got.extend(watcher.get_batch(timeout=1))
    assert len(got) == n, f"watcher delivered {len(got)} of {n} events"
    return got
