"""python-redis-lock on one redis-py client (its thread-safe connection pool of N).

Each cycle: ``redis_lock.Lock(conn, name, expire=30)``, ``acquire(blocking=False)``,
``release()`` (both Lua scripts run by EVALSHA). ``--target`` is the unix socket path.
"""

from __future__ import annotations

import importlib.metadata
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis
import redis_lock
from _harness import Cycle, key_index, parse_args, run_threads


def main() -> None:
    args = parse_args()
    conn = redis.Redis(unix_socket_path=args.target, max_connections=args.threads + 2)
    conn.ping()
    names = [f"k{k}" for k in range(args.keys)]

    def make(i: int) -> Cycle:
        def cycle(rng: random.Random) -> bool:
            lock = redis_lock.Lock(conn, names[key_index(rng, args)], expire=30)
            if not lock.acquire(blocking=False):
                return False
            lock.release()
            return True

        return cycle

    versions = {
        "python-redis-lock": importlib.metadata.version("python-redis-lock"),
        "redis-py": redis.__version__,
        "server": str(conn.info("server").get("redis_version")),
    }
    run_threads(args, make, {"versions": versions}, conn.close)


if __name__ == "__main__":
    main()
