"""Hold a lease with heartbeats, wait for one, elect a leader (README "Fleet runtime")."""

from pglease import Owner, PostgresStore

with PostgresStore() as store:
    me = Owner("host", "h1")
    with store.hold("run", "nightly", me, ttl=10) as lease:  # renewed by the keeper
        lease.check()  # raises LeaseLostError once lost
        fence = lease.generation  # the fencing token for downstream systems
        revision = store.get(lease.resource_id).revision
        store.mutate(lease.permit(revision), "run.step", payload={"fence": fence})
        assert not lease.wait_lost(0)  # lease.lost: a threading.Event

    # Wait (up to 30 s) for the lease, in arrival order among waiters.
    claim = store.acquire("run", "nightly", me, ttl=10, timeout=30, fair=True)
    store.release(claim)

    election = store.elect("scheduler", me, ttl=10, on_elected=lambda lease: print("elected"))
    with election:
        assert election.wait_elected(timeout=30)
        leader = store.leader("scheduler")  # Leader(owner, generation, expires_at)
        assert leader is not None and leader.owner == me
    print("leader was", leader.owner.id)
