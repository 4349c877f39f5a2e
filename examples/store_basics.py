"""Claim a lease, renew it, make a fenced write, release (README "Python API")."""

from pglease import Owner, Permit, PostgresStore

with PostgresStore() as store:  # $PGLEASE_DSN or the embedded server
    with store.connection() as conn:  # the application's own table
        conn.execute("CREATE TABLE IF NOT EXISTS jobs (id int PRIMARY KEY, state text)")
        conn.execute("INSERT INTO jobs VALUES (42, 'queued') ON CONFLICT DO NOTHING")
    rid = store.ensure_resource("run", "nightly-42")  # idempotent, writes no event
    me = Owner("host", "worker-7")
    claim = store.claim(rid, me, ttl=30)  # None while someone else holds it
    if claim is not None:
        claim = store.renew(claim, ttl=30)
        # A fenced write: the permit's revision and lease are checked under the row
        # lock in the same transaction that runs your SQL and appends the event.
        store.mutate(
            Permit(rid, claim.revision, claim),
            "run.started",
            lambda conn: conn.execute("UPDATE jobs SET state = 'running' WHERE id = 42"),
            payload={"attempt": 1},
        )
        store.release(claim)
        print("generation", claim.generation, "revision", store.get(rid).revision)
