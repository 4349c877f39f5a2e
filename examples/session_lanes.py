import tempfile

from pglease.sessions import Session, SessionRepository

with SessionRepository(tempfile.mkdtemp()) as repo, Session.create(repo, "demo") as session:
    hello = session.append("main", "message", {"message": {"role": "user", "content": "hi"}})
    usage = {"input": 12, "output": 3, "totalTokens": 15}
    reply = {"role": "assistant", "content": "hello", "usage": usage}
    session.append("main", "message", {"message": reply}, usage=usage)
    session.set_label(hello.id, "start")
    session.set_name("demo session")
    config = {
        "model": {"provider": "p", "modelId": "m"},
        "thinkingLevel": "low",
        "activeToolNames": [],
    }
    session.add_lane("side", config, at=hello.id)  # a second lane, branching at hello
    session.append("side", "message", {"message": {"role": "user", "content": "aside"}})

    assert session.lanes() == ["main", "side"]
    assert next(e.id for e in session.branch("main")) == hello.id  # root to leaf
    assert session.usage()["totalTokens"] == 15  # the usage ledger
    assert session.labels() == {hello.id: "start"}
    with session.fork(lane="side") as forked:  # default: the lane's current leaf
        print("forked", forked.id, len(forked.branch()), "entries")
