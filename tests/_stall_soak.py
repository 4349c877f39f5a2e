"""Soak under stalls (issue 31): hosts each behind their own fault-injecting
proxy, partitions inside and outside transactions, heals by resume and by
reset, whole-server outages; an independent reader of the raw tables judges
the run.

The engine behind ``bench/stall_soak.py`` and ``tests/test_stall_soak.py``.
`run_soak` drives one run:

* every host is a process (`host_main`) that reaches PostgreSQL only through
  its own `StallProxy` (tests/_stall_proxy.py). It runs `hold()` holders that
  make fenced `mutate` writes (a counter row and one row per write, in the
  user's own tables), a worker on the raw claim/renew/release API that writes
  too, a prober (`get` every 0.2 s) and a watcher on every soak event. It
  logs every call (start, duration, its bound, its outcome), every write it
  was told was acknowledged, not committed or of unknown outcome, every loss
  it learned of and every event its watcher received, to one JSON-lines file;
* the chaos driver pauses one host's proxy at a time (sometimes right while
  that host is inside a fenced transaction), for up to three ttls, and heals
  it by resuming (the held bytes flow on) or by resetting every connection;
  at evenly spaced times it takes the whole server away from every host: all
  proxies paused (a hung server) or refusing and reset (a server that is
  down), then healed;
* at the end every path is healed, the hosts stop (holders release, watchers
  drain) and `check` reads the raw tables over a direct connection: the lease
  audit (a trigger's copy of every lease-row change, so silent heartbeat
  extensions are on record), the events table and the written rows.

Violations (`SoakReport.violations`, each one line): two holders of one
resource at once by the database's generations and expiries; a generation
going down; a holder whose trust window (or its acting on the lease) ran past
the next generation's claim; an acknowledged write missing; a write by a generation that was
not the live one (by the audit, and by the counter's sequence); a write
without its event or an event without its write; a write reported as "nothing
was committed" present in the table; a revision gap; a watcher that missed,
repeated or reordered an event; a raw driver error that escaped pglease; a
host that crashed or did not stop.

Figures (`SoakReport.figures`, measured, never asserted): the longest call of
each kind against its bound and how many went over, hold entries against
their timeout, leases handed out already lost, time to learn of a loss (the
keeper under `hold`, and the raw renew loop), time back after a heal and
after an outage (the first successful call that ends after it), how soon a
watcher's health showed a stall.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import json
import multiprocessing
import os
import random
import statistics
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from pglease import Owner, Permit, PostgresStore
from pglease.errors import (
    AcquireTimeoutError,
    CommitOutcomeUnknownError,
    DatabaseUnavailableError,
    LeaseLostError,
    LockTimeoutError,
    PgleaseError,
    StaleResourceError,
    StatementTimeoutError,
    WatchFailedError,
)
from pglease.postgres._core import CLIENT_GRACE
from pglease.runtime import hold
from pglease.runtime._acquire_core import STEP_GRACE

from ._stall_proxy import StallProxy

T = TypeVar("T")

SOAK_TYPE = "soak"
RAW_TYPE = "soakraw"
WRITE_EVENT = "soak.write"
#: A hold entry counts as over its timeout past timeout + this (scheduling).
HOLD_SLACK = 0.25
#: Converting a monotonic instant to Unix time, and the server's clock read
#: later in its transaction, may differ by this much (the same machine's clock).
BELIEF_SLACK = 0.05
#: Scheduling slack of a store call against its bound.
CALL_SLACK = 0.05
#: Seconds between a partition's heal and the next outage.
OUTAGE_CLEARANCE = 3.0
#: The soak watchers' stall_timeout: short, so a partition of a few seconds
#: must show in their health (issue 31 item 7).
WATCH_STALL = 1.0
#: Errors whose message says nothing was committed: such a write must be absent.
_NOTHING_COMMITTED = (LeaseLostError, StaleResourceError, LockTimeoutError, StatementTimeoutError)


@dataclass(frozen=True)
class Settings:
    """One run's shape and the stores' limits (seconds)."""

    hosts: int = 3
    holders: int = 2
    keys: int = 3
    raw_keys: int = 2
    seconds: float = 60.0
    outages: int = 1
    outage_seconds: float = 10.0
    seed: int = 1
    ttl: float = 2.5
    hold_timeout: float = 3.0
    statement_timeout: float = 2.0
    lock_timeout: float = 1.0
    connect_timeout: float = 2.0
    pool_timeout: float = 4.0
    #: Partition lengths are drawn from [min, max]; gaps between them too.
    partition_min: float = 0.5
    partition_max: float = 7.5
    gap_min: float = 0.3
    gap_max: float = 1.5
    #: Share of partitions aimed at a moment a host is inside a fenced transaction.
    in_transaction: float = 0.4

    @property
    def store_bound(self) -> float:
        """What a store call may take: its connection (pool_timeout, itself
        bounded by connect_timeout once item 6 holds) then one round trip
        bounded by statement_timeout plus the client's grace."""
        return max(self.pool_timeout, self.connect_timeout) + self.statement_timeout + CLIENT_GRACE


# =========================================================================== host


class _Log:
    """One host's JSON-lines log, shared by its threads."""

    def __init__(self, path: Path) -> None:
        self._out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def __call__(self, *record: object) -> None:
        line = json.dumps(record, default=str)
        with self._lock:
            self._out.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._out.close()


def _outcome(exc: BaseException) -> str:
    return type(exc).__name__


class _Host:
    def __init__(self, index: int, settings: Settings, dsn: str, schema: str, log: _Log,
                 intx: Any, stop: Any) -> None:  # fmt: skip
        self.index = index
        self.s = settings
        self.dsn = dsn
        self.schema = schema
        self.log = log
        self.intx = intx  # shared array: when this host entered a fenced transaction, or 0
        self.stop = stop
        self.store: PostgresStore | None = None
        self.writes = 0
        q = f'"{schema}"'
        self.bump = (
            f"INSERT INTO {q}.soak_counters AS c (resource_id, value, generation)"
            " VALUES (%s, 1, %s) ON CONFLICT (resource_id) DO UPDATE"
            " SET value = c.value + 1, generation = EXCLUDED.generation RETURNING value"
        ).encode()
        self.insert = (
            f"INSERT INTO {q}.soak_writes (write_id, resource_id, seq, revision, generation, host)"
            f" SELECT %s, %s, %s, coalesce(l.revision, r.revision), %s, %s FROM {q}.leases l"
            f" JOIN {q}.resources r ON r.id = l.resource_id WHERE l.resource_id = %s"
        ).encode()

    # ------------------------------------------------------------ call records

    def call(self, name: str, bound: float, fn: Callable[[], T]) -> T:
        started = time.monotonic()
        try:
            result = fn()
        except BaseException as exc:
            self.log("call", name, started, time.monotonic() - started, bound, _outcome(exc))
            if not isinstance(exc, PgleaseError):
                self.log("escaped", name, started, repr(exc))
            raise
        self.log("call", name, started, time.monotonic() - started, bound, "ok")
        return result

    def belief(self, rid: str, generation: int, trusted_until: float) -> None:
        """The last instant this holder could act on its lease (its trust window's
        close, or now if it stops earlier), as Unix time: the server's clock is
        this machine's, so the checker compares it with the next claim's."""
        last = min(trusted_until, time.monotonic())
        self.log("belief", rid, generation, last + time.time() - time.monotonic())

    def guarded(self, name: str, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            while not self.stop.is_set():
                try:
                    body()
                    return
                except Exception as exc:  # recorded (a violation), then the worker goes on
                    self.log("crash", name, time.monotonic(), repr(exc), traceback.format_exc())
                    time.sleep(0.5)

        return run

    # ---------------------------------------------------------------- writes

    def write(self, name: str, permit: Permit, rid: str, generation: int) -> int | None:
        """One fenced write; the new revision, or None when the lease is done for."""
        assert self.store is not None
        self.writes += 1
        wid = f"h{self.index}-{os.getpid()}-{name}-{self.writes}"
        rnd_hold = random.random() * 0.3

        def apply(conn: psycopg.Connection[Any]) -> None:
            # Inside the transaction, the lease row locked: the driver may pick
            # this moment for a partition.
            self.intx[self.index] = time.monotonic()
            row = conn.execute(self.bump, [rid, generation]).fetchone()
            assert row is not None
            conn.execute(self.insert, [wid, rid, row[0], generation, f"h{self.index}", rid])
            time.sleep(rnd_hold)

        try:
            result = self.call(
                "mutate",
                self.s.store_bound,
                lambda: self.store.mutate(permit, WRITE_EVENT, apply),  # type: ignore[union-attr]
            )
        except CommitOutcomeUnknownError:
            self.log("unknown", wid, rid, generation)
            return None
        except (DatabaseUnavailableError, *_NOTHING_COMMITTED) as exc:
            self.log("nocommit", wid, rid, generation, _outcome(exc))
            return None
        except PgleaseError:
            self.log("unknown", wid, rid, generation)
            return None
        except psycopg.Error:
            self.log("unknown", wid, rid, generation)
            return None
        finally:
            self.intx[self.index] = 0.0
        self.log("ack", wid, rid, generation)
        return result.revision

    # ---------------------------------------------------------------- workers

    def holder(self, w: int) -> None:
        rnd = random.Random(f"{self.s.seed}/{self.index}/{w}")
        owner = Owner("host", f"h{self.index}.{w}")
        store = self.store
        assert store is not None
        while not self.stop.is_set():
            key = f"k{rnd.randrange(self.s.keys)}"
            started = time.monotonic()
            entered = False
            try:
                with hold(store, SOAK_TYPE, key, owner, self.s.ttl,
                          timeout=self.s.hold_timeout) as lease:  # fmt: skip
                    entered = True
                    took = time.monotonic() - started
                    rid, gen = lease.resource_id, lease.generation
                    handed_lost = lease.lost_error is not None or lease.time_left() <= 0
                    self.log("hold", started, took, self.s.hold_timeout, "ok", rid, gen,
                             handed_lost)  # fmt: skip

                    def noticed(error: LeaseLostError, r: str = rid, g: int = gen,
                                held: Any = lease) -> None:  # fmt: skip
                        # With the trust window's close: how late the news came.
                        self.log("lost", time.monotonic(), r, g, str(error)[:200], held.deadline)

                    lease.on_lost(noticed)
                    revision = lease.claim.revision
                    for _ in range(rnd.randint(1, 6)):
                        if self.stop.is_set():
                            break
                        time.sleep(rnd.random() * self.s.ttl / 4)
                        try:
                            permit = lease.permit(revision)
                        except LeaseLostError:
                            break
                        new = self.write(f"w{w}", permit, rid, gen)
                        if new is None:
                            break
                        revision = new
                    self.belief(rid, gen, lease.trusted_until)
            except PgleaseError as exc:
                if not entered:
                    took = time.monotonic() - started
                    self.log("hold", started, took, self.s.hold_timeout, _outcome(exc), None,
                             None, False)  # fmt: skip
                    if not isinstance(exc, AcquireTimeoutError):
                        time.sleep(0.25)
            except psycopg.Error as exc:
                self.log("escaped", "hold", started, repr(exc))
                time.sleep(0.1)

    def raw(self) -> None:
        """claim, then renew and write until released or lost, by hand."""
        rnd = random.Random(f"{self.s.seed}/{self.index}/raw")
        owner = Owner("host", f"h{self.index}.raw")
        store = self.store
        assert store is not None
        ttl, margin = self.s.ttl, self.s.ttl / 10
        rids = [store.ensure_resource(RAW_TYPE, f"r{i}") for i in range(self.s.raw_keys)]
        while not self.stop.is_set():
            rid = rnd.choice(rids)
            sent = time.monotonic()
            try:
                claim = self.call(
                    "claim",
                    self.s.store_bound,
                    lambda r=rid: store.claim(r, owner, ttl),  # type: ignore[misc]
                )
            except (PgleaseError, psycopg.Error):
                time.sleep(0.2)
                continue
            if claim is None:
                time.sleep(rnd.random() * ttl / 3)
                continue
            trusted = sent + ttl - margin
            self.log("raw_acq", time.monotonic(), rid, claim.generation, trusted)
            revision = claim.revision
            lost = False
            for _ in range(rnd.randint(2, 8)):
                if self.stop.is_set():
                    break
                time.sleep(ttl / 3)
                sent = time.monotonic()
                if sent >= trusted:
                    lost = True
                    self.log("raw_lost", sent, rid, claim.generation, "trust window closed")
                    break
                # A renew gives up when the claim's own trust window closes
                # (`Claim.trusted_until`: its request's start plus the ttl);
                # this worker stops trusting the lease a margin sooner.
                window = claim.trusted_until
                assert window is not None
                bound = min(self.s.store_bound, window - sent)
                try:
                    renewed = self.call(
                        "renew",
                        bound,
                        lambda c=claim: store.renew(c, ttl),  # type: ignore[misc]
                    )
                except LeaseLostError as exc:
                    lost = True
                    self.log("raw_lost", time.monotonic(), rid, claim.generation, _outcome(exc))
                    break
                except (PgleaseError, psycopg.Error) as exc:
                    now = time.monotonic()
                    if now >= trusted:
                        lost = True
                        self.log("raw_lost", now, rid, claim.generation, _outcome(exc))
                        break
                    continue
                if time.monotonic() >= trusted:
                    # The answer came after the window closed: not to be trusted.
                    lost = True
                    self.log("raw_lost", time.monotonic(), rid, claim.generation, "late answer")
                    break
                claim, trusted = renewed, sent + ttl - margin
                revision = max(revision, renewed.revision)
                new = self.write("raw", Permit(rid, revision, claim), rid, claim.generation)
                if new is None:
                    lost = True
                    self.log("raw_lost", time.monotonic(), rid, claim.generation, "write refused")
                    break
                revision = new
            self.belief(rid, claim.generation, trusted)
            if not lost:
                with contextlib.suppress(PgleaseError, psycopg.Error):
                    self.call("release", self.s.store_bound, lambda c=claim: store.release(c))  # type: ignore[misc]
            time.sleep(rnd.random() * 0.2)

    def probe(self) -> None:
        store = self.store
        assert store is not None
        rid = store.ensure_resource("soakprobe", f"h{self.index}")
        while not self.stop.is_set():
            with contextlib.suppress(PgleaseError, psycopg.Error):
                self.call("get", self.s.store_bound, lambda: store.get(rid))
            time.sleep(0.2)

    def watcher(self) -> None:
        """Every soak event, in order; restarted from its cursor when it gives up."""
        store = self.store
        assert store is not None
        cursor = "start"
        quiet_since: float | None = None
        while True:
            try:
                watcher = store.watch(after=cursor, types=SOAK_TYPE, stall_timeout=WATCH_STALL)
            except (PgleaseError, psycopg.Error) as exc:
                self.log("wfail", time.monotonic(), _outcome(exc), str(exc)[:200])
                time.sleep(0.5)
                continue
            healthy = [True]
            done = threading.Event()

            def watch_health(w: Any = watcher, h: list[bool] = healthy,
                             d: threading.Event = done) -> None:  # fmt: skip
                while not d.wait(0.1):
                    now = w.health.healthy
                    if now != h[0]:
                        h[0] = now
                        self.log("whealth", time.monotonic(), now, w.health.last_error)

            monitor = threading.Thread(target=watch_health, daemon=True)
            monitor.start()
            try:
                while True:
                    try:
                        event = watcher.get(timeout=0.5)
                    except WatchFailedError as exc:
                        self.log("wfail", time.monotonic(), _outcome(exc), str(exc)[:200])
                        break
                    if event is None:
                        if self.stop.is_set():
                            # Writers are done: drain until the log stays quiet.
                            quiet_since = quiet_since or time.monotonic()
                            if time.monotonic() - quiet_since > 3.0:
                                return
                        continue
                    quiet_since = None
                    cursor = event.cursor
                    self.log("ev", event.id, event.resource_id, event.revision)
            finally:
                done.set()
                watcher.close()

    # ------------------------------------------------------------------ main

    def run(self, ready: Any) -> None:
        while self.store is None:
            try:
                self.store = PostgresStore(
                    self.dsn, schema=self.schema, auto_migrate=False, min_size=2,
                    max_size=self.s.holders + 4, statement_timeout=self.s.statement_timeout,
                    lock_timeout=self.s.lock_timeout, connect_timeout=self.s.connect_timeout,
                    pool_timeout=self.s.pool_timeout,
                )  # fmt: skip
            except PgleaseError:
                time.sleep(0.2)
        workers = [
            threading.Thread(target=self.guarded(f"holder{w}", functools.partial(self.holder, w)),
                             daemon=True)
            for w in range(self.s.holders)
        ]  # fmt: skip
        workers.append(threading.Thread(target=self.guarded("raw", self.raw), daemon=True))
        workers.append(threading.Thread(target=self.guarded("probe", self.probe), daemon=True))
        watcher = threading.Thread(target=self.guarded("watcher", self.watcher), daemon=True)
        watcher.start()
        for t in workers:
            t.start()
        ready[self.index] = 1
        self.stop.wait()
        for t in workers:
            t.join(60)
            if t.is_alive():
                self.log("stuck", time.monotonic(), t.name)
        watcher.join(90)
        if watcher.is_alive():
            self.log("stuck", time.monotonic(), "watcher")
        self.log("done", time.monotonic())
        self.store.close()


def host_main(index: int, settings: dict[str, Any], dsn: str, schema: str, log_path: str,
              intx: Any, ready: Any, stop: Any) -> None:  # fmt: skip
    """One host process (multiprocessing target). Its stderr (pglease's own
    log lines: heartbeats failing, leases lost) goes to a file beside its log."""
    with open(Path(log_path).with_suffix(".stderr"), "ab") as err:
        os.dup2(err.fileno(), 2)
    log = _Log(Path(log_path))
    try:
        _Host(index, Settings(**settings), dsn, schema, log, intx, stop).run(ready)
    except BaseException as exc:
        log("crash", "host", time.monotonic(), repr(exc), traceback.format_exc())
        raise
    finally:
        log.close()


# =========================================================================== setup


def setup(dsn: str, schema: str) -> None:
    """Migrate, and add the user's tables and the lease audit trigger."""
    PostgresStore(dsn, schema=schema, max_size=1).close()
    s = f'"{schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.soak_counters (resource_id text PRIMARY KEY,"
            " value bigint NOT NULL, generation bigint NOT NULL)"
        )
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.soak_writes (write_id text PRIMARY KEY,"
            " resource_id text NOT NULL, seq bigint NOT NULL, revision bigint NOT NULL,"
            " generation bigint NOT NULL, host text NOT NULL,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.soak_lease_audit (id bigserial PRIMARY KEY,"
            " resource_id text, generation bigint, owner_id text, expires_at timestamptz,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.execute(
            f"CREATE OR REPLACE FUNCTION {s}.soak_audit() RETURNS trigger LANGUAGE plpgsql AS $$"
            f" BEGIN INSERT INTO {s}.soak_lease_audit (resource_id, generation, owner_id,"
            " expires_at) VALUES (NEW.resource_id, NEW.generation, NEW.owner_id, NEW.expires_at);"
            " RETURN NEW; END $$"
        )
        conn.execute(
            f"CREATE OR REPLACE TRIGGER soak_audit AFTER INSERT OR UPDATE ON {s}.leases"
            f" FOR EACH ROW EXECUTE FUNCTION {s}.soak_audit()"
        )


# =========================================================================== checker


@dataclass
class Tables:
    """What the checker reads: the raw tables, over a direct connection."""

    #: (resource_id, generation, owner_id, expires_at, at) in audit order.
    audit: list[tuple[Any, ...]]
    #: (write_id, resource_id, seq, revision, generation, at).
    writes: list[tuple[Any, ...]]
    #: resource_id -> (value, generation).
    counters: dict[str, tuple[int, int]]
    #: (id, resource_id, revision, type, lease_generation) of every event of the
    #: watched types, in log order (xid, id).
    events: list[tuple[Any, ...]]


def read_tables(dsn: str, schema: str) -> Tables:
    s = f'"{schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        audit = conn.execute(
            f"SELECT resource_id, generation, owner_id, expires_at, at"
            f" FROM {s}.soak_lease_audit ORDER BY id"
        ).fetchall()
        writes = conn.execute(
            f"SELECT write_id, resource_id, seq, revision, generation, at FROM {s}.soak_writes"
        ).fetchall()
        counters = {
            r[0]: (int(r[1]), int(r[2]))
            for r in conn.execute(f"SELECT resource_id, value, generation FROM {s}.soak_counters")
        }
        events = conn.execute(
            f"SELECT e.id, e.resource_id, e.revision, e.type, e.lease_generation"
            f" FROM {s}.events e JOIN {s}.resources r ON r.id = e.resource_id"
            f" WHERE r.type IN ('{SOAK_TYPE}', '{RAW_TYPE}') ORDER BY e.xid, e.id"
        ).fetchall()
    return Tables(list(audit), list(writes), counters, list(events))


def read_log(path: Path) -> list[list[Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def check(tables: Tables, logs: list[list[list[Any]]]) -> list[str]:
    """Every violation the tables and the hosts' logs show (empty: none)."""
    v: list[str] = []
    # --- no two holders; generations never go down (the audit) ---------------
    by_rid: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in tables.audit:
        by_rid[row[0]].append(row)
    for rid, rows in by_rid.items():
        prev = None
        for row in rows:
            if prev is not None and row[1] < prev[1]:
                v.append(f"{rid}: generation went down {prev[1]} -> {row[1]} at {row[4]}")
            if (prev is not None and row[1] != prev[1] and prev[2] is not None
                    and prev[3] is not None and prev[3] > row[4]):  # fmt: skip
                v.append(f"{rid}: generation {row[1]} claimed at {row[4]} while generation"
                         f" {prev[1]} held it to {prev[3]}")  # fmt: skip
            prev = row
    # --- no holder acted on its lease after the next generation's claim ----
    next_claim: dict[tuple[str, int], float] = {}
    for rid, rows in by_rid.items():
        for row in rows:
            for g in range(row[1] - 1, 0, -1):
                if (rid, g) in next_claim:
                    break
                next_claim[(rid, g)] = row[4].timestamp()
    # --- the event log: revisions gap-free, one event per write --------------
    ev_by_rid: dict[str, dict[int, tuple[Any, ...]]] = defaultdict(dict)
    for ev in tables.events:
        ev_by_rid[ev[1]][ev[2]] = ev
    for rid, revs in ev_by_rid.items():
        if sorted(revs) != list(range(1, len(revs) + 1)):
            v.append(f"{rid}: event revisions are not 1..{len(revs)}")
    # --- every write under the live generation, with its event ----------------
    audit_at = {rid: [row[4] for row in rows] for rid, rows in by_rid.items()}
    writes_by_rid: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for wid, rid, seq, revision, generation, at in tables.writes:
        writes_by_rid[rid].append((seq, generation, wid))
        found = ev_by_rid.get(rid, {}).get(revision)
        if found is None or found[3] != WRITE_EVENT or found[4] != generation:
            v.append(f"write {wid}: no {WRITE_EVENT} event of generation {generation} at"
                     f" revision {revision}")  # fmt: skip
        i = bisect.bisect_right(audit_at.get(rid, []), at) - 1
        state = by_rid[rid][i] if i >= 0 else None
        if state is None or state[1] != generation or state[2] is None or state[3] <= at:
            v.append(f"stale write {wid} of generation {generation} at {at}: the lease was"
                     f" {state and (state[1], state[2], state[3])}")  # fmt: skip
    write_events: dict[str, int] = defaultdict(int)
    for ev in tables.events:
        if ev[3] == WRITE_EVENT:
            write_events[ev[1]] += 1
    for rid in set(write_events) | set(writes_by_rid):
        rows = sorted(writes_by_rid.get(rid, []))
        if write_events[rid] != len(rows):
            v.append(f"{rid}: {write_events[rid]} {WRITE_EVENT} events for {len(rows)} writes")
        if [r[0] for r in rows] != list(range(1, len(rows) + 1)):
            v.append(f"{rid}: the counter's writes are not numbered 1..{len(rows)} (a lost update)")
        value = tables.counters.get(rid, (0, 0))[0]
        if value != len(rows):
            v.append(f"{rid}: counter is {value} after {len(rows)} writes")
        for a, b in itertools.pairwise(rows):
            if b[1] < a[1]:
                v.append(f"stale write {b[2]}: generation {b[1]} after {a[1]} (seq {b[0]})")
    # --- what the hosts were told -----------------------------------------------
    stored = {w[0] for w in tables.writes}
    expected = [ev[0] for ev in tables.events if _watched(ev)]
    for h, records in enumerate(logs):
        received: list[tuple[int, str, int]] = []
        done = False
        for rec in records:
            kind = rec[0]
            if kind == "ack" and rec[1] not in stored:
                v.append(f"host {h}: acknowledged write {rec[1]} is missing")
            elif kind == "nocommit" and rec[1] in stored:
                v.append(f"host {h}: write {rec[1]} was reported as not committed ({rec[4]})"
                         " but is in the table")  # fmt: skip
            elif kind == "ev":
                received.append((rec[1], rec[2], rec[3]))
            elif kind == "belief":
                taken = next_claim.get((rec[1], rec[2]))
                if taken is not None and rec[3] > taken + BELIEF_SLACK:
                    v.append(f"host {h}: trusted generation {rec[2]} of {rec[1]} until"
                             f" {rec[3]:.3f}, {rec[3] - taken:.3f} s after generation"
                             f" {rec[2] + 1} was claimed")  # fmt: skip
            elif kind == "escaped":
                v.append(f"host {h}: a raw error escaped {rec[1]}: {rec[3]}")
            elif kind == "crash":
                v.append(f"host {h}: {rec[1]} crashed: {rec[3]}")
            elif kind == "stuck":
                v.append(f"host {h}: {rec[2]} did not stop")
            elif kind == "done":
                done = True
        if not done:
            v.append(f"host {h}: did not finish")
        v.extend(f"host {h} watcher: {x}" for x in _watch_violations(received, expected))
    return v


def _watched(ev: tuple[Any, ...]) -> bool:
    return str(ev[1]).startswith(SOAK_TYPE + "-")


def _watch_violations(received: list[tuple[int, str, int]], expected: list[int]) -> list[str]:
    v = []
    ids = [r[0] for r in received]
    dups = len(ids) - len(set(ids))
    if dups:
        v.append(f"{dups} events received twice")
    missing = set(expected) - set(ids)
    if missing:
        v.append(f"missed {len(missing)} events, e.g. {sorted(missing)[:5]}")
    extra = set(ids) - set(expected)
    if extra:
        v.append(f"received {len(extra)} events not in the log, e.g. {sorted(extra)[:5]}")
    last: dict[str, int] = {}
    for _, rid, revision in received:
        if rid in last and revision <= last[rid]:
            v.append(f"{rid}: revision {revision} after {last[rid]}")
            break
        last[rid] = revision
    if not v and ids != expected:
        v.append("events received in another order than the log's")
    return v


# =========================================================================== figures


@dataclass
class Partition:
    host: int  # -1: every host (an outage)
    start: float
    end: float
    heal: str  # resume | reset | accept
    in_transaction: bool = False
    kind: str = "partition"  # partition | outage-pause | outage-refuse


@dataclass
class SoakReport:
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 2),
            "max": round(max(values), 2)}  # fmt: skip


def figures(settings: Settings, logs: list[list[list[Any]]], chaos: list[Partition],
            tables: Tables) -> dict[str, Any]:  # fmt: skip
    """The run's measurements (see the module docstring)."""
    f: dict[str, Any] = {}
    parts = [p for p in chaos if p.kind == "partition"]
    outages = [p for p in chaos if p.kind != "partition"]
    f["partitions"] = len(parts)
    f["partitions_in_transaction"] = sum(p.in_transaction for p in parts)
    f["healed_by_reset"] = sum(p.heal == "reset" for p in parts)
    f["outages"] = [{"kind": p.kind, "seconds": round(p.end - p.start, 1)} for p in outages]
    acked = sum(1 for records in logs for r in records if r[0] == "ack")
    stored = {w[0] for w in tables.writes}
    f["acknowledged_writes"] = acked
    f["writes_in_table"] = len(tables.writes)
    f["lost_acknowledged"] = sum(
        1 for records in logs for r in records if r[0] == "ack" and r[1] not in stored
    )
    f["reported_not_committed"] = sum(1 for rs in logs for r in rs if r[0] == "nocommit")
    f["reported_outcome_unknown"] = sum(1 for rs in logs for r in rs if r[0] == "unknown")
    f["outcome_unknown_that_committed"] = sum(
        1 for rs in logs for r in rs if r[0] == "unknown" and r[1] in stored
    )
    f["events"] = len(tables.events)
    # Calls against their bounds.
    calls: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for records in logs:
        for r in records:
            if r[0] == "call":
                calls[r[1]].append((r[3], r[4], r[5]))
    f["calls"] = {
        name: {"n": len(rows), "longest": round(max(d for d, _, _ in rows), 2),
               "bound": round(max(b for _, b, _ in rows), 2) if name != "renew" else
               "min(store bound, claim.trusted_until - start)",
               "over_bound": sum(d > b + CALL_SLACK for d, b, _ in rows),
               "errors": sum(o != "ok" for _, _, o in rows),
               "by_outcome": dict(sorted(Counter(o for _, _, o in rows).items()))}
        for name, rows in sorted(calls.items())
    }  # fmt: skip
    holds = [r for rs in logs for r in rs if r[0] == "hold"]
    f["hold_entries"] = {
        "n": len(holds),
        "timeout": settings.hold_timeout,
        "longest": round(max((r[2] for r in holds), default=0.0), 2),
        # Scheduling slack: a timeout that fires a little late is not counted.
        "over_timeout": sum(r[2] > r[3] + HOLD_SLACK for r in holds),
        # The documented bound: the timeout plus one step's grace.
        "over_documented_bound": sum(r[2] > r[3] + STEP_GRACE + HOLD_SLACK for r in holds),
        "granted": sum(r[4] == "ok" for r in holds),
        "handed_out_already_lost": sum(bool(r[7]) for r in holds),
        "by_outcome": dict(sorted(Counter(r[4] for r in holds).items())),
    }
    # Time to learn of a loss: losses a partitioned host noticed, from the
    # partition's start (leases it held when cut off).
    keeper: list[float] = []
    raw: list[float] = []
    acquired: list[dict[tuple[str, int], float]] = []
    for records in logs:
        acquired.append({(r[5], r[6]): r[1] + r[2] for r in records if r[0] == "hold" and r[5]})
        acquired[-1].update({(r[2], r[3]): r[1] for r in records if r[0] == "raw_acq"})
    for p in chaos:
        hosts = range(len(logs)) if p.host < 0 else [p.host]
        for h in hosts:
            for r in logs[h]:
                if (r[0] in ("lost", "raw_lost") and p.start <= r[1] <= p.end + settings.ttl
                        and acquired[h].get((r[2], r[3]), p.start) < p.start):  # fmt: skip
                    (keeper if r[0] == "lost" else raw).append(r[1] - p.start)
    f["learn_of_loss_hold"] = _spread(keeper)
    f["learn_of_loss_raw"] = _spread(raw)
    f["ttl"] = settings.ttl
    # Time back: the first successful call that ends after the heal.
    ends: list[list[float]] = []
    fresh: list[list[tuple[float, float]]] = []  # (start, end) of successful calls
    for records in logs:
        ok = [(r[2], r[2] + r[3]) for r in records if r[0] == "call" and r[5] == "ok"]
        ends.append(sorted(e for _, e in ok))
        fresh.append(sorted(ok))

    def back(h: int, at: float) -> float | None:
        i = bisect.bisect_right(ends[h], at)
        return ends[h][i] - at if i < len(ends[h]) else None

    def back_new(h: int, at: float) -> float | None:
        """The first successful call started after `at`: a new call's way back
        (a reconnect, the pool's back-off), not a stalled call flowing on."""
        i = bisect.bisect_right(fresh[h], (at, at))
        later = [e for _, e in fresh[h][i : i + 200]]
        return min(later) - at if later else None

    after_heal = {"resume": [], "reset": []}  # type: dict[str, list[float]]
    for p in parts:
        b = back(p.host, p.end)
        if b is not None:
            after_heal[p.heal].append(b)
    f["back_after_heal"] = {k: _spread(x) for k, x in after_heal.items()}
    new_call = {"resume": [], "reset": []}  # type: dict[str, list[float]]
    for p in parts:
        b = back_new(p.host, p.end)
        if b is not None:
            new_call[p.heal].append(b)
    f["back_after_heal_new_call"] = {k: _spread(x) for k, x in new_call.items()}
    f["back_after_outage"] = [
        {"kind": p.kind, **_spread([b for h in range(len(logs))
                                    if (b := back(h, p.end)) is not None])}
        for p in outages
    ]  # fmt: skip
    f["back_after_outage_new_call"] = [
        {"kind": p.kind, **_spread([b for h in range(len(logs))
                                    if (b := back_new(h, p.end)) is not None])}
        for p in outages
    ]  # fmt: skip
    f["partition_seconds"] = _spread([p.end - p.start for p in parts])
    # How soon a watcher's health showed a partition longer than 3 s (its
    # stall bound is min(interval, WATCH_STALL) + WATCH_STALL, under 3 s).
    seen, silent = [], 0
    for p in parts:
        if p.end - p.start < 3.0:
            continue
        turns = [r[1] - p.start for r in logs[p.host]
                 if r[0] == "whealth" and not r[2] and p.start <= r[1] <= p.end]  # fmt: skip
        if turns:
            seen.append(min(turns))
        else:
            silent += 1
    f["watcher_unhealthy_in_partition"] = {**_spread(seen), "stayed_healthy": silent}
    f["watcher_restarts"] = sum(1 for rs in logs for r in rs if r[0] == "wfail")
    return f


# =========================================================================== driver


def _spawn_hosts(ctx: Any, settings: Settings, proxies: list[StallProxy], schema: str,
                 workdir: Path, intx: Any, ready: Any, stop: Any) -> list[Any]:  # fmt: skip
    procs = []
    for i, proxy in enumerate(proxies):
        p = ctx.Process(
            target=host_main, name=f"soak-host{i}", daemon=True,
            args=(i, asdict(settings), proxy.dsn, schema, str(workdir / f"host{i}.jsonl"),
                  intx, ready, stop),
        )  # fmt: skip
        p.start()
        procs.append(p)
    return procs


def run_soak(dsn: str, schema: str, workdir: Path, settings: Settings,
             progress: Callable[[str], None] | None = None) -> SoakReport:  # fmt: skip
    """One run: hosts, chaos for `settings.seconds`, then stop and judge."""
    say = progress or (lambda _msg: None)
    rnd = random.Random(settings.seed)
    setup(dsn, schema)
    ctx = multiprocessing.get_context("spawn")
    intx = ctx.Array("d", settings.hosts, lock=False)
    ready = ctx.Array("i", settings.hosts, lock=False)
    stop = ctx.Event()
    proxies = [StallProxy(dsn) for _ in range(settings.hosts)]
    chaos: list[Partition] = []
    procs: list[Any] = []
    try:
        procs = _spawn_hosts(ctx, settings, proxies, schema, workdir, intx, ready, stop)
        deadline = time.monotonic() + 120
        while sum(ready) < settings.hosts:
            if time.monotonic() > deadline or any(not p.is_alive() for p in procs):
                raise RuntimeError(f"hosts did not start (see {workdir})")
            time.sleep(0.1)
        say(f"{settings.hosts} hosts up; chaos for {settings.seconds:g} s")
        start = time.monotonic()
        end = start + settings.seconds
        outage_at = [start + settings.seconds * (k + 1) / (settings.outages + 1)
                     for k in range(settings.outages)]  # fmt: skip
        while time.monotonic() < end:
            if outage_at and time.monotonic() >= outage_at[0]:
                outage_at.pop(0)
                # The server down first, then a hung server, and so on.
                done = settings.outages - len(outage_at) - 1
                kind = "outage-pause" if done % 2 else "outage-refuse"
                chaos.append(_outage(proxies, kind, settings.outage_seconds))
                say(f"{kind} for {settings.outage_seconds:g} s")
                continue
            time.sleep(rnd.uniform(settings.gap_min, settings.gap_max))
            # A partition heals OUTAGE_CLEARANCE before an outage, so the time
            # back after it is not the outage's.
            limit = min([end, *(t - OUTAGE_CLEARANCE for t in outage_at)]) - time.monotonic()
            if limit < settings.partition_min:
                continue
            length = min(limit, rnd.uniform(settings.partition_min, settings.partition_max))
            host = rnd.randrange(settings.hosts)
            # The first partition is aimed inside a transaction; heals take
            # turns, so even a short run has each kind.
            count = sum(p.kind == "partition" for p in chaos)
            aim = count == 0 or rnd.random() < settings.in_transaction
            heal = ("resume", "reset")[count % 2]
            chaos.append(_partition(proxies[host], host, length, heal, intx, aim))
        # Everything healed; let the hosts settle, then stop them.
        for proxy in proxies:
            proxy.accept()
            proxy.resume()
        say(f"chaos over: {len(chaos)} faults; settling")
        time.sleep(settings.ttl * 2 + 1)
        stop.set()
        for i, p in enumerate(procs):
            p.join(180)
            if p.is_alive():
                say(f"host {i} did not stop; killing it")
                p.kill()
                p.join(10)
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        for proxy in proxies:
            proxy.close()
    with open(workdir / "chaos.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(asdict(p)) + "\n" for p in chaos)
    tables = read_tables(dsn, schema)
    logs = [read_log(workdir / f"host{i}.jsonl") for i in range(settings.hosts)]
    report = SoakReport(violations=check(tables, logs))
    report.figures = figures(settings, logs, chaos, tables)
    report.figures["violations"] = len(report.violations)
    return report


def _partition(proxy: StallProxy, host: int, length: float, heal: str, intx: Any,
               aim: bool) -> Partition:  # fmt: skip
    if aim:
        # Wait (a little) for the host to be inside a fenced transaction.
        until = time.monotonic() + 3.0
        while time.monotonic() < until and not intx[host]:
            time.sleep(0.005)
    proxy.pause()
    in_tx = bool(intx[host])  # aimed or not: the host is inside a transaction
    start = time.monotonic()
    time.sleep(length)
    if heal == "reset":
        proxy.reset()
    proxy.resume()
    return Partition(host, start, time.monotonic(), heal, in_tx)


def _outage(proxies: Iterable[StallProxy], kind: str, seconds: float) -> Partition:
    proxies = list(proxies)
    start = time.monotonic()
    for proxy in proxies:
        if kind == "outage-pause":
            proxy.pause()
        else:
            proxy.refuse()
            proxy.reset()
    time.sleep(seconds)
    for proxy in proxies:
        if kind == "outage-pause":
            proxy.resume()
        else:
            proxy.accept()
    return Partition(-1, start, time.monotonic(), "accept" if kind == "outage-refuse" else "resume",
                     kind=kind)  # fmt: skip


def summary(report: SoakReport) -> str:
    """The report as text, for people."""
    f = report.figures
    lines = [f"violations: {len(report.violations)}"]
    lines += [f"  {v}" for v in report.violations[:50]]
    lines.append(
        f"partitions: {f['partitions']} ({f['partitions_in_transaction']} inside a transaction,"
        f" {f['healed_by_reset']} healed by reset); outages: {f['outages']}"
    )
    lines.append(
        f"writes: {f['acknowledged_writes']} acknowledged, {f['lost_acknowledged']} lost;"
        f" {f['reported_not_committed']} reported not committed,"
        f" {f['reported_outcome_unknown']} outcome unknown"
        f" ({f['outcome_unknown_that_committed']} of them committed); events {f['events']}"
    )
    for name, c in f["calls"].items():
        lines.append(f"  {name:8} n={c['n']:6} longest {c['longest']:6.2f} s  bound {c['bound']}"
                     f"  over {c['over_bound']}  {c['by_outcome']}")  # fmt: skip
    h = f["hold_entries"]
    lines.append(
        f"hold entries: {h['n']} ({h['granted']} granted), longest {h['longest']} s against"
        f" timeout {h['timeout']} s, {h['over_timeout']} over it by more than {HOLD_SLACK} s,"
        f" {h['over_documented_bound']} over timeout + {STEP_GRACE} s step grace"
        f" + {HOLD_SLACK} s;"
        f" {h['handed_out_already_lost']} handed out already lost; {h['by_outcome']}"
    )
    lines.append(f"learn of a loss (ttl {f['ttl']} s): hold {f['learn_of_loss_hold']},"
                 f" raw {f['learn_of_loss_raw']}")  # fmt: skip
    lines.append(f"partition lengths (s): {f['partition_seconds']}")
    lines.append(f"back after a heal: {f['back_after_heal']}")
    lines.append(f"  first new call: {f['back_after_heal_new_call']}")
    lines.append(f"back after an outage: {f['back_after_outage']}")
    lines.append(f"  first new call: {f['back_after_outage_new_call']}")
    lines.append(
        f"watcher unhealthy within a partition (>3 s): {f['watcher_unhealthy_in_partition']};"
        f" restarts {f['watcher_restarts']}"
    )
    return "\n".join(lines)
