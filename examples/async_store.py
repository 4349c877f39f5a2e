"""The asyncio twin: the same names and semantics, awaited (README "Python API")."""

import asyncio

from pglease import AsyncPostgresStore, Owner


async def main() -> None:
    async with AsyncPostgresStore() as store:  # or AsyncPostgresStore(dsn)
        rid = await store.ensure_resource("run", "nightly-43")
        claim = await store.claim(rid, Owner("host", "worker-7"), ttl=30)
        if claim is not None:
            print("claimed generation", claim.generation)
            await store.release(claim)


asyncio.run(main())
