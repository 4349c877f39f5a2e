"""claim, renew, release and mutate_begin run one SQL statement when they succeed (issue 24).

The entry points try one guarded statement (with the revision bump, the event
and the wake-up in the same statement); whatever it does not do goes to the
cold functions `_claim_cold`, `_renew_cold`, `_release_cold` and
`_mutate_begin_cold`, the earlier bodies. Proven here on a real server:

* the statement count, by auto_explain's log of every executed statement,
  nested ones included;
* the same outcome as the cold functions for every state and argument tried:
  the same row, the same events and lease row written, the same SQLSTATE,
  message, detail and hint when refused;
* the races the one statement must judge again: a claim that queued while
  another took the lease, a renew that queued until its lease ran out, a
  claim's time read after its queue wait, and the same for a fenced mutation
  (its payload races with prune are proven in test_prune_gc.py and
  test_prune_chunks.py, whose writes take the one statement).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from pglease import PostgresStore
from pglease.testing import set_test_clock
from tests._lock_helpers import lock_waiters, wait_until

TOK_A = hashlib.sha256(b"token-a").digest()
TOK_B = hashlib.sha256(b"token-b").digest()
BIG = 3 * 86400.0  # a TTL that outlives the test by days, in real time too

CLAIM_ARGS = "%s, %s, %s, %s, %s::float8, %s::bigint, %s::timestamptz"
RENEW_ARGS = "%s, %s, %s, %s::bigint, %s, %s::float8, %s::bigint, %s::timestamptz"
RELEASE_ARGS = "%s, %s, %s, %s::bigint, %s, %s::bigint, %s::timestamptz"
MUTATE_ARGS = "%s, %s::bigint, %s, %s, %s, %s::bigint, %s, %s, %s, %s, %s::timestamptz"
ARGS = {
    "claim": CLAIM_ARGS,
    "renew": RENEW_ARGS,
    "release": RELEASE_ARGS,
    "mutate_begin": MUTATE_ARGS,
}


def q(schema: str, fn: str) -> str:
    return f'SELECT * FROM "{schema}".{fn}({ARGS[fn.strip("_").removesuffix("_cold")]})'


# --------------------------------------------------------------------------- statement count


@pytest.fixture
def explained(pg_dsn: str) -> Iterator[tuple[psycopg.Connection[Any], list[str]]]:
    """An autocommit connection on which every executed statement, nested ones
    too, is reported as a NOTICE (auto_explain); and the list they go to."""
    conn = psycopg.connect(pg_dsn, autocommit=True)
    try:
        conn.execute("LOAD 'auto_explain'")
    except psycopg.Error as exc:
        conn.close()
        pytest.skip(f"auto_explain cannot be loaded here: {exc.diag.message_primary}")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_nested_statements = on",
        "auto_explain.log_level = notice",
        "auto_explain.log_format = json",
    ):
        conn.execute(f"SET {setting}")
    notes: list[str] = []
    conn.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
    try:
        yield conn, notes
    finally:
        conn.close()


def statements(conn: psycopg.Connection[Any], notes: list[str], query: str, args: list[Any]) -> int:
    """How many statements the server executed for `query`, itself included."""
    conn.execute("SELECT 1")  # the notices of anything earlier have arrived
    notes.clear()
    conn.execute(query.encode(), args).fetchall()
    return sum(1 for n in notes if '"Query Text"' in n)


def test_each_operation_is_one_statement(
    pg_store: PostgresStore, schema: str, explained: tuple[psycopg.Connection[Any], list[str]]
) -> None:
    conn, notes = explained
    rid = pg_store.ensure_resource("job", "count")
    # Each call: the caller's SELECT and the one statement inside it.
    claim = [rid, "host", "a", TOK_A, 30, None, None]
    assert statements(conn, notes, q(schema, "claim"), claim) == 2
    refused = [rid, "host", "b", TOK_B, 30, None, None]
    assert statements(conn, notes, q(schema, "claim"), refused) == 2
    renew = [rid, "host", "a", 1, TOK_A, 30, None, None]
    assert statements(conn, notes, q(schema, "renew"), renew) == 2
    release = [rid, "host", "a", 1, TOK_A, None, None]
    assert statements(conn, notes, q(schema, "release"), release) == 2
    assert [e.type for e in pg_store.events(rid)] == [
        "lease.claimed",
        "lease.renewed",
        "lease.released",
    ]
    # The cold way runs several: a transaction that wrote before takes it
    # (its order guard must be checked), and so does an expected revision.
    conn.execute("BEGIN")
    conn.execute("SELECT pg_current_xact_id()")
    assert statements(conn, notes, q(schema, "claim"), claim) > 2
    conn.execute("ROLLBACK")
    state = pg_store.get(rid)
    with_revision = [rid, "host", "a", TOK_A, 30, state.revision, None]
    assert statements(conn, notes, q(schema, "claim"), with_revision) > 2


# --------------------------------------------------------------------------- same outcome


Outcome = tuple[Any, ...]


def outcome(
    conn: psycopg.Connection[Any], schema: str, fn: str, args: list[Any], rid: str
) -> Outcome:
    """What `fn(args)` returns or raises, and what it writes, in a transaction
    that is rolled back afterwards (psycopg's implicit BEGIN: no xid yet)."""
    s = f'"{schema}"'
    try:
        row = conn.execute(q(schema, fn).encode(), args).fetchone()
    except psycopg.Error as exc:
        conn.rollback()
        d = exc.diag
        return ("error", d.sqlstate, d.message_primary, d.message_detail, d.message_hint)
    events = conn.execute(
        f"SELECT type, revision, actor_type, actor_id, lease_generation, lease_expires_at,"
        f" created_at FROM {s}.events WHERE xid = pg_current_xact_id() ORDER BY id"
    ).fetchall()
    lease = conn.execute(
        # last_xid is this transaction's id: compared as "set by this call".
        f"SELECT l.resource_id, l.generation, l.owner_type, l.owner_id, l.token_sha256,"
        f" l.acquired_at, l.heartbeat_at, l.expires_at, l.expired_generation, l.revoked_until,"
        f" l.revision, l.updated_at, l.last_xid = pg_current_xact_id(),"
        f" r.revision, r.updated_at FROM {s}.leases l"
        f" JOIN {s}.resources r ON r.id = l.resource_id WHERE l.resource_id = %s",
        [rid],
    ).fetchall()
    conn.rollback()
    return ("ok", row, events, lease)


def real_clock(found: Outcome) -> Outcome:
    """An outcome with its timestamps blanked: judged by the real clock, the
    two ways read it at different instants."""

    def blank(v: Any) -> Any:
        if isinstance(v, datetime):
            return "<time>"
        if isinstance(v, tuple | list):
            return type(v)(blank(x) for x in v)
        return v

    return blank(found)


class States:
    """Resources in the states a lease can be in, written through the SQL
    functions with the test clock at instants relative to `t0` (a day ago by
    the database clock, so a short lease has run out in real time as well)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        self.conn = conn
        self.schema = schema
        row = conn.execute("SELECT date_trunc('second', clock_timestamp()) - interval '1 day'")
        self.t0: datetime = row.fetchone()[0]  # type: ignore[index]
        self.ids: dict[str, str] = {}

    def at(self, seconds: float) -> datetime:
        return self.t0 + timedelta(seconds=seconds)

    def call(self, fn: str, args: list[Any]) -> Any:
        row = self.conn.execute(q(self.schema, fn).encode(), args).fetchone()
        self.conn.commit()
        return row

    def new(self, name: str) -> str:
        row = self.conn.execute(f'SELECT "{self.schema}".ensure_resource(%s, %s)', ["job", name])
        rid = str(row.fetchone()[0])  # type: ignore[index]
        self.conn.commit()
        self.ids[name] = rid
        return rid

    def claim_a(self, rid: str, ttl: float) -> None:
        self.call("claim", [rid, "host", "a", TOK_A, ttl, None, self.at(0)])

    def build(self) -> None:
        s = f'"{self.schema}"'
        # Expired by the real clock and recorded by the reaper (first: the
        # reaper records every lease that has run out).
        self.claim_a(self.new("reaped"), 30)
        assert self.conn.execute(f"SELECT {s}.reap_expired(100)").fetchone() == (1,)
        self.conn.commit()
        self.new("free")
        self.claim_a(self.new("held"), BIG)
        self.claim_a(self.new("short"), 30)  # runs out at t0+30, not recorded
        rid = self.new("released")
        self.claim_a(rid, BIG)
        self.call("release", [rid, "host", "a", 1, TOK_A, None, self.at(1)])
        rid = self.new("reclaimed")  # generation 2 after a release
        self.claim_a(rid, BIG)
        self.call("release", [rid, "host", "a", 1, TOK_A, None, self.at(1)])
        self.call("claim", [rid, "host", "a", TOK_A, BIG, None, self.at(2)])
        rid = self.new("revoked")  # waits for the revoked holder's expiry
        self.claim_a(rid, BIG)
        self.conn.execute(f"SELECT {s}.revoke_lease(%s)", [rid])
        self.conn.commit()

    def generation(self, rid: str) -> int:
        row = self.conn.execute(
            f'SELECT generation FROM "{self.schema}".leases WHERE resource_id = %s', [rid]
        ).fetchone()
        self.conn.rollback()
        return int(row[0]) if row else 0

    def revision(self, rid: str) -> int:
        row = self.conn.execute(
            f'SELECT coalesce(l.revision, r.revision) FROM "{self.schema}".leases l'
            f' JOIN "{self.schema}".resources r ON r.id = l.resource_id'
            " WHERE l.resource_id = %s",
            [rid],
        ).fetchone()
        self.conn.rollback()
        return int(row[0]) if row else 0


UNKNOWN = "job-" + "0" * 40


def claim_cases(rid: str, st: States) -> list[list[Any]]:
    rev = st.revision(rid)
    out: list[list[Any]] = []
    for t in (1, 60, 2 * BIG):
        out.append([rid, "host", "b", TOK_B, 30, None, st.at(t)])
    out += [
        [rid, "host", "a", TOK_A, 30, None, st.at(1)],  # the holder claims again
        [rid, "Host", "b", TOK_B, 30, None, st.at(1)],
        [rid, None, "b", TOK_B, 30, None, st.at(1)],
        [rid, "host", "", TOK_B, 30, None, st.at(1)],
        [rid, "host", "x" * 257, TOK_B, 30, None, st.at(1)],
        [rid, "host", None, TOK_B, 30, None, st.at(1)],
        [rid, "host", "b", TOK_B[:31], 30, None, st.at(1)],
        [rid, "host", "b", None, 30, None, st.at(1)],
        [rid, "host", "b", TOK_B, rev, rev, st.at(60)],
        [rid, "host", "b", TOK_B, 30, rev + 1, st.at(60)],
        [rid, "host", "b", TOK_B, 30, -1, st.at(60)],
    ]
    for ttl in (0, 0.0005, 604801, math.nan, math.inf, -math.inf, None):
        out.append([rid, "host", "b", TOK_B, ttl, None, st.at(60)])
    return out


def lease_cases(rid: str, st: States, with_ttl: bool) -> list[list[Any]]:
    g = st.generation(rid)
    rev = st.revision(rid)

    def args(
        owner: str,
        gen: int | None,
        tok: bytes | None,
        *,
        t: float = 1,
        ttl: Any = 30,
        expected: int | None = None,
        who: Any = "host",
    ) -> list[Any]:
        head = [rid, who, owner, gen, tok]
        return head + ([ttl] if with_ttl else []) + [expected, st.at(t)]

    out = [
        args("a", g, TOK_A),
        args("a", g, TOK_A, t=60),  # after a short lease ran out
        args("a", g, TOK_A, t=2 * BIG),
        args("a", g, TOK_B),
        args("b", g, TOK_A),
        args("a", g, TOK_A, who="node"),
        args("a", g + 1, TOK_A),
        args("a", g - 1, TOK_A),
        args("a", -1, TOK_A),
        args("a", None, TOK_A),
        args("a", g, TOK_A[:16]),
        args("a", g, None),
        args("", g, TOK_A),
        args("a", g, TOK_A, who="Host"),
        args("a", g, TOK_A, expected=rev),
        args("a", g, TOK_A, expected=rev + 1),
        args("a", g, TOK_A, expected=-1),
    ]
    if with_ttl:
        for ttl in (0, 604801, math.nan, math.inf, None):
            out.append(args("a", g, TOK_A, ttl=ttl))
    return out


def cases(st: States) -> Iterator[tuple[str, list[Any], str]]:
    """(function, arguments, resource id) of every call compared."""
    for rid in st.ids.values():
        for args in claim_cases(rid, st):
            yield "claim", args, rid
        for args in lease_cases(rid, st, with_ttl=True):
            yield "renew", args, rid
        for args in lease_cases(rid, st, with_ttl=False):
            yield "release", args, rid
    # Unknown and malformed resource ids.
    for rid in (UNKNOWN, "job-123", "", None):
        yield "claim", [rid, "host", "b", TOK_B, 30, None, st.at(1)], UNKNOWN
        yield "renew", [rid, "host", "a", 1, TOK_A, 30, None, st.at(1)], UNKNOWN
        yield "release", [rid, "host", "a", 1, TOK_A, None, st.at(1)], UNKNOWN


def compare_all(
    conn: psycopg.Connection[Any],
    st: States,
    adjust: Callable[[list[Any]], list[Any]],
    norm: Callable[[Outcome], Outcome],
) -> set[str]:
    """Every case through the entry point and through its cold function, from
    the same state; returns the kinds of outcome seen."""
    seen: set[str] = set()
    for fn, args, rid in cases(st):
        call = adjust(list(args))
        fast = outcome(conn, st.schema, fn, call, rid)
        cold = outcome(conn, st.schema, f"_{fn}_cold", call, rid)
        assert norm(fast) == norm(cold), (fn, args)
        seen.add(f"{fn}:{fast[0]}:{fast[1] if fast[0] == 'error' else fast[1][0]}")
    return seen


def test_same_outcome_as_the_cold_way(pg_store: PostgresStore, pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        st = States(conn, schema)
        st.build()
        # By the test clock: every value must be equal, timestamps included.
        seen = compare_all(conn, st, lambda a: a, lambda o: o)
        # The cases reach grants, refusals and each kind of error.
        for kind in (
            "claim:ok:True", "claim:ok:False", "renew:ok:" , "release:ok:",
            "claim:error:PGL01", "claim:error:PGL02", "claim:error:PGL11", "claim:error:PGL12",
            "claim:error:PGL13", "claim:error:PGL14", "claim:error:PGL15",
            "renew:error:PGL01", "renew:error:PGL02", "renew:error:PGL03", "renew:error:PGL04",
            "renew:error:PGL11", "renew:error:PGL12", "renew:error:PGL13", "renew:error:PGL14",
            "renew:error:PGL15",
            "release:error:PGL01", "release:error:PGL02", "release:error:PGL03",
            "release:error:PGL12", "release:error:PGL13", "release:error:PGL14",
            "release:error:PGL15",
        ):  # fmt: skip
            assert any(s.startswith(kind) for s in seen), (kind, sorted(seen))
        # By the database clock (no `now`): equal but for the instants read.
        compare_all(conn, st, lambda a: [*a[:-1], None], real_clock)
        # A `now` where the test clock is off: refused alike (PGL10).
        set_test_clock(conn, schema, False)
        try:
            seen = compare_all(conn, st, lambda a: a, lambda o: o)
        finally:
            set_test_clock(conn, schema, True)
        assert "claim:error:PGL10" in seen and "renew:error:PGL10" in seen
        assert "release:error:PGL10" in seen


# --------------------------------------------------------------------------- races


def _queue_lock(conn: psycopg.Connection[Any], schema: str, rid: str) -> None:
    """Take the resource's queue lock in `conn`'s open transaction, as every
    writer does first (see _lock_lease)."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, hashtext(%s)))", [rid, schema])


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the test
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def _sql(dsn: str, query: str, args: list[Any]) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query.encode(), args).fetchone()


def test_a_claim_that_queued_while_another_took_the_lease_is_refused(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("job", "race-claim")
    with psycopg.connect(pg_dsn) as a:
        # A's claim, not committed yet: B sees the lease free and queues.
        row = a.execute(q(schema, "claim").encode(), [rid, "host", "a", TOK_A, 60, None, None])
        assert row.fetchone()[0] is True  # type: ignore[index]
        t, result = _in_thread(
            lambda: _sql(pg_dsn, q(schema, "claim"), [rid, "host", "b", TOK_B, 60, None, None])
        )
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".claim') == 1)
        a.commit()
    t.join(30)
    assert not t.is_alive()
    [refused] = result
    assert not isinstance(refused, BaseException), refused
    claimed, generation, _, revision, holder_type, holder_id = refused
    assert (claimed, generation, revision, holder_type, holder_id) == (False, 1, 1, "host", "a")
    assert [e.type for e in pg_store.events(rid)] == ["lease.claimed"]


def test_a_claim_reads_the_clock_after_its_queue_wait(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("job", "race-clock")
    with psycopg.connect(pg_dsn) as blocker:
        _queue_lock(blocker, schema, rid)
        t, result = _in_thread(
            lambda: _sql(pg_dsn, q(schema, "claim"), [rid, "host", "b", TOK_B, 60, None, None])
        )
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".claim') == 1)
        freed = blocker.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        blocker.commit()
    t.join(30)
    assert not t.is_alive()
    [row] = result
    assert not isinstance(row, BaseException), row
    assert row[0] is True
    acquired = _sql(
        pg_dsn, f'SELECT acquired_at, heartbeat_at, expires_at FROM "{schema}".leases'
        " WHERE resource_id = %s", [rid],
    )  # fmt: skip
    assert acquired[0] >= freed and acquired[1] == acquired[0]
    assert acquired[2] == acquired[0] + timedelta(seconds=60) == row[2]
    [event] = pg_store.events(rid)
    assert event.created_at == acquired[0]


def test_a_renew_that_queued_until_its_lease_ran_out_is_refused(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("job", "race-renew")
    row = _sql(pg_dsn, q(schema, "claim"), [rid, "host", "a", TOK_A, 1, None, None])
    assert row[0] is True
    expires = row[2]
    with psycopg.connect(pg_dsn) as blocker:
        _queue_lock(blocker, schema, rid)
        t, result = _in_thread(
            lambda: _sql(pg_dsn, q(schema, "renew"), [rid, "host", "a", 1, TOK_A, 60, None, None])
        )
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".renew') == 1)
        # Hold the queue until the lease has run out by the database clock.
        wait_until(
            lambda: (
                blocker.execute("SELECT clock_timestamp() > %s", [expires]).fetchone() == (True,)
            )
        )
        blocker.commit()
    t.join(30)
    assert not t.is_alive()
    [err] = result
    assert isinstance(err, psycopg.Error), err
    assert err.diag.sqlstate == "PGL04"
    assert [e.type for e in pg_store.events(rid)] == ["lease.claimed"]


def test_a_release_that_queued_behind_a_revoke_is_refused(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("job", "race-release")
    assert _sql(pg_dsn, q(schema, "claim"), [rid, "host", "a", TOK_A, 60, None, None])[0]
    with psycopg.connect(pg_dsn) as operator:
        operator.execute(f'SELECT "{schema}".revoke_lease(%s)', [rid])
        t, result = _in_thread(
            lambda: _sql(pg_dsn, q(schema, "release"), [rid, "host", "a", 1, TOK_A, None, None])
        )
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".release') == 1)
        operator.commit()
    t.join(30)
    assert not t.is_alive()
    [err] = result
    assert isinstance(err, psycopg.Error), err
    assert err.diag.sqlstate == "PGL03"
    assert "superseded by generation 2" in (err.diag.message_primary or "")
    assert [e.type for e in pg_store.events(rid)] == ["lease.claimed", "lease.revoked"]


# --------------------------------------------------------------------------- mutate_begin

EVENT = "job.step"


def mutate_statements(
    conn: psycopg.Connection[Any], notes: list[str], schema: str, args: list[Any]
) -> int:
    """Statements run by one mutate_begin in a transaction of its own (rolled
    back), not counting the foreign-key check of an event's payload: that is
    PostgreSQL's own (`SELECT 1 FROM ONLY ... FOR KEY SHARE`), run by its
    trigger for either way alike."""
    conn.execute("SELECT 1")
    notes.clear()
    conn.execute("BEGIN")
    try:
        conn.execute(q(schema, "mutate_begin").encode(), args)
    except psycopg.Error:
        pass  # a refusal: counted alike
    finally:
        conn.execute("ROLLBACK")
    return sum(
        1 for n in notes if '"Query Text"' in n and '"Query Text": "SELECT 1 FROM ONLY' not in n
    )


def test_mutate_begin_is_one_statement(
    pg_store: PostgresStore, schema: str, explained: tuple[psycopg.Connection[Any], list[str]]
) -> None:
    conn, notes = explained
    rid = pg_store.ensure_resource("job", "mutate-count")
    claim = conn.execute(
        q(schema, "claim").encode(), [rid, "host", "a", TOK_A, BIG, None, None]
    ).fetchone()
    assert claim is not None and claim[0] is True
    rev = int(claim[3])
    conn.execute(
        f'INSERT INTO "{schema}".payloads (sha256, body) VALUES (%s, %s)',
        [hashlib.sha256(b'{"old":1}').digest(), '{"old":1}'],
    )

    def leased(payload: str | None, expected: int | None = rev) -> list[Any]:
        return [rid, expected, EVENT, "host", "a", 1, TOK_A, "host", "a", payload, None]

    # The caller's SELECT and the one statement inside mutate_begin: a fenced
    # write with or without an expected revision, with no payload, a new one
    # or one stored already; an unleased write likewise.
    for args in (
        leased(None),
        leased(None, None),
        leased('{"new":1}'),
        leased('{"old":1}'),
    ):
        assert mutate_statements(conn, notes, schema, args) == 2, args
    rid2 = pg_store.ensure_resource("job", "mutate-count-2")
    for payload in (None, '{"new":2}', '{"old":1}'):
        args = [rid2, 0, EVENT, None, None, None, None, "host", "w", payload, None]
        assert mutate_statements(conn, notes, schema, args) == 2, payload
    # The cold way runs several: a stale revision (worded there), a test
    # clock, a transaction that wrote before (its order guard).
    assert mutate_statements(conn, notes, schema, leased(None, rev + 1)) > 2
    now = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    assert mutate_statements(conn, notes, schema, [*leased(None)[:-1], now]) > 2
    conn.execute("BEGIN")
    conn.execute("SELECT pg_current_xact_id()")
    notes.clear()
    conn.execute(q(schema, "mutate_begin").encode(), leased(None))
    assert sum(1 for n in notes if '"Query Text"' in n) > 2
    conn.execute("ROLLBACK")


MutateOutcome = tuple[Any, ...]
SETTINGS = (
    "pglease.lease_left",
    "statement_timeout",
    "idle_in_transaction_session_timeout",
)


def mutate_outcome(
    conn: psycopg.Connection[Any], schema: str, fn: str, args: list[Any], rid: str
) -> tuple[MutateOutcome, list[float | None]]:
    """What `fn(args)` returns or raises and writes (as `outcome`, with the
    payloads table), and the limits it set for its transaction (seconds)."""
    s = f'"{schema}"'
    try:
        row = conn.execute(q(schema, fn).encode(), args).fetchone()
    except psycopg.Error as exc:
        conn.rollback()
        d = exc.diag
        return ("error", d.sqlstate, d.message_primary, d.message_detail, d.message_hint), []
    events = conn.execute(
        f"SELECT resource_id, type, revision, actor_type, actor_id, lease_generation,"
        f" lease_expires_at, payload_sha256, created_at FROM {s}.events"
        " WHERE xid = pg_current_xact_id() ORDER BY id"
    ).fetchall()
    lease = conn.execute(
        # last_xid is this transaction's id: compared as "set by this call".
        f"SELECT l.resource_id, l.generation, l.owner_type, l.owner_id, l.token_sha256,"
        f" l.acquired_at, l.heartbeat_at, l.expires_at, l.expired_generation, l.revoked_until,"
        f" l.revision, l.updated_at, l.last_xid = pg_current_xact_id(),"
        f" r.revision, r.updated_at FROM {s}.leases l"
        f" JOIN {s}.resources r ON r.id = l.resource_id WHERE l.resource_id = %s",
        [rid],
    ).fetchall()
    stored = conn.execute(f"SELECT sha256, body FROM {s}.payloads ORDER BY 1").fetchall()
    left = conn.execute("SELECT current_setting('pglease.lease_left', true)").fetchone()
    limits: list[float | None] = [
        float(left[0]) if left and left[0] else None  # type: ignore[index]
    ]
    for name in SETTINGS[1:]:
        got = conn.execute(
            "SELECT extract(epoch FROM current_setting(%s)::interval)::float8", [name]
        ).fetchone()
        limits.append(got[0] if got else None)  # type: ignore[index]
    conn.rollback()
    # The row's event id differs by the sequence only: compare its presence.
    return ("ok", (row[0], row[1] is not None, row[2]), events, lease, stored), limits


def mutate_cases(rid: str, st: States) -> list[list[Any]]:
    g = st.generation(rid)
    rev = st.revision(rid)
    big = '"' + "x" * 1048576 + '"'

    def leased(
        *,
        expected: Any = rev,
        event: Any = EVENT,
        who: Any = ("host", "a"),
        gen: Any = g,
        tok: Any = TOK_A,
        actor: Any = ("host", "a"),
        payload: Any = None,
    ) -> list[Any]:
        return [rid, expected, event, *who, gen, tok, *actor, payload]

    def unleased(*, expected: Any = rev, actor: Any = ("host", "w"), payload: Any = None,
                 event: Any = EVENT) -> list[Any]:  # fmt: skip
        return [rid, expected, event, None, None, None, None, *actor, payload]

    out = [
        leased(),
        leased(expected=None),
        leased(payload='{"new":1}'),
        leased(payload='{"old":1}'),  # stored already
        leased(payload='{"other":1}'),  # stored with other bytes under its hash
        leased(payload="{bad"),
        leased(payload=big),
        leased(expected=rev + 1),
        leased(expected=rev - 1),
        leased(expected=-1),
        leased(expected=-1, payload="{bad"),
        leased(tok=TOK_B),
        leased(tok=TOK_A[:16]),
        leased(tok=TOK_A[:16], payload="{bad"),
        leased(who=("host", "b"), actor=("host", "b")),
        leased(who=("node", "a"), actor=("node", "a")),
        leased(who=("Host", "a"), actor=(None, None)),
        leased(who=("host", ""), actor=(None, None)),
        leased(gen=g + 1),
        leased(gen=g - 1),
        leased(gen=None),
        leased(gen=-1),
        leased(actor=(None, None)),
        leased(actor=("node", "other")),  # checked, then the owner is the actor
        leased(actor=("Node", "x")),
        leased(actor=("node", None)),
        leased(actor=(None, "x")),
        leased(actor=("node", "x" * 257)),
        leased(event="Job.step"),
        leased(event="lease.claimed"),
        leased(event=None),
        leased(event="a" * 129),
        leased(event="job..step", payload="{bad"),
        unleased(),
        unleased(expected=None),
        unleased(actor=(None, None)),
        unleased(payload='{"new":1}'),
        unleased(payload='{"old":1}'),
        unleased(payload='{"other":1}'),
        unleased(payload="{bad"),
        unleased(expected=rev + 1),
        unleased(expected=-1, payload="{bad"),
        unleased(actor=("Bad", "w")),
        unleased(actor=("host", "")),
        unleased(event="lease.x"),
    ]
    return out


def mutate_all_cases(st: States) -> Iterator[tuple[list[Any], str]]:
    for rid in st.ids.values():
        for args in mutate_cases(rid, st):
            yield args, rid
    for rid in (UNKNOWN, "job-123", "", None):
        yield [rid, 0, EVENT, "host", "a", 1, TOK_A, "host", "a", None], UNKNOWN
        yield [rid, 0, EVENT, None, None, None, None, "host", "w", "{bad"], UNKNOWN
        yield [rid, None, EVENT, None, None, None, None, None, None, None], UNKNOWN


def mutate_compare_all(
    conn: psycopg.Connection[Any],
    st: States,
    now: Callable[[], Any],
    norm: Callable[[Outcome], Outcome],
) -> set[str]:
    """Every mutate case through mutate_begin and through _mutate_begin_cold,
    from the same state; returns the kinds of outcome seen."""
    seen: set[str] = set()
    for args, rid in mutate_all_cases(st):
        call = [*args, now()]
        fast, fast_limits = mutate_outcome(conn, st.schema, "mutate_begin", call, rid)
        cold, cold_limits = mutate_outcome(conn, st.schema, "_mutate_begin_cold", call, rid)
        assert norm(fast) == norm(cold), (args[:9], fast[:2], cold[:2])
        # The limits are set alike (by the real clock, a few ms apart).
        assert [x is None for x in fast_limits] == [x is None for x in cold_limits]
        for a, b in zip(fast_limits, cold_limits, strict=True):
            assert a is None or b is None or math.isclose(a, b, abs_tol=5), args[:9]
        seen.add(f"ok:{args[6] is not None}" if fast[0] == "ok" else f"error:{fast[1]}")
    return seen


def build_payloads(conn: psycopg.Connection[Any], schema: str) -> None:
    """A stored payload to reuse, and a hash stored with other bytes."""
    for text, stored in (('{"old":1}', '{"old":1}'), ('{"other":1}', '{"other":2}')):
        conn.execute(
            f'INSERT INTO "{schema}".payloads (sha256, body) VALUES (%s, %s)',
            [hashlib.sha256(text.encode()).digest(), stored],
        )
    conn.commit()


def test_mutate_begin_has_the_same_outcome_as_the_cold_way(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        st = States(conn, schema)
        st.build()
        build_payloads(conn, schema)
        # By the database clock (the one statement's case): equal but for the
        # instants read. The lease "held" is live, "short" ran out a day ago.
        seen = mutate_compare_all(conn, st, lambda: None, real_clock)
        for kind in (
            "ok:True", "ok:False", "error:PGL01", "error:PGL02", "error:PGL03",
            "error:PGL04", "error:PGL05", "error:PGL06", "error:PGL12", "error:PGL13",
            "error:PGL14", "error:PGL15", "error:PGL18", "error:PGL19", "error:22P02",
        ):  # fmt: skip
            assert kind in seen, (kind, sorted(seen))
        # By the test clock (always the cold way): every value equal.
        seen = mutate_compare_all(conn, st, lambda: st.at(1), lambda o: o)
        assert "ok:True" in seen
        set_test_clock(conn, schema, False)
        try:
            seen = mutate_compare_all(conn, st, lambda: st.at(1), lambda o: o)
        finally:
            set_test_clock(conn, schema, True)
        assert "error:PGL10" in seen


def _mutate_sql(schema: str) -> str:
    return (
        f"SELECT b.revision, current_setting('pglease.lease_left', true)"
        f' FROM "{schema}".mutate_begin({MUTATE_ARGS}) b'
    )


def test_a_mutation_that_queued_while_another_took_the_lease_is_refused(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("job", "race-mutate")
    assert _sql(pg_dsn, q(schema, "claim"), [rid, "host", "a", TOK_A, 1, None, None])[0]
    with psycopg.connect(pg_dsn) as rival:
        # The lease runs out; a rival takes it over (not committed yet).
        wait_until(lambda: not pg_store.get(rid).lease.held)
        row = rival.execute(q(schema, "claim").encode(), [rid, "host", "b", TOK_B, 60, None, None])
        assert row.fetchone()[0] is True  # type: ignore[index]
        args = [rid, None, EVENT, "host", "a", 1, TOK_A, None, None, None, None]
        t, result = _in_thread(lambda: _sql(pg_dsn, _mutate_sql(schema), args))
        # The old holder's write saw its own committed row and queued.
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".mutate_begin') == 1)
        rival.commit()
    t.join(30)
    assert not t.is_alive()
    [err] = result
    assert isinstance(err, psycopg.Error), err
    assert err.diag.sqlstate == "PGL03"
    assert "superseded by generation 2" in (err.diag.message_primary or "")
    assert [e.type for e in pg_store.events(rid)] == [
        "lease.claimed", "lease.expired", "lease.claimed",
    ]  # fmt: skip


def test_a_mutation_reads_the_clock_after_its_queue_wait(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    rid = pg_store.ensure_resource("job", "race-mutate-clock")
    row = _sql(pg_dsn, q(schema, "claim"), [rid, "host", "a", TOK_A, 60, None, None])
    assert row[0] is True
    expires = row[2]
    with psycopg.connect(pg_dsn) as blocker:
        _queue_lock(blocker, schema, rid)
        args = [rid, 1, EVENT, "host", "a", 1, TOK_A, "host", "a", '{"q":1}', None]
        t, result = _in_thread(lambda: _sql(pg_dsn, _mutate_sql(schema), args))
        wait_until(lambda: lock_waiters(pg_dsn, f'"{schema}".mutate_begin') == 1)
        freed = blocker.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        blocker.commit()
    t.join(30)
    assert not t.is_alive()
    [got] = result
    assert not isinstance(got, BaseException), got
    revision, left = got
    assert revision == 2
    [_, event] = pg_store.events(rid)
    assert event.type == EVENT and event.payload == {"q": 1}
    assert event.created_at >= freed
    # The seconds left are judged at that same instant.
    assert float(left) == pytest.approx((expires - event.created_at).total_seconds(), abs=1e-6)


def test_a_mutation_holds_the_lease_row_until_it_ends(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    """The one statement locks the lease row (as _lock_lease did): a heartbeat
    cannot extend the lease while the mutation runs, it reports it busy."""
    rid = pg_store.ensure_resource("job", "mutate-holds")
    assert _sql(pg_dsn, q(schema, "claim"), [rid, "host", "a", TOK_A, 60, None, None])[0]
    beat = (
        f'SELECT status FROM "{schema}".heartbeat(ARRAY[%s], ARRAY[1::bigint], ARRAY[%s::bytea],'
        " ARRAY['host'], ARRAY['a'], ARRAY[60::float8])"
    )
    with psycopg.connect(pg_dsn) as writer:
        args = [rid, 1, EVENT, "host", "a", 1, TOK_A, "host", "a", None, None]
        assert writer.execute(_mutate_sql(schema).encode(), args).fetchone()[0] == 2  # type: ignore[index]
        assert _sql(pg_dsn, beat, [rid, TOK_A]) == ("busy",)
        writer.commit()
    assert _sql(pg_dsn, beat, [rid, TOK_A]) == ("renewed",)
