"""OpenStack tooz with its PostgreSQL driver (psycopg2, advisory locks).

One coordinator per process; each cycle takes ``coordinator.get_lock(name)`` and
``acquire(blocking=False)`` then ``release()``. The driver opens a connection for each
acquire and closes it on release (or on a refusal), and maps a name to a 2-byte
advisory lock id (md5), so 10,000 names share 65,536 ids.
"""

from __future__ import annotations

import importlib.metadata
import random
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Cycle, key_index, parse_args, run_threads
from tooz import coordination


def main() -> None:
    args = parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)  # the driver says it is deprecated
    coordinator = coordination.get_coordinator(args.target, b"peers-bench")
    coordinator.start()
    names = [f"k{k}".encode() for k in range(args.keys)]

    def make(i: int) -> Cycle:
        def cycle(rng: random.Random) -> bool:
            lock = coordinator.get_lock(names[key_index(rng, args)])
            if not lock.acquire(blocking=False):
                return False
            lock.release()
            return True

        return cycle

    versions = {
        "tooz": importlib.metadata.version("tooz"),
        "psycopg2": importlib.metadata.version("psycopg2-binary"),
    }
    run_threads(args, make, {"versions": versions}, coordinator.stop)


if __name__ == "__main__":
    main()
