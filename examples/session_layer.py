import tempfile

from pglease.sessions import Session, SessionRepository

with SessionRepository(tempfile.mkdtemp()) as repo, Session.create(repo) as session:
    first = session.append("main", "message", {"message": {"role": "user", "content": "hi"}})
    session.append("main", "message", {"message": {"role": "user", "content": "more"}})
    with session.fork(at=first.id) as forked:  # or fork(): the whole branch
        print("forked", [e.id for e in forked.branch()] == [first.id])
