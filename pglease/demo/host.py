"""One demo host: claims resources, writes fenced rows, sometimes stalls past its TTL.

Run as ``python -m pglease.demo.host``; reports what happened as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from typing import Any

import psycopg
from psycopg import sql

from ..errors import LeaseLostError, StaleResourceError
from ..postgres import PostgresStore
from ..types import Claim, Owner, Permit

WRITE_EVENT = "demo.write"


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _writer(schema: str, claim: Claim, host: str, step: int) -> Any:
    query = sql.SQL(
        "INSERT INTO {}.demo_writes (resource_id, generation, host, step) VALUES (%s, %s, %s, %s)"
    ).format(sql.Identifier(schema))

    def apply(conn: psycopg.Connection[Any]) -> None:
        conn.execute(query, [claim.resource_id, claim.generation, host, step])

    return apply


def _write(store: PostgresStore, claim: Claim, host: str, step: int) -> Claim:
    result = store.mutate(
        Permit(claim.resource_id, claim.revision, claim),
        WRITE_EVENT,
        _writer(store.schema, claim, host, step),
        payload={"host": host, "step": step},
    )
    return replace(claim, revision=result.revision)


def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    owner = Owner("host", args.host)
    with PostgresStore(args.dsn, schema=args.schema, max_size=1, auto_migrate=False) as store:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            rid = rng.choice(args.resources)
            claim = store.claim(rid, owner, args.ttl)
            if claim is None:
                time.sleep(rng.uniform(0.01, 0.05))
                continue
            report(kind="claimed", resource=rid, generation=claim.generation)
            try:
                for step in range(rng.randint(2, 5)):
                    claim = _write(store, claim, args.host, step)
                    time.sleep(args.ttl / 6)
                    claim = store.renew(claim, args.ttl)
            except (LeaseLostError, StaleResourceError) as exc:
                report(kind="lost", resource=rid, generation=claim.generation, error=str(exc))
                continue
            if rng.random() < args.pause_probability:
                # A stop-the-world pause longer than the TTL, then a late write: the
                # database must refuse it because the lease ran out (or was taken over).
                time.sleep(args.ttl * 1.5)
                try:
                    _write(store, claim, args.host, 99)
                    report(kind="late_write_accepted", resource=rid, generation=claim.generation)
                except (LeaseLostError, StaleResourceError):
                    report(kind="fenced", resource=rid, generation=claim.generation)
            else:
                store.release(claim)
                report(kind="released", resource=rid, generation=claim.generation)


def main() -> None:
    parser = argparse.ArgumentParser(prog="pglease.demo.host")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--pause-probability", type=float, default=0.2)
    parser.add_argument("resources", nargs="+")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
