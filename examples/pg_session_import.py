import tempfile

from pglease import PostgresStore
from pglease.sessions import PostgresSessionRepository

with PostgresStore() as store, tempfile.TemporaryDirectory() as tmp:
    repo = PostgresSessionRepository(store, import_chunk_entries=500)
    with repo.create("big") as session:
        leaf = None
        for i in range(3):
            leaf = session.append_message(leaf, {"role": "user", "content": f"turn {i}"}).id
        session.set_register("lane.leaf", "main", leaf)
    path = repo.export_to_file("big", tmp)  # streamed from a server-side cursor
    written: list[int] = []
    repo.import_file(path, id="big-copy", on_progress=written.append).close()
    assert "big-copy" in repo.list().ids() and written == [3]
    print(repo.cleanup_imports())  # [] (ids of abandoned partial imports removed)
    repo.delete("big")
    repo.delete("big-copy")
