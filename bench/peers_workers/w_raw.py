"""Raw psycopg: the smallest fenced lease in SQL, one autocommit connection per thread.

The table (made by bench/peers.py) is ``peers_raw.lease(key, holder, expires_at, gen)``
with every key pre-inserted; a claim is one UPDATE that takes a free or expired row
and bumps its generation, a release one UPDATE guarded by holder and generation.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from _harness import Cycle, key_index, parse_args, run_threads

CLAIM = (
    "UPDATE peers_raw.lease SET holder = %s, expires_at = now() + interval '30 seconds',"
    " gen = gen + 1 WHERE key = %s AND (holder IS NULL OR expires_at <= now()) RETURNING gen"
)
RELEASE = (
    "UPDATE peers_raw.lease SET holder = NULL, expires_at = NULL"
    " WHERE key = %s AND holder = %s AND gen = %s"
)


def main() -> None:
    args = parse_args()
    keys = [f"k{i}" for i in range(args.keys)]
    conns: list[psycopg.Connection] = []

    def make(i: int) -> Cycle:
        conn = psycopg.connect(args.target, autocommit=True)
        conns.append(conn)
        me = f"w{i}"

        def cycle(rng: random.Random) -> bool:
            key = keys[key_index(rng, args)]
            row = conn.execute(CLAIM, [me, key]).fetchone()
            if row is None:
                return False
            conn.execute(RELEASE, [key, me, row[0]])
            return True

        return cycle

    def close() -> None:
        for c in conns:
            c.close()

    run_threads(args, make, {"versions": {"psycopg": psycopg.__version__}}, close)


if __name__ == "__main__":
    main()
