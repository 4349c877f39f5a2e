"""Where the asyncio store's time goes beyond the asyncio floor, step by step.

Three sides, each N tasks in one event loop on one throwaway embedded
PostgreSQL (or ``--dsn``), interleaved round by round (ABC, CBA, ...):

- ``floor``: the store's prepared claim and release sent with libpq's
  non-blocking calls and read with the fast path's own `results_async`, with
  fixed arguments (what ``claim_release.py --apq`` runs);
- ``floor+calls``: the same round trips, plus the Python the store runs per
  call around them: the argument checks, a fresh token and its sha256
  (`_common.claim_op` / `release_op`), the parameter lists and the `Claim`
  built from the result;
- ``store``: `AsyncPostgresStore.claim` / `release` (adds the connection
  stack, its liveness poll, error handling, the layers and the metrics hook).

Printed per side: cycles/s and its ratio to the floor, and this process's user
and system CPU per cycle (medians over the rounds). No throughput is asserted:
the figures say which part of the store's client work separates it from the
floor on this machine.

    python bench/asyncio_breakdown.py [--clients 1 4 8] [--seconds 3] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
from _server import machine_info, throwaway_server
from claim_release import OWNER_ID, OWNER_TYPE, load_average, setup_schema, tidy

from pglease import AsyncPostgresStore, Owner, _common
from pglease.postgres._fastpath import (
    CLAIM,
    RELEASE,
    FastPath,
    claim_values,
    from_micros,
    release_values,
    results_async,
    unwatch,
)
from pglease.types import Claim

#: (cycles/s, user us/cycle, system us/cycle) of one round.
Sample = tuple[float, float, float]
SIDES = ("floor", "floor+calls", "store")
CLAIM_FORMATS = [0, 0, 0, 1, 0, 0, 0]
RELEASE_FORMATS = [0, 0, 0, 0, 1, 0, 0]


async def _measure(
    clients: int,
    seconds: float,
    loop: Callable[[int, list[int], asyncio.Event], Coroutine[Any, Any, None]],
) -> Sample:
    counts = [0] * clients
    stop = asyncio.Event()
    tasks = [asyncio.create_task(loop(i, counts, stop)) for i in range(clients)]
    await asyncio.sleep(0.5)  # warm-up
    c0, r0, t0 = sum(counts), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.sleep(seconds)
    c1, r1, t1 = sum(counts), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    cycles = max(c1 - c0, 1)
    return (
        cycles / (t1 - t0),
        1e6 * (r1.ru_utime - r0.ru_utime) / cycles,
        1e6 * (r1.ru_stime - r0.ru_stime) / cycles,
    )


async def run_floor(
    dsn: str, schema: str, ids: list[str], clients: int, seconds: float, calls: bool
) -> Sample:
    """The floor; with `calls`, plus the store's per-call Python around each round trip."""
    fast = FastPath(schema)
    owner = Owner(OWNER_TYPE, OWNER_ID)
    token = b"\x00" * 32  # the floor's fixed token hash
    who = [OWNER_TYPE.encode(), OWNER_ID.encode()]
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(clients)]
    try:
        for conn in conns:
            for name, text in fast.statements.items():
                conn.pgconn.prepare(name, text.encode())

        async def loop(i: int, counts: list[int], stop: asyncio.Event) -> None:
            rng, conn = random.Random(i), conns[i]
            pg = conn.pgconn
            while not stop.is_set():
                rid = ids[rng.randrange(len(ids))]
                if calls:
                    op = _common.claim_op(rid, owner, 30.0, None, None)
                    values: list[Any] = claim_values(op)
                else:
                    values = [rid.encode(), *who, token, b"30.0", None, None]
                pg.send_query_prepared(CLAIM, values, CLAIM_FORMATS)
                res = (await results_async(conn))[-1]
                if res.get_value(0, 0) == b"t":
                    generation = res.get_value(0, 1) or b""
                    if calls:
                        claim = Claim(
                            op.resource_id,
                            op.owner,
                            op.token,
                            int(generation),
                            from_micros(res.get_value(0, 2) or b""),
                            int(res.get_value(0, 3) or b""),
                        )
                        values = release_values(_common.release_op(claim, None, None))
                    else:
                        values = [rid.encode(), *who, generation, token, None, None]
                    pg.send_query_prepared(RELEASE, values, RELEASE_FORMATS)
                    await results_async(conn)
                counts[i] += 1

        return await _measure(clients, seconds, loop)
    finally:
        for conn in conns:
            unwatch(conn)
            await conn.close()


async def run_store(dsn: str, schema: str, ids: list[str], clients: int, seconds: float) -> Sample:
    owner = Owner(OWNER_TYPE, OWNER_ID)
    async with AsyncPostgresStore(
        dsn, schema=schema, min_size=clients, max_size=clients, auto_migrate=False
    ) as store:
        await store.pool.wait()

        async def loop(i: int, counts: list[int], stop: asyncio.Event) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                claim = await store.claim(ids[rng.randrange(len(ids))], owner, 30.0)
                if claim is not None:
                    await store.release(claim)
                counts[i] += 1

        return await _measure(clients, seconds, loop)


def run_side(side: str, dsn: str, schema: str, ids: list[str], clients: int, s: float) -> Sample:
    if side == "store":
        return asyncio.run(run_store(dsn, schema, ids, clients, s))
    return asyncio.run(run_floor(dsn, schema, ids, clients, s, calls=side == "floor+calls"))


def bench(dsn: str, args: argparse.Namespace) -> None:
    schema = "pglease_breakdown"
    ids = setup_schema(dsn, schema, args.resources)
    print(f"load average at start: {load_average()}")
    print(
        "| tasks | side | cycles/s | of floor | user us/cycle | system us/cycle"
        " | rounds (of floor) |"
    )
    print("|---:|:---|---:|---:|---:|---:|---|")
    for clients in args.clients:
        samples: dict[str, list[Sample]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                tidy(dsn, schema)
                samples[side].append(run_side(side, dsn, schema, ids, clients, args.seconds))
        floor_rates = [s[0] for s in samples["floor"]]
        floor = statistics.median(floor_rates)
        for side in SIDES:
            rates = [s[0] for s in samples[side]]
            rounds = " ".join(f"{x / f:.2f}" for x, f in zip(rates, floor_rates, strict=True))
            user = statistics.median(s[1] for s in samples[side])
            system = statistics.median(s[2] for s in samples[side])
            rate = statistics.median(rates)
            print(
                f"| {clients} | {side} | {rate:,.0f} | {rate / floor:.2f} | {user:.0f}"
                f" | {system:.0f} | {rounds} |",
                flush=True,
            )
    print(f"load average at end: {load_average()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="use this server instead of a throwaway embedded one")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--resources", type=int, default=10_000)
    args = parser.parse_args()
    facts = machine_info()
    print("# asyncio store breakdown: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    if args.dsn:
        bench(args.dsn, args)
    else:
        with throwaway_server() as dsn:
            bench(dsn, args)


if __name__ == "__main__":
    main()
