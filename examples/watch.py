"""Watch the event log, save a cursor, resume from it with no gap (README "Watchers")."""

from pglease import Owner, PostgresStore

with PostgresStore() as store:
    rid = store.ensure_resource("run", "watched")
    with store.watch(after="now", resources=rid) as watcher:
        claim = store.claim(rid, Owner("host", "h1"), ttl=10)
        assert claim is not None
        event = watcher.get(timeout=30)  # or iterate: `for event in watcher`
        assert event is not None
        saved = event.cursor  # opaque, printable; store it with your progress
        print("seen", event.type)
    store.release(claim)  # happens while nobody watches
    with store.watch(after=saved, resources=rid) as watcher:  # resume
        missed = watcher.get(timeout=30)
        assert missed is not None
        print("resumed with", missed.type)
