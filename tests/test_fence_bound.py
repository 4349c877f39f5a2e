"""A fenced mutation's transaction is bounded by its lease on the server.

A holder that stalls inside `mutate` (sleeps in its own code, runs a long
statement, is stopped or cut off) holds the lease row lock; the server ends its
transaction at about the lease's expiry (_bound_by_lease in
sql/functions/10_core.sql), so a rival's claim succeeds soon after the expiry
instead of waiting out its own lock_timeout, and the holder gets
LeaseExpiredError with nothing committed. The bounds asserted are generous
(seconds, against the 10 s lock_timeout the rival would otherwise wait).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from pglease import AsyncPostgresStore, LeaseExpiredError, Owner, Permit, PostgresStore
from pglease.types import Claim, Event

A = Owner("host", "a")
B = Owner("host", "b")
TTL = 1.5
#: After the expiry: when the rival claims, and the most its claim may take
#: (the old behaviour: until the holder finished, or LockTimeoutError at 10 s).
RIVAL_AT = 0.5
RIVAL_WITHIN = 3.0
#: How long a stalled holder waits for the rival before giving up on it.
STALL = 20.0


def server_version(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    assert row is not None
    return int(row[0])


def with_options(dsn: str, options: str) -> str:
    params = conninfo.conninfo_to_dict(dsn)
    params["options"] = options
    return conninfo.make_conninfo(**params)  # type: ignore[arg-type]


def assert_no_late_write(events: list[Event]) -> None:
    """Generation 1 wrote nothing: its lease ran out and generation 2 took over."""
    assert [(e.type, e.lease_generation) for e in events] == [
        ("lease.claimed", 1),
        ("lease.expired", 1),
        ("lease.claimed", 2),
    ]


def stall_apply(how: str, wake: threading.Event) -> Callable[[psycopg.Connection[Any]], None]:
    def apply(conn: psycopg.Connection[Any]) -> None:
        if how == "statement":
            conn.execute(f"SELECT pg_sleep({STALL})")
            return
        wake.wait(STALL)  # idle in transaction until the rival has its claim
        if how == "query":
            conn.execute("SELECT 1")
        # "commit": return, and leaving mutate's transaction sends COMMIT

    return apply


def rival_claim(
    dsn: str, schema: str, rid: str, at: float, *, pooler: bool = False
) -> tuple[Claim | None, float]:
    """B's claim at monotonic time `at`: the claim and how long it took."""
    with PostgresStore(dsn, schema=schema, max_size=1, pooler=pooler) as rival:
        time.sleep(max(0.0, at - time.monotonic()))
        started = time.monotonic()
        claim = rival.claim(rid, B, 30)
        return claim, time.monotonic() - started


def stalled_holder(
    holder: PostgresStore, rival_dsn: str, schema: str, rid: str, how: str, *, pooler: bool = False
) -> tuple[Claim | None, float, BaseException | None]:
    """`holder` claims `rid` for TTL and stalls in a fenced mutation (`how`, see
    `stall_apply`); B claims RIVAL_AT after the expiry. Returns B's claim, how
    long it took, and what the holder's mutate raised."""
    claim = holder.claim(rid, A, TTL)
    assert claim is not None
    # The lease expires by the database clock no later than TTL from here.
    expiry = time.monotonic() + TTL
    wake = threading.Event()
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            holder.mutate(Permit(rid, claim.revision, claim), "job.step", stall_apply(how, wake))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        taken, took = rival_claim(rival_dsn, schema, rid, expiry + RIVAL_AT, pooler=pooler)
    finally:
        wake.set()
        thread.join(STALL + 10)
    [error] = outcome
    return taken, took, error


HOW = ["query", "commit", "statement"]


@pytest.mark.parametrize("how", HOW)
def test_a_rival_claims_soon_after_a_stalled_holders_expiry(
    pg_dsn: str, schema: str, how: str
) -> None:
    """Claim ttl 1.5, stall in `mutate` past the expiry (idle, then a query or the
    COMMIT; or one long statement): a rival claiming 0.5 s after the expiry gets
    generation 2 at once, the holder LeaseExpiredError, and its connection is
    replaced, never reused."""
    with PostgresStore(pg_dsn, schema=schema, max_size=1) as holder:
        rid = holder.ensure_resource("job", "stall")
        taken, took, error = stalled_holder(holder, pg_dsn, schema, rid, how)
        assert taken is not None and taken.generation == 2
        assert took < RIVAL_WITHIN
        assert isinstance(error, LeaseExpiredError), repr(error)
        assert "ran out during the fenced mutation" in str(error)
        assert_no_late_write(holder.events(rid))
        # The connection the server ended is gone: the one-connection pool has a new one.
        assert holder.get(rid).lease is not None


@pytest.mark.parametrize("how", HOW)
async def test_an_asyncio_rival_claims_soon_after_a_stalled_holders_expiry(
    pg_dsn: str, schema: str, how: str
) -> None:
    """The asyncio store: the same bound, the same error."""
    async with (
        AsyncPostgresStore(pg_dsn, schema=schema, max_size=1) as holder,
        AsyncPostgresStore(pg_dsn, schema=schema, max_size=1) as rival,
    ):
        rid = await holder.ensure_resource("job", "stall")
        claim = await holder.claim(rid, A, TTL)
        assert claim is not None
        expiry = time.monotonic() + TTL
        wake = asyncio.Event()

        async def apply(conn: psycopg.AsyncConnection[Any]) -> None:
            if how == "statement":
                await conn.execute(f"SELECT pg_sleep({STALL})")
                return
            await asyncio.wait_for(wake.wait(), STALL)
            if how == "query":
                await conn.execute("SELECT 1")

        task = asyncio.ensure_future(
            holder.mutate(Permit(rid, claim.revision, claim), "job.step", apply)
        )
        try:
            await asyncio.sleep(max(0.0, expiry + RIVAL_AT - time.monotonic()))
            started = time.monotonic()
            taken = await rival.claim(rid, B, 30)
            took = time.monotonic() - started
        finally:
            wake.set()
            done = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), STALL + 10)
        assert taken is not None and taken.generation == 2
        assert took < RIVAL_WITHIN
        [error] = done
        assert isinstance(error, LeaseExpiredError), repr(error)
        assert_no_late_write(await holder.events(rid))
        assert (await holder.get(rid)).lease is not None


def test_longer_limits_in_force_are_shortened_never_lengthened(pg_dsn: str, schema: str) -> None:
    """A session whose own limits are long (here 60 s, set at connect; on 17+ a
    transaction_timeout too, whose timer already runs) is still cut at the
    lease's expiry."""
    options = "-c statement_timeout=60s -c idle_in_transaction_session_timeout=60s"
    if server_version(pg_dsn) >= 170000:
        options += " -c transaction_timeout=60s"
    dsn = with_options(pg_dsn, options)
    with PostgresStore(dsn, schema=schema, statement_timeout=None, max_size=1) as holder:
        rid = holder.ensure_resource("job", "long-limits")
        taken, took, error = stalled_holder(holder, pg_dsn, schema, rid, "query")
        assert taken is not None and taken.generation == 2 and took < RIVAL_WITHIN
        assert isinstance(error, LeaseExpiredError), repr(error)

        # With 30 s left the bound (30.5 s) shortens the 60 s in force.
        rid2 = holder.ensure_resource("job", "more-time")
        claim = holder.claim(rid2, A, 30)
        assert claim is not None
        seen = holder.mutate(Permit(rid2, claim.revision, claim), "job.step", settings).value
        assert all(29000 < ms(s) <= 30500 for s in seen), seen


def ms(setting: str) -> int:
    """A time limit as SHOW prints a bounded one (a whole number of ms)."""
    assert setting.endswith("ms"), setting
    return int(setting[:-2])


def settings(conn: psycopg.Connection[Any]) -> list[str]:
    """The statement and idle-in-transaction limits in force."""
    rows = conn.execute(
        "SELECT current_setting(n) FROM unnest(%s::text[]) n",
        [["statement_timeout", "idle_in_transaction_session_timeout"]],
    ).fetchall()
    return [r[0] for r in rows]


def test_the_bound_is_transaction_local_and_only_for_fenced_writes(
    pg_dsn: str, schema: str
) -> None:
    """mutate_begin shortens the limits for its own transaction only; the next
    transaction on the connection, and an unfenced mutation, keep the store's
    (statement_timeout 30 s by default, no idle limit); a limit in force that is
    already shorter than the lease's bound is kept."""
    with PostgresStore(pg_dsn, schema=schema, max_size=1) as store:
        rid = store.ensure_resource("job", "local")
        claim = store.claim(rid, A, 20)
        assert claim is not None
        fenced = store.mutate(Permit(rid, claim.revision, claim), "job.step", settings)
        assert all(19000 < ms(s) <= 20500 for s in fenced.value), fenced.value
        # The next transaction: the store's own limits, also for an unfenced write.
        store.release(claim)
        unfenced = store.mutate(Permit(rid, store.get(rid).revision), "job.note", settings)
        assert unfenced.value == ["30s", "0"]
    with PostgresStore(pg_dsn, schema=schema, statement_timeout=5, max_size=1) as store:
        claim = store.claim(rid, A, 20)
        assert claim is not None
        kept = store.mutate(Permit(rid, claim.revision, claim), "job.step", settings).value
        assert kept[0] == "5s" and 19000 < ms(kept[1]) <= 20500, kept


HOLDER = textwrap.dedent(
    """
    import sys
    from pglease import Owner, Permit, PostgresStore

    dsn, schema, rid, pooler = sys.argv[1:5]
    with PostgresStore(dsn, schema=schema, max_size=1, pooler=pooler == "1") as store:
        claim = store.claim(rid, Owner("host", "a"), float(sys.argv[5]))
        assert claim is not None

        def apply(conn):
            conn.execute("SELECT 1")
            print("inside", flush=True)
            sys.stdin.readline()  # stopped here; continued, it goes on to COMMIT

        try:
            store.mutate(Permit(rid, claim.revision, claim), "job.step", apply)
            print("committed", flush=True)
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)
    """
)


def stopped_holder(
    tmp_path: Path, dsn: str, claim_dsn: str, schema: str, rid: str, pooler: bool
) -> None:
    """A real process claims, opens a fenced mutation and is stopped (SIGSTOP:
    to the server, a host cut off with its transaction open). A rival claims
    0.5 s after the expiry; continued, the holder's COMMIT is refused."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, str(script), dsn, schema, rid, "1" if pooler else "0", str(TTL)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        # The claim was made before "inside": its expiry is at most TTL from here.
        line = proc.stdout.readline()
        assert line == "inside\n", (line, proc.stderr.read() if proc.stderr else "")
        expiry = time.monotonic() + TTL
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            taken, took = rival_claim(claim_dsn, schema, rid, expiry + RIVAL_AT, pooler=pooler)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert taken is not None and taken.generation == 2
        assert took < RIVAL_WITHIN
        out, err = proc.communicate("\n", timeout=60)
        assert out.startswith("LeaseExpiredError"), (out, err)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)


def test_a_stopped_holder_does_not_keep_its_rival_out(
    tmp_path: Path, pg_dsn: str, schema: str
) -> None:
    with PostgresStore(pg_dsn, schema=schema, max_size=1) as store:
        rid = store.ensure_resource("job", "stopped")
        stopped_holder(tmp_path, pg_dsn, pg_dsn, schema, rid, pooler=False)
        assert_no_late_write(store.events(rid))
