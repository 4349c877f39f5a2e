from pglease import Owner, PostgresStore


def test_claim_release_roundtrip(pg_store: PostgresStore) -> None:
    rid = pg_store.ensure_resource("run", "smoke")
    claim = pg_store.claim(rid, Owner("host", "a"), 5)
    assert claim is not None and claim.generation == 1
    assert pg_store.release(claim) == 2
