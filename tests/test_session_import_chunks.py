"""Import chunks as one statement each (sql/0015, sql/functions/40_sessions.sql):
the token is checked by the server, bad arguments are refused by the function
and change nothing, the chunked import still equals its source, and a schema
upgraded to 0015 ends identical to a fresh one."""

from __future__ import annotations

import random
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pglease import AsyncPostgresStore, PostgresStore
from pglease._migration_core import MigrationState, _apply_statements
from pglease.migration_files import FunctionSet, load_functions, load_migrations
from pglease.sessions import (
    AppendEntry,
    AsyncPostgresSessionRepository,
    InvalidSessionWriteError,
    PostgresSessionRepository,
    SessionError,
    SessionRepository,
    SetRegister,
    plan_fork,
    read_session_file,
)
from pglease.sessions.pg_core import Sql, import_refusal

from .test_session_pg import Clock, msg
from .test_session_streaming import index_rows, source_file


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pg_repo(pg_store: PostgresStore, clock: Clock) -> Iterator[PostgresSessionRepository]:
    with PostgresSessionRepository(pg_store, renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture
async def apg_repo(
    apg_store: AsyncPostgresStore, clock: Clock
) -> AsyncIterator[AsyncPostgresSessionRepository]:
    async with AsyncPostgresSessionRepository(apg_store, renew_interval=None, now_ms=clock) as repo:
        yield repo


@pytest.fixture
def files(tmp_path: Path, clock: Clock) -> Iterator[SessionRepository]:
    directory = tmp_path / "files"
    directory.mkdir()
    with SessionRepository(directory, renew_interval=None, now_ms=clock) as repo:
        yield repo


def import_state(dsn: str, schema: str, session_id: str) -> tuple[Any, ...] | None:
    """The hidden session row's token and progress time, as the owner sees them."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            f'SELECT import_token, import_touched_at FROM "{schema}".sessions WHERE id = %s',
            (session_id,),
        ).fetchone()


def table_rows(dsn: str, schema: str, session_id: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of one session in every session table (hidden or not)."""
    with psycopg.connect(dsn) as conn:
        out = {}
        for table, order in (
            ("sessions", "id"),
            ("session_entries", "seq"),
            ("session_registers", "namespace, key"),
            ("session_branch_entries", "branch_id, entry_seq"),
            ("session_branch_meta", "branch_id"),
        ):
            column = "id" if table == "sessions" else "session_id"
            out[table] = conn.execute(
                f'SELECT * FROM "{schema}".{table} WHERE {column} = %s ORDER BY {order}',
                (session_id,),
            ).fetchall()
        return out


# --- the token, checked by the server --------------------------------------------------------


def test_a_chunk_with_a_stale_token_changes_nothing_and_says_the_import_is_gone(
    pg_repo: PostgresSessionRepository, files: SessionRepository, pg_dsn: str, schema: str
) -> None:
    """After the second chunk another party takes the hidden partial over (a
    new token, as a cleanup's take does, without purging it yet): the
    importer's third chunk is refused by the server, writes no row, does not
    move the progress time, and the importer's clean-up leaves the new
    owner's partial alone."""
    path = source_file(files)
    taken: list[tuple[dict[str, list[tuple[Any, ...]]], tuple[Any, ...] | None]] = []

    def take_over(written: int) -> None:
        if written == 10 and not taken:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(
                    f"UPDATE \"{schema}\".sessions SET import_token = 'someone else'"
                    " WHERE id = 'imp'"
                )
            taken.append((table_rows(pg_dsn, schema, "imp"), import_state(pg_dsn, schema, "imp")))

    with pytest.raises(SessionError, match="import of session imp was removed while it ran"):
        pg_repo.import_file(path, id="imp", chunk_entries=5, on_progress=take_over)
    [(rows, state)] = taken
    assert len(rows["session_entries"]) == 10 and rows["session_branch_entries"]
    assert table_rows(pg_dsn, schema, "imp") == rows
    assert import_state(pg_dsn, schema, "imp") == state
    assert not pg_repo.exists("imp") and "imp" not in pg_repo.list().ids()


def _hidden_import(store: PostgresStore, dsn: str, schema: str, session_id: str) -> str:
    """A hidden import row with no chunk yet (as `_begin_import` writes it); its token."""
    rid = store.ensure_resource("session", session_id)
    token = f"token-{session_id}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(Sql(schema).begin_import, (session_id, rid, None, 1, "{}", token))
    return token


def _chunk_args(token: str, **changes: Any) -> dict[str, Any]:
    """Arguments of a valid one-entry chunk (a root and its segment), with `changes`."""
    args: dict[str, Any] = {
        "p_session": "imp",
        "p_token": token,
        "p_ids": ["r"],
        "p_parent_ids": [None],
        "p_seqs": [1],
        "p_types": ["message"],
        "p_custom_types": [None],
        "p_timestamps": [5],
        "p_payloads": ['{"message":{"role":"user"}}'],
        "p_seg_ids": ["r"],
        "p_seg_tips": ["r"],
        "p_seg_tip_seqs": [1],
        "p_seg_bases": [None],
        "p_seg_base_seqs": [None],
        "p_move_ids": [],
        "p_move_tips": [],
        "p_move_tip_seqs": [],
        "p_row_branches": ["r"],
        "p_row_entries": ["r"],
        "p_row_seqs": [1],
        "p_row_types": ["message"],
    }
    args.update(changes)
    return args


_TYPES = {
    "seqs": "bigint[]",
    "timestamps": "bigint[]",
    "tip_seqs": "bigint[]",
    "base_seqs": "bigint[]",
}


def _call_chunk(dsn: str, schema: str, args: dict[str, Any]) -> Any:
    def cast(name: str) -> str:
        if name in ("p_session", "p_token"):
            return "text"
        return next((t for k, t in _TYPES.items() if name.endswith(k)), "text[]")

    named = ", ".join(f"{name} => %({name})s::{cast(name)}" for name in args)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT "{schema}".session_import_chunk({named})', args).fetchone()


def test_a_chunk_with_a_wrong_token_is_refused_by_the_server(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    token = _hidden_import(pg_store, pg_dsn, schema, "imp")
    before = (table_rows(pg_dsn, schema, "imp"), import_state(pg_dsn, schema, "imp"))
    for wrong in ("not-the-token", token + "x"):
        with pytest.raises(psycopg.Error) as caught:
            _call_chunk(pg_dsn, schema, _chunk_args(wrong))
        error = import_refusal(caught.value)
        assert type(error) is SessionError
        assert "import of session imp was removed while it ran" in str(error)
    assert (table_rows(pg_dsn, schema, "imp"), import_state(pg_dsn, schema, "imp")) == before
    # The right token writes the chunk and moves the progress time.
    assert _call_chunk(pg_dsn, schema, _chunk_args(token)) == (1,)
    after, state = import_state(pg_dsn, schema, "imp"), before[1]
    assert after is not None and state is not None and after[1] > state[1]
    assert [r[1] for r in table_rows(pg_dsn, schema, "imp")["session_entries"]] == ["r"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"p_token": ""}, "needs a session id and an import token"),
        ({"p_session": None}, "needs a session id and an import token"),
        ({"p_seqs": [1, 2]}, r"the entry arrays differ in length \(1, 1, 2, 1, 1, 1, 1\)"),
        ({"p_payloads": None}, "the entry arrays must not be NULL"),
        ({"p_ids": [None]}, "an entry id, seq, type, timestamp or payload is NULL"),
        ({"p_row_seqs": [None]}, "a NULL id, tip or seq"),
        ({"p_seg_base_seqs": [3]}, "a segment base needs both its branch and its seq"),
        (
            {
                "p_seg_ids": ["r", "s"],
                "p_seg_tips": ["r", "s"],
                "p_seg_tip_seqs": [1, 2],
                "p_seg_bases": [None, None],
                "p_seg_base_seqs": [None, None],
            },
            "2 segment rows; at most 1 fit in one chunk",
        ),
        (
            {"p_move_ids": ["nowhere"], "p_move_tips": ["r"], "p_move_tip_seqs": [1]},
            "1 of 1 tip moves found no segment",
        ),
    ],
)
def test_bad_chunk_arguments_are_refused_and_change_nothing(
    pg_store: PostgresStore, pg_dsn: str, schema: str, changes: dict[str, Any], message: str
) -> None:
    token = _hidden_import(pg_store, pg_dsn, schema, "imp")
    before = (table_rows(pg_dsn, schema, "imp"), import_state(pg_dsn, schema, "imp"))
    with pytest.raises(psycopg.Error) as caught:
        _call_chunk(pg_dsn, schema, _chunk_args(token, **changes))
    error = import_refusal(caught.value)
    assert isinstance(error, InvalidSessionWriteError)
    assert error.args[0].startswith(("an import chunk", "import chunk of session 'imp'"))
    assert re.search(message, str(error))
    assert (table_rows(pg_dsn, schema, "imp"), import_state(pg_dsn, schema, "imp")) == before


def test_bad_register_chunks_are_refused_and_change_nothing(
    pg_store: PostgresStore, pg_dsn: str, schema: str
) -> None:
    token = _hidden_import(pg_store, pg_dsn, schema, "imp")
    before = (table_rows(pg_dsn, schema, "imp"), import_state(pg_dsn, schema, "imp"))
    call = f'SELECT "{schema}".session_import_registers(%s, %s, %s, %s, %s::bigint[], %s)'
    cases = [
        (("imp", token, ["a", "a"], ["k", "k"], [1, 2], ["1", "2"]), "appears twice"),
        (("imp", token, ["a"], ["k"], [1], [None]), "namespace, key, seq or value is NULL"),
        (("imp", token, ["a"], ["k", "l"], [1], ["1"]), "register arrays differ in length"),
        (("imp", "wrong", ["a"], ["k"], [1], ["1"]), "was removed while it ran"),
    ]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for args, message in cases:
            with pytest.raises(psycopg.Error) as caught:
                conn.execute(call, args)
            error = import_refusal(caught.value)
            assert isinstance(error, SessionError) and message in str(error)
    assert (table_rows(pg_dsn, schema, "imp"), import_state(pg_dsn, schema, "imp")) == before


def test_other_driver_errors_are_not_taken_for_refusals(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute("SELECT 1/0")
    assert import_refusal(caught.value) is None


# --- the result is unchanged ------------------------------------------------------------------


def random_tree(files: SessionRepository, name: str, seed: int, size: int) -> Path:
    """A file session of `size` entries with random parents (divergences off
    old entries and off entries just written), compactions and labels."""
    rng = random.Random(seed)
    ids: list[str] = []
    with files.create(name) as session:
        writes: list[Any] = []
        for i in range(size):
            parent = None
            if ids:
                r = rng.random()
                if r < 0.6:
                    parent = ids[-1]  # the chain goes on
                elif r < 0.85:
                    parent = ids[-rng.randint(1, min(4, len(ids)))]  # off a recent entry
                else:
                    parent = rng.choice(ids)  # off any earlier one
            kind = "compaction" if rng.random() < 0.1 else "message"
            payload: dict[str, Any] = (
                {"summary": f"s{i}", "retainedTail": [], "tokensBefore": i, "fromHook": False}
                if kind == "compaction"
                else {"message": msg(f"m{i}")}
            )
            writes.append(AppendEntry(kind, parent, payload, id=f"n{i}"))
            ids.append(f"n{i}")
            if len(writes) >= 7:
                session.commit(writes)
                writes = []
        writes.append(SetRegister("lane.leaf", "main", ids[-1]))
        writes.append(SetRegister("fact.label", ids[size // 2], "half"))
        session.commit(writes)
    return files.path_for(name)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chunked_imports_of_random_trees_equal_the_plan(
    pg_repo: PostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
    seed: int,
) -> None:
    """Divergences inside a chunk, off a segment the same chunk extended, and
    off earlier chunks: the branch index each chunk computes from the server's
    rows plus its own unsent ones equals the index of the plan written in one
    transaction, row for row, for any chunk size."""
    path = random_tree(files, f"tree{seed}", seed, 60)
    with pg_repo.create_from_plan(plan_fork(read_session_file(path), "src", "tree"), "ref"):
        pass
    reference = index_rows(pg_dsn, schema, "ref")
    ref = pg_repo.snapshot("ref")
    for chunk in (1, 3, 8, 100):
        new_id = f"imp{chunk}"
        with pg_repo.import_file(path, id=new_id, chunk_entries=chunk):
            pass
        imported = pg_repo.snapshot(new_id)
        assert imported.entries == ref.entries and imported.registers == ref.registers
        assert index_rows(pg_dsn, schema, new_id) == reference, chunk


COMPACTION = {"summary": "s", "retainedTail": [], "tokensBefore": 1, "fromHook": False}


@pytest.mark.parametrize("use_async", [False, True])
async def test_a_divergence_after_a_tip_moved_in_the_same_chunk_equals_the_plan(
    pg_repo: PostgresSessionRepository,
    apg_repo: AsyncPostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
    use_async: bool,
) -> None:
    """Chunks of 2: [r, c], [p, x], [y, q], [z, w] (c a compaction; x and y
    children of p, q of y, z of x, w of p). Before the last chunk p has rows
    in segment r (tip x) and in segment y (tip q, the newest on the server);
    the last chunk moves r's tip to z, unsent, then w diverges off p, so the
    covering segment is read from the server and merged with that move. The
    index equals the plan's written in one transaction, w based at (r, c)."""
    entries = [("r", None, "message"), ("c", "r", "compaction"), ("p", "c", "message")]
    entries += [("x", "p", "message"), ("y", "p", "message"), ("q", "y", "message")]
    entries += [("z", "x", "message"), ("w", "p", "message")]
    with files.create("div") as session:
        session.commit(
            [
                AppendEntry(
                    kind, parent, COMPACTION if kind == "compaction" else {"message": msg(i)}, id=i
                )
                for i, parent, kind in entries
            ]
            + [SetRegister("lane.leaf", "main", "w")]
        )
    path = files.path_for("div")
    with pg_repo.create_from_plan(plan_fork(read_session_file(path), "div", "tree"), "ref"):
        pass
    if use_async:
        async with await apg_repo.import_file(path, id="imp", chunk_entries=2):
            pass
    else:
        with pg_repo.import_file(path, id="imp", chunk_entries=2):
            pass
    reference = index_rows(pg_dsn, schema, "ref")
    # seqs 1-2 are the lane registers: r is 3, c 4, w 10
    assert ("w", "w", 10, "r", 4) in reference["meta"]
    assert ("y", "p", 5, "message") in reference["entries"]  # p has a row in y too
    assert index_rows(pg_dsn, schema, "imp") == reference


async def test_async_chunked_import_of_a_random_tree_equals_the_sync_one(
    pg_repo: PostgresSessionRepository,
    apg_repo: AsyncPostgresSessionRepository,
    files: SessionRepository,
    pg_dsn: str,
    schema: str,
) -> None:
    path = random_tree(files, "tree", 7, 60)
    for chunk in (2, 9):
        with pg_repo.import_file(path, id=f"sync{chunk}", chunk_entries=chunk):
            pass
        async with await apg_repo.import_file(path, id=f"async{chunk}", chunk_entries=chunk):
            pass
        sync, other = pg_repo.snapshot(f"sync{chunk}"), pg_repo.snapshot(f"async{chunk}")
        assert other.entries == sync.entries and other.registers == sync.registers
        assert index_rows(pg_dsn, schema, f"async{chunk}") == index_rows(
            pg_dsn, schema, f"sync{chunk}"
        )


# --- the migration ------------------------------------------------------------------------------

_CATALOG = {
    "columns": (
        "SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,"
        " coalesce(co.collname, ''), pg_get_expr(d.adbin, d.adrelid),"
        " col_description(c.oid, a.attnum)"
        " FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 100"
        " LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
        " WHERE n.nspname = %s AND a.attnum > 0 AND NOT a.attisdropped AND c.relkind = 'r'"
        " ORDER BY 1, 2"
    ),
    "constraints": (
        "SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)"
        " FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace"
        " WHERE n.nspname = %s ORDER BY 1, 2"
    ),
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s ORDER BY 1",
    "functions": (
        "SELECT p.proname, pg_get_function_identity_arguments(p.oid), p.prosrc, p.prosecdef,"
        " p.proconfig, p.provolatile, p.proacl::text[] FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s ORDER BY 1, 2"
    ),
    "triggers": (
        "SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t"
        " JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND NOT t.tgisinternal ORDER BY 1"
    ),
}


def catalog(dsn: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """What a schema is made of, with its name taken out."""
    with psycopg.connect(dsn) as conn:
        return {
            kind: [
                tuple(str(v).replace(schema, "@schema@") if v is not None else None for v in row)
                for row in conn.execute(query, (schema,)).fetchall()
            ]
            for kind, query in _CATALOG.items()
        }


def test_a_schema_upgraded_to_0015_equals_a_fresh_one(pg_dsn: str, schema: str) -> None:
    """The schema as 0014 left it (migrations to 0014, the function set
    without the session functions), upgraded by this pglease, ends identical
    to a fresh install: tables, columns and their comments, constraints,
    indexes, function bodies, settings and grants."""
    fresh = f"{schema}_fresh"
    functions = load_functions()
    before = MigrationState(
        schema,
        False,
        [m for m in load_migrations() if m.version <= 14],
        FunctionSet(tuple(f for f in functions.files if f[0] != "40_sessions.sql")),
    )
    try:
        with psycopg.connect(pg_dsn) as conn, conn.transaction():
            for statement, args in _apply_statements(before):
                conn.execute(statement, args)
        with psycopg.connect(pg_dsn) as conn:
            [(count,)] = conn.execute(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = %s AND p.proname LIKE 'session_import%%'",
                (schema,),
            ).fetchall()
        assert count == 0  # really the old state
        with PostgresStore(pg_dsn, schema=schema, max_size=1) as upgraded:
            assert upgraded.migrate() == []
        with PostgresStore(pg_dsn, schema=fresh, max_size=1):
            pass
        old, new = catalog(pg_dsn, schema), catalog(pg_dsn, fresh)
        assert old == new
        assert any(r[0] == "session_import_chunk" and r[3] == "True" for r in old["functions"])
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{fresh}" CASCADE')
