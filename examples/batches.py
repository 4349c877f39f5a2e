"""Claim, renew and release many leases, one round trip each (README "Batches")."""

from pglease import LeaseLostError, Owner, PostgresStore

with PostgresStore() as store:
    me = Owner("host", "worker-7")
    rids = [store.ensure_resource("shard", f"s{i}") for i in range(10)]
    claims = store.claim_many(rids, me, ttl=30)  # per item: a Claim, or None if held
    mine = [c for c in claims if c is not None]
    renewed = store.renew_many(mine, ttl=30)  # per item: a Claim, or its LeaseLostError
    kept = [c for c in renewed if not isinstance(c, LeaseLostError)]
    revisions = store.release_many(kept)  # per item: the new revision, or its LeaseLostError
    print("claimed", len(mine), "released", sum(isinstance(r, int) for r in revisions))
