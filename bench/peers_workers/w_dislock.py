"""dislock (PyPI), two ways.

``--mode leaselock``: its public ``LeaseLock`` as a user writes it: ``with LeaseLock(ctx):``
per cycle. Each entry opens a connection for the claim and starts the renewer thread
(which opens its own); each exit opens a third to expire the row. A busy key raises
``LockNotAcquiredError`` (counted as refused).

``--mode sql``: the same SQL through dislock's own statement functions
(``try_acquire_run_lock`` / ``expire_lock_now``) on one persistent connection per
thread, committed after each: what its queries cost without the per-lock connections.
"""

from __future__ import annotations

import importlib.metadata
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from _harness import Cycle, key_index, parse_args, run_threads
from dislock import LeaseLock, LockContext, LockNotAcquiredError
from dislock.core import expire_lock_now, try_acquire_run_lock

TABLE = ["peers_dislock", "key_value"]
TTL = 30.0


def main() -> None:
    args = parse_args()
    conns: list[psycopg.Connection] = []

    def make_leaselock(i: int) -> Cycle:
        contexts = [
            LockContext(
                url=args.target,
                table_parts=TABLE,
                lock_key=f"k{k}",
                owner=f"w{i}",
                run_ttl_seconds=TTL,
                lease_interval_seconds=10.0,
            )
            for k in range(args.keys)
        ]

        def cycle(rng: random.Random) -> bool:
            try:
                with LeaseLock(contexts[key_index(rng, args)]):
                    return True
            except LockNotAcquiredError:
                return False

        return cycle

    def make_sql(i: int) -> Cycle:
        conn = psycopg.connect(args.target, autocommit=False)
        conns.append(conn)
        me = f"w{i}"

        def cycle(rng: random.Random) -> bool:
            key = f"cronjob-lock:lease:k{key_index(rng, args)}"
            acquired, _ = try_acquire_run_lock(conn, TABLE, key, TTL, me)
            conn.commit()
            if not acquired:
                return False
            expire_lock_now(conn, TABLE, key, me)
            conn.commit()
            return True

        return cycle

    def close() -> None:
        for c in conns:
            c.close()

    versions = {"dislock": importlib.metadata.version("dislock"), "psycopg": psycopg.__version__}
    make = make_sql if args.mode == "sql" else make_leaselock
    run_threads(args, make, {"versions": versions}, close)


if __name__ == "__main__":
    main()
