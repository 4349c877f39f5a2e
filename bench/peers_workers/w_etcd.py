"""etcd through the aetcd asyncio client: N tasks share one client (one gRPC channel).

``--mode txn``: per cycle, grant a lease (ttl 30 s), put the key with it only if absent
(a txn comparing the key's version to 0), then revoke the lease (which deletes the key);
a refused claim revokes its unused lease too.

``--mode session``: the session pattern: each task grants one lease up front (kept alive
by a background refresh) and a cycle is the put-if-absent txn with that lease, then a
delete of the key. ``--target`` is ``host:port``.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import random
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aetcd
from _harness import AsyncCycle, Closer, key_index, parse_args, run_tasks

TTL = 30


def main() -> None:
    args = parse_args()
    host, _, port = args.target.rpartition(":")
    names = [f"/peers/k{k}".encode() for k in range(args.keys)]

    async def setup() -> tuple[Callable[[int], Awaitable[AsyncCycle]], Closer]:
        client = aetcd.Client(host=host, port=int(port), timeout=30)
        await client.connect()
        tx = client.transactions
        leases: list[aetcd.leases.Lease] = []
        refreshers: list[asyncio.Task[None]] = []

        async def keep_alive(lease: aetcd.leases.Lease) -> None:
            while True:
                await asyncio.sleep(TTL / 3)
                await lease.refresh()

        async def make(i: int) -> AsyncCycle:
            me = f"w{i}".encode()
            if args.mode == "session":
                lease = await client.lease(TTL)
                leases.append(lease)
                refreshers.append(asyncio.create_task(keep_alive(lease)))

                async def session_cycle(rng: random.Random) -> bool:
                    key = names[key_index(rng, args)]
                    ok, _ = await client.transaction(
                        compare=[tx.version(key) == 0],
                        success=[tx.put(key, me, lease=lease.id)],
                        failure=[],
                    )
                    if not ok:
                        return False
                    await client.delete(key)
                    return True

                return session_cycle

            async def txn_cycle(rng: random.Random) -> bool:
                key = names[key_index(rng, args)]
                lease = await client.lease(TTL)
                try:
                    ok, _ = await client.transaction(
                        compare=[tx.version(key) == 0],
                        success=[tx.put(key, me, lease=lease.id)],
                        failure=[],
                    )
                finally:
                    await lease.revoke()
                return bool(ok)

            return txn_cycle

        async def close() -> None:
            for t in refreshers:
                t.cancel()
            for lease in leases:
                await lease.revoke()
            await client.close()

        return make, close

    versions = {
        "aetcd": importlib.metadata.version("aetcd"),
        "grpcio": importlib.metadata.version("grpcio"),
    }
    run_tasks(args, setup, {"versions": versions})


if __name__ == "__main__":
    main()
