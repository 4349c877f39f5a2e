"""pglease: one PostgresStore (pool of N) shared by N threads, or one AsyncPostgresStore
shared by N tasks (``--mode async``). Resources come from the schema's ensure_resource()."""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from _harness import AsyncCycle, Closer, Cycle, key_index, parse_args, run_tasks, run_threads

import pglease
from pglease import AsyncPostgresStore, Owner, PostgresStore

SCHEMA = "peers_pglease"
OWNER = Owner("bench", "peer")
TTL = 30.0


def resource_ids(dsn: str, keys: int) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT "{SCHEMA}".ensure_resource(%s, %s || g) FROM generate_series(0, %s) g',
            ["bench", "k", keys - 1],
        ).fetchall()
    return [str(r[0]) for r in rows]


def main() -> None:
    args = parse_args()
    ids = resource_ids(args.target, args.keys)
    extra = {"versions": {"pglease": pglease.__version__, "psycopg": psycopg.__version__}}
    if args.mode == "async":
        run_async(args, ids, extra)
        return
    store = PostgresStore(
        args.target,
        schema=SCHEMA,
        min_size=args.threads,
        max_size=args.threads,
        auto_migrate=False,
    )

    def make(i: int) -> Cycle:
        claim, release = store.claim, store.release

        def cycle(rng: random.Random) -> bool:
            c = claim(ids[key_index(rng, args)], OWNER, TTL)
            if c is None:
                return False
            release(c)
            return True

        return cycle

    run_threads(args, make, extra, store.close)


def run_async(args: argparse.Namespace, ids: list[str], extra: dict[str, Any]) -> None:
    async def setup() -> tuple[Callable[[int], Awaitable[AsyncCycle]], Closer]:
        store = await AsyncPostgresStore.open(
            args.target,
            schema=SCHEMA,
            min_size=args.threads,
            max_size=args.threads,
            auto_migrate=False,
        )
        await store.pool.wait()

        async def make(i: int) -> AsyncCycle:
            async def cycle(rng: random.Random) -> bool:
                c = await store.claim(ids[key_index(rng, args)], OWNER, TTL)
                if c is None:
                    return False
                await store.release(c)
                return True

            return cycle

        return make, store.close

    run_tasks(args, setup, extra)


if __name__ == "__main__":
    main()
