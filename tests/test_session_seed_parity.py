"""Where pglease's sessions and store meet the seeds (pi-workflows 0.13's state
store, the pi harness's SqliteSessionRepo): each deviation found is either
matched or kept on purpose, and pinned here. See pglease/sessions/README.md."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pglease import InvalidOwnerError, InvalidPayloadError, Owner, Permit, PostgresStore
from pglease.json_text import dumps, js_number
from pglease.payloads import canonical_json, canonical_payload
from pglease.sessions import (
    AppendEntry,
    InvalidSessionIdError,
    InvalidSessionWriteError,
    PostgresSessionRepository,
    SessionError,
    SessionFileError,
    SessionNotFoundError,
    SessionRepository,
    SessionTempFileError,
    SetRegister,
    plan_fork,
    read_session_file,
)
from pglease.sessions.fork import ForkScope
from pglease.sessions.model import dump_json
from pglease.sessions.repository import MAX_SESSION_ID_BYTES, STALE_TEMP_MS, temp_name

from .backends import Backend
from .test_input_payloads import inject
from .test_session_cli import run, run_json

T0 = datetime(2030, 1, 1, tzinfo=UTC)
NOW_MS = 1_900_000_000_000


class Clock:
    def __init__(self, now: int = NOW_MS) -> None:
        self.now = now

    def __call__(self) -> int:
        self.now += 1
        return self.now


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[SessionRepository]:
    with SessionRepository(tmp_path / "s", renew_interval=None, now_ms=Clock()) as repository:
        yield repository


@pytest.fixture
def pg_repo(pg_store: PostgresStore) -> Iterator[PostgresSessionRepository]:
    with PostgresSessionRepository(pg_store, renew_interval=None) as repository:
        yield repository


# --- numbers as JavaScript writes them ----------------------------------------------------


def reference_js_number(x: float) -> str:
    """ECMAScript Number::toString, step by step from the specification (6.1.6.1.20),
    written independently of pglease.json_text in exact decimal arithmetic: the
    fewest digits k such that some k-digit s * 10**(n-k) reads back as x (the
    closest such s, the even one on a tie), then laid out by n."""
    if x == 0:
        return "0"
    if x < 0:
        return "-" + reference_js_number(-x)
    exact = Decimal(x)
    with localcontext() as ctx:
        ctx.prec = 1200
        top = exact.adjusted()
        for k in range(1, 18):
            quantum = Decimal(1).scaleb(top - k + 1)
            candidates = {exact.quantize(quantum, rounding=r) for r in (ROUND_FLOOR, ROUND_CEILING)}
            good = [c for c in candidates if float(c) == x]
            if good:
                break
        best = min(good, key=lambda c: (abs(c - exact), int(c.scaleb(k - 1 - top)) % 2))
        _sign, digit_tuple, exponent = best.normalize().as_tuple()
    s = "".join(map(str, digit_tuple))
    assert isinstance(exponent, int)
    k = len(s)
    n = k + exponent  # x = s * 10**(n - k)
    if k <= n <= 21:
        return s + "0" * (n - k)
    if 0 < n <= 21:
        return s[:n] + "." + s[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + s
    sign = "+" if n - 1 >= 0 else "-"
    if k == 1:
        return f"{s}e{sign}{abs(n - 1)}"
    return f"{s[0]}.{s[1:]}e{sign}{abs(n - 1)}"


#: What `String(x)` / `JSON.stringify(x)` print in every JavaScript engine.
KNOWN = [
    (1.0, "1"),
    (-0.0, "0"),
    (0.0, "0"),
    (1e-7, "1e-7"),
    (1.5e-7, "1.5e-7"),
    (1e-6, "0.000001"),
    (0.000123, "0.000123"),
    (0.1, "0.1"),
    (0.1 + 0.2, "0.30000000000000004"),
    (-2.5, "-2.5"),
    (100.0, "100"),
    (123.456, "123.456"),
    (1e20, "100000000000000000000"),
    (1.2345678901234568e20, "123456789012345680000"),
    (1e21, "1e+21"),
    (1.5e21, "1.5e+21"),
    (2.0**53, "9007199254740992"),
    (5e-324, "5e-324"),
    (1.7976931348623157e308, "1.7976931348623157e+308"),
    (-1e-7, "-1e-7"),
    (123e-20, "1.23e-18"),
    (2.0**-24, "5.960464477539063e-8"),  # 16 digits round back, though not the nearest 16
]


@pytest.mark.parametrize(("value", "text"), KNOWN)
def test_known_number_texts(value: float, text: str) -> None:
    assert js_number(value) == text
    assert reference_js_number(value) == text


JS_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?(e[+-][1-9][0-9]*)?")


@settings(max_examples=3000, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
@example(1e21)
@example(999999999999999900000.0)
@example(1e-6)
@example(9.999999999999999e-7)
@example(2.0**-24)
def test_float_text_follows_ecmascript(x: float) -> None:
    text = js_number(x)
    assert text == reference_js_number(x)
    assert JS_NUMBER.fullmatch(text), text
    assert float(text) == x  # round trip
    if x.is_integer() and abs(x) <= 2**53:
        assert text == str(int(x))  # integral floats print as integers, -0 as 0
    elif x.is_integer() and abs(x) < 1e21:
        assert "." not in text and "e" not in text  # shortest digits, padded with zeros


@given(st.integers(min_value=-(2**53), max_value=2**53))
def test_safe_integers_print_as_their_float(n: int) -> None:
    assert js_number(n) == str(n) == js_number(float(n))


def test_integers_beyond_2_53_are_written_exactly() -> None:
    # JavaScript cannot hold them (it would print 1152921504606847000); we keep
    # the caller's exact value rather than rounding it. Documented.
    assert js_number(2**60) == "1152921504606846976"
    assert js_number(float(2**60)) == "1152921504606847000"


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=30,
)


def _as_js(value: Any) -> Any:
    """What JSON.parse(JSON.stringify(value)) holds, in Python terms."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) <= 2**53 else value
    if isinstance(value, list | tuple):
        return [_as_js(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_js(v) for k, v in value.items()}
    return value


def _floats_to_ints(value: Any) -> Any:
    if isinstance(value, float):
        return int(value)
    if isinstance(value, list):
        return [_floats_to_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _floats_to_ints(v) for k, v in value.items()}
    return value


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_dumps_is_json_with_js_numbers(value: Any) -> None:
    for sort_keys in (False, True):
        text = dumps(value, sort_keys=sort_keys)
        # As JSON.parse reads it: integer text beyond 2**53 only comes from floats.
        parsed = json.loads(text, parse_int=lambda t: int(t) if abs(int(t)) <= 2**53 else float(t))
        assert _as_js(parsed) == _as_js(value)
        # Only the number text differs from json.dumps: same keys, order, strings.
        plain = json.dumps(
            value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
        if "." not in plain and "e" not in plain.lower():
            assert text == plain


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_integral_floats_hash_like_ints(value: Any) -> None:
    integral = _floats_to_ints(value)

    def floatify(v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**53:
            return float(v)
        if isinstance(v, list):
            return [floatify(x) for x in v]
        if isinstance(v, dict):
            return {k: floatify(x) for k, x in v.items()}
        return v

    assert canonical_payload(integral).sha256 == canonical_payload(floatify(integral)).sha256


def test_canonical_payload_vectors() -> None:
    assert canonical_json({"n": 1.0}) == canonical_json({"n": 1}) == '{"n":1}'
    assert canonical_payload({"n": 1.0}).sha256 == hashlib.sha256(b'{"n":1}').digest()
    assert (
        canonical_json({"c": 1e21, "b": 1e-7, "a": -0.0, "d": [0.5, 2.0, "é"]})
        == '{"a":0,"b":1e-7,"c":1e+21,"d":[0.5,2,"é"]}'
    )
    assert canonical_json({2.0: "x", 1: "y"}) == '{"1":"y","2":"x"}'  # keys as json.dumps, JS text


@pytest.mark.parametrize("bad", [math.nan, [math.inf], {"x": object()}, {"k": {1.5j}}, [-math.inf]])
def test_unencodable_payloads_are_refused(bad: Any) -> None:
    with pytest.raises(InvalidPayloadError):
        canonical_payload(bad)
    with pytest.raises(InvalidSessionWriteError):
        dump_json(bad)


def test_mixed_key_types_cannot_be_sorted() -> None:
    with pytest.raises(InvalidPayloadError, match="not JSON-serialisable"):
        canonical_payload({1: "a", "b": 2.5})
    assert dump_json({1: "a", "b": 2.5}) == '{"1":"a","b":2.5}'  # unsorted: as json.dumps


def test_strings_are_escaped_as_json_stringify_does() -> None:
    text = '\x00\x1f\b\t\n\f\r"\\/\u2028\x7fé🙂'
    expected = '"\\u0000\\u001f\\b\\t\\n\\f\\r\\"\\\\/\u2028\x7fé🙂"'
    assert dumps(text) == dumps([text, 1.5])[1:-5] == expected


def test_too_deep_session_json_is_a_typed_refusal() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidSessionWriteError, match="deep"):
        dump_json(deep)  # used to escape as a raw RecursionError
    with pytest.raises(InvalidSessionWriteError, match="deep"):
        dump_json([deep, 1.5])


def test_cycles_with_floats_are_refused() -> None:
    loop: list[Any] = [1.5]
    loop.append(loop)
    with pytest.raises(InvalidPayloadError):
        canonical_payload(loop)
    with pytest.raises(ValueError, match="Circular"):
        dumps(loop)


def test_old_payload_rows_still_read_and_new_ones_hash_the_js_way(backend: Backend) -> None:
    """Payloads are stored by the sha256 of their text. A row written before
    this change keeps its text (`1.0`) and its hash; it still reads back. The
    same value written now is stored once more, as `1`, under the new hash:
    nothing is rewritten and no hash ever names two texts."""
    s = backend.store
    rid = s.ensure_resource("run", "old-hash")
    old_text = '{"n":1.0,"t":1e-07}'
    revision = inject(backend, rid, old_text)
    s.mutate(Permit(rid, revision), "run.new", payload={"n": 1.0, "t": 1e-7})
    old, new = s.events(rid)
    assert old.payload == {"n": 1.0, "t": 1e-7}
    assert old.payload_sha256 == hashlib.sha256(old_text.encode()).digest()
    assert new.payload == {"n": 1, "t": 1e-7}
    assert new.payload_sha256 == hashlib.sha256(b'{"n":1,"t":1e-7}').digest()
    assert backend.payload_count() == 2  # type: ignore[attr-defined]
    assert [e.type for e in s.events_after()] == ["run.poison", "run.new"]


def test_session_json_uses_js_numbers_and_old_files_keep_their_bytes(
    repo: SessionRepository,
) -> None:
    with repo.create("nums") as s:
        entry = s.append_entry("custom", None, {"data": {"a": 1.0, "b": 1e-7}}, custom_type="x")
        s.commit([SetRegister("fact.custom", "k", [2.0, -0.0, 1e21])])
        assert entry.payload_json == '{"data":{"a":1,"b":1e-7}}'
        reg = s.get_register("fact.custom", "k")
        assert reg is not None and reg.value_json == "[2,0,1e+21]"
        row = s.add_usage({"input": 1.0, "output": 2, "totalTokens": 3.0, "cost": {"total": 0.5}})
        assert row.usage_json == '{"input":1,"output":2,"totalTokens":3,"cost":{"total":0.5}}'
    conn = sqlite3.connect(repo.path_for("nums"), isolation_level=None)
    (usage,) = conn.execute("SELECT usage_payload FROM session").fetchone()
    # A file written before the change (Python number text) still opens and forks,
    # its payload bytes copied unchanged.
    conn.execute(
        "INSERT INTO entries VALUES ('old', NULL, 90, 'custom', 'x', 1, '{\"data\":{\"a\":1.0}}')"
    )
    conn.close()
    assert '"input":1,' in usage and '"total":0.5' in usage
    with repo.fork("nums", scope="tree", id="nums-copy") as fork:
        old = fork.get_entry("old")
        assert old is not None and old.payload_json == '{"data":{"a":1.0}}'
        assert old.payload == {"data": {"a": 1.0}}


# --- forks -------------------------------------------------------------------------------


def _tree_source(repo: SessionRepository) -> None:
    """Side lane written before main moves; facts written out of key order."""
    with repo.create("src") as s:
        s.append_message(None, msg("r"), id="r")
        s.append_message("r", msg("a"), id="a")
        s.commit(
            [
                SetRegister("lane.config", "side", {"model": {"provider": "p", "modelId": "s"}}),
                SetRegister("lane.leaf", "side", "a"),
                SetRegister(
                    "lane.state", "side", {"currentOperationId": None, "pendingNextRun": []}
                ),
                SetRegister("fact.custom", "zeta", 1),
                SetRegister("fact.custom", "alpha", 2),
                SetRegister("fact.label", "r", "root"),
                SetRegister("fact.label", "a", "a"),
            ]
        )
        s.commit([SetRegister("lane.leaf", "main", "a"), SetRegister("fact.name", "", "N")])


def _register_order(path: Path) -> list[tuple[str, str, int]]:
    conn = sqlite3.connect(path, isolation_level=None)
    rows = conn.execute("SELECT namespace, key, seq FROM registers ORDER BY seq").fetchall()
    conn.close()
    return rows


def test_tree_fork_numbers_registers_in_source_seq_order(repo: SessionRepository) -> None:
    _tree_source(repo)
    with repo.fork("src", scope="tree", id="t") as fork:
        path = fork.path
    # entries r(3), a(4); then lanes by when their leaf was last written (side
    # before main), then the facts in one pass in the source's seq order (the
    # name was set last).
    assert _register_order(path) == [
        ("lane.config", "side", 5),
        ("lane.leaf", "side", 6),
        ("lane.state", "side", 7),
        ("lane.leaf", "main", 8),
        ("lane.state", "main", 9),
        ("fact.custom", "zeta", 10),
        ("fact.custom", "alpha", 11),
        ("fact.label", "r", 12),
        ("fact.label", "a", 13),
        ("fact.name", "", 14),
    ]
    # A branch fork numbers its facts in the source's seq order too.
    with repo.fork("src", id="b") as fork:
        path = fork.path
    assert [r[:2] for r in _register_order(path) if r[0].startswith("fact.")] == [
        ("fact.custom", "zeta"),
        ("fact.custom", "alpha"),
        ("fact.label", "r"),
        ("fact.label", "a"),
        ("fact.name", ""),
    ]


def _facts_source(session: Any) -> None:
    """Entry r (seq 3) with the main leaf on it (4), then, one commit each,
    `fact.label r` (5), `fact.custom k` (6), `fact.name` (7)."""
    session.commit(
        [
            AppendEntry("message", None, {"message": msg("r")}, id="r"),
            SetRegister("lane.leaf", "main", "r"),
        ]
    )
    session.commit([SetRegister("fact.label", "r", "root")])
    session.commit([SetRegister("fact.custom", "k", 1)])
    session.commit([SetRegister("fact.name", "", "N")])


#: The fork of `_facts_source` (either scope): r (3), main's leaf (4) and
#: state (5), then the facts in one pass in source order, as the harness copies them.
FACTS_FORK = [
    ("lane.leaf", "main", 4),
    ("lane.state", "main", 5),
    ("fact.label", "r", 6),
    ("fact.custom", "k", 7),
    ("fact.name", "", 8),
]


def _handle_registers(handle: Any) -> list[tuple[str, str, int]]:
    regs = handle.snapshot().registers
    return sorted(((r.namespace, r.key, r.seq) for r in regs), key=lambda r: r[2])


@pytest.mark.parametrize("scope", ["branch", "tree"])
def test_fork_numbers_facts_in_one_pass_in_source_order(
    repo: SessionRepository, pg_repo: PostgresSessionRepository, scope: ForkScope, tmp_path: Path
) -> None:
    with repo.create("fsrc") as s:
        _facts_source(s)
    with pg_repo.create("pg-fsrc") as s:
        _facts_source(s)
    # file -> file
    with repo.fork("fsrc", scope=scope, id=f"f-{scope}") as fork:
        assert _handle_registers(fork) == FACTS_FORK
    # a plan from a snapshot (what a one-connection PostgreSQL pool forks by)
    plan = plan_fork(repo.snapshot("fsrc"), "fsrc", scope)
    assert [(r.namespace, r.key, r.seq) for r in plan.registers] == FACTS_FORK
    with repo.create_from_plan(plan, id=f"p-{scope}") as fork:
        assert _handle_registers(fork) == FACTS_FORK
    # PostgreSQL -> PostgreSQL (streamed)
    with pg_repo.fork("pg-fsrc", scope=scope, id=f"pg-f-{scope}") as fork:
        assert _handle_registers(fork) == FACTS_FORK
    # PostgreSQL -> file
    path = pg_repo.fork_to_file("pg-fsrc", tmp_path / "out", scope, id=f"out-{scope}")
    assert _register_order(path) == FACTS_FORK
    # file -> PostgreSQL (an import is a tree fork)
    with pg_repo.import_file(repo.path_for("fsrc"), id=f"pg-imp-{scope}") as fork:
        assert _handle_registers(fork) == FACTS_FORK


def test_the_same_plan_for_every_backend(repo: SessionRepository) -> None:
    _tree_source(repo)
    snapshot = repo.snapshot("src")
    plan = plan_fork(snapshot, "src", "tree")
    reordered = type(snapshot)(
        tuple(reversed(snapshot.entries)), tuple(reversed(snapshot.registers))
    )
    # The order rows come back in does not matter, only their seqs.
    assert plan_fork(reordered, "src", "tree").registers == plan.registers


def test_fork_before_on_an_empty_lane_is_an_empty_session(
    repo: SessionRepository, pg_repo: PostgresSessionRepository
) -> None:
    with repo.create("empty"):
        pass
    with repo.fork("empty", position="before", id="e2") as fork:
        assert fork.scan_entries() == []
        leaf = fork.get_register("lane.leaf", "main")
        assert leaf is not None and leaf.value is None
        assert fork.stats().next_seq == 3 and fork.stats().parent_session_id == "empty"
    with pg_repo.create("pg-empty"):
        pass
    with pg_repo.fork("pg-empty", position="before", id="pg-e2") as fork:
        assert fork.scan_entries() == [] and fork.stats().next_seq == 3
    # With an entry given, 'before' the root is empty too; an unknown one is refused.
    with pytest.raises(SessionError, match="does not exist"):
        repo.fork("empty", entry_id="nope", position="before", id="e3")
    assert not repo.exists("e3")


# --- directories on demand ------------------------------------------------------------------


def test_repository_creates_its_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    with SessionRepository(target, renew_interval=None) as files, files.create("x"):
        pass
    assert (target / "x.sqlite").is_file()
    with pytest.raises(SessionNotFoundError, match="does not exist"):
        SessionRepository(tmp_path / "absent", create=False)
    assert not (tmp_path / "absent").exists()
    (tmp_path / "plain").write_text("a file, not a directory")
    with pytest.raises(SessionFileError, match="cannot create session directory"):
        SessionRepository(tmp_path / "plain" / "sub")


def test_fork_to_file_and_cli_create_the_directory(
    pg_repo: PostgresSessionRepository, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    with pg_repo.create("src") as s:
        s.append_message(None, msg("hi"), id="m")
    path = pg_repo.fork_to_file("src", tmp_path / "new" / "dir", "tree", id="f")
    assert path == tmp_path / "new" / "dir" / "f.sqlite"
    assert [e.id for e in read_session_file(path).entries] == ["m"]
    made = tmp_path / "cli" / "made"
    out = run_json(pg_dsn, schema, "fork", "src", "--scope", "tree", "--to", str(made))
    assert Path(out["path"]).parent == made and out["entries"] == 1


# --- session ids are file names --------------------------------------------------------------

GOOD_IDS = [
    "notes 2026@host",
    ".hidden",
    "-dash",
    "a\\b",
    "per%cent?q#frag",
    "é漢字🙂",
    "x'); DROP TABLE sessions; --",
    "tab\tnew\nline",
    "y" * MAX_SESSION_ID_BYTES,
]


@pytest.mark.parametrize("session_id", GOOD_IDS)
def test_any_file_name_is_a_session_id(repo: SessionRepository, session_id: str) -> None:
    with repo.create(session_id) as s:
        s.append_message(None, msg("hi"), id="m")
    assert repo.path_for(session_id).name == session_id + ".sqlite"
    assert repo.list().ids() == [session_id] and repo.list().problems == []
    with repo.open(session_id) as s:
        assert s.get_entry("m") is not None
    with repo.fork(session_id, id=session_id + "!" if len(session_id) < 200 else None) as f:
        assert f.stats().parent_session_id == session_id
    assert not [p for p in repo.directory.iterdir() if p.name.endswith(".tmp")]


def test_id_limits(repo: SessionRepository) -> None:
    repo.create("z" * MAX_SESSION_ID_BYTES).close()
    with pytest.raises(InvalidSessionIdError, match="244"):
        repo.create("z" * (MAX_SESSION_ID_BYTES + 1))
    # temp names fit NAME_MAX even for the longest id (the id is cut, not the hex)
    name = temp_name("é" * 122)
    assert len((name + "-journal").encode()) <= 255 and name.endswith(".tmp")


def test_undecodable_file_names_are_problems_not_failures(repo: SessionRepository) -> None:
    repo.create("fine").close()
    with open(os.path.join(os.fsencode(repo.directory), b"\xff\xfe.sqlite"), "wb") as f:
        f.write(b"")
    listing = repo.list()
    assert listing.ids() == ["fine"]
    assert [type(p.error) for p in listing.problems] == [InvalidSessionIdError]


@pytest.mark.parametrize("session_id", ["notes 2026@host", "x'); DROP TABLE sessions; --", "é🙂"])
def test_postgres_ids_are_the_same_names(
    pg_repo: PostgresSessionRepository, tmp_path: Path, session_id: str
) -> None:
    with pg_repo.create(session_id) as s:
        s.append_message(None, msg("hi"), id="m")
    assert pg_repo.list().ids() == [session_id]
    with pg_repo.open(session_id) as s:
        assert s.get_entry("m") is not None
    path = pg_repo.fork_to_file(session_id, tmp_path, id=session_id)
    assert path.name == session_id + ".sqlite"
    with pg_repo.import_file(path, id=session_id + " back") as back:
        assert back.stats().parent_session_id == session_id
    with pytest.raises(InvalidSessionIdError):
        pg_repo.open("a/b")


def test_cli_shows_and_lists_such_ids(
    pg_repo: PostgresSessionRepository, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    with pg_repo.create("notes 2026@host") as s:
        s.append_message(None, msg("hi"))
    assert run_json(pg_dsn, schema, "show", "notes 2026@host")["id"] == "notes 2026@host"
    pg_repo.create("-dash").close()
    done = run(pg_dsn, schema, "show", "--json", "--", "-dash")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["id"] == "-dash"
    files = SessionRepository(tmp_path, renew_interval=None)
    files.create("local notes@host").close()
    listing = run_json(pg_dsn, schema, "ls", "--dir", str(tmp_path))
    assert [r["id"] for r in listing["sessions"]] == ["local notes@host"]
    done = run(pg_dsn, schema, "show", "a/b")
    assert done.returncode == 2 and "session id" in done.stderr


# --- crash leftovers --------------------------------------------------------------------------


def _leftover(directory: Path, session_id: str, age_ms: int, sides: tuple[str, ...] = ()) -> Path:
    path = directory / f".{session_id}.0123456789abcdef.tmp"
    seconds = (NOW_MS - age_ms) / 1000
    for p in (path, *(Path(str(path) + side) for side in sides)):
        p.write_bytes(b"partial")
        os.utime(p, (seconds, seconds))
    return path


def test_opening_removes_stale_temp_files_and_keeps_fresh_ones(tmp_path: Path) -> None:
    stale = _leftover(tmp_path, "crashed", STALE_TEMP_MS + 1000, ("-wal", "-shm", "-journal"))
    fresh = _leftover(tmp_path, "running", STALE_TEMP_MS - 1000)
    # a fork in progress writes its -wal, not the main file: the newest one counts
    busy = _leftover(tmp_path, "busy", STALE_TEMP_MS * 5)
    Path(str(busy) + "-wal").write_bytes(b"recent")
    os.utime(Path(str(busy) + "-wal"), (NOW_MS / 1000, NOW_MS / 1000))
    files = SessionRepository(tmp_path, renew_interval=None, now_ms=lambda: NOW_MS)
    assert sorted(p.name for p in files.removed_temp_files) == sorted(
        [stale.name, stale.name + "-wal", stale.name + "-shm", stale.name + "-journal"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [fresh.name, busy.name, busy.name + "-wal"]
    )
    assert files.list().problems == []


def test_listing_reports_leftovers_without_removing_them(
    tmp_path: Path, pg_dsn: str, schema: str
) -> None:
    stale = _leftover(tmp_path, "crashed", STALE_TEMP_MS * 2)
    files = SessionRepository(
        tmp_path, renew_interval=None, now_ms=lambda: NOW_MS, clean_temp=False
    )
    files.create("ok").close()
    listing = files.list()
    assert listing.ids() == ["ok"]
    (problem,) = listing.problems
    assert problem.id == "crashed" and problem.path == str(stale)
    assert isinstance(problem.error, SessionTempFileError)
    assert "did not finish" in str(problem.error)
    assert stale.exists()
    # The CLI only reads: it reports the leftover (its clock is the wall clock,
    # long past NOW_MS - 2 min) and leaves it.
    os.utime(stale, (1_000_000, 1_000_000))
    out = run_json(pg_dsn, schema, "ls", "--dir", str(tmp_path))
    assert [p["id"] for p in out["problems"]] == ["crashed"] and stale.exists()
    done = run(pg_dsn, schema, "ls", "--dir", str(tmp_path / "missing"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert not (tmp_path / "missing").exists()


# --- scans, store release and the actor of a leased write ---------------------------------------


def test_oldest_first_stop_is_counted_from_the_leaf(
    repo: SessionRepository, pg_repo: PostgresSessionRepository
) -> None:
    """Decision (kept, documented): a stop ends the path at the first match
    counted from the leaf in both directions; oldest first is the same entries
    reversed. (The harness's oldest-first scan stops at the oldest match.)"""
    compaction = {"summary": "s", "retainedTail": [], "tokensBefore": 1, "fromHook": False}
    for handle in (repo.create("scan"), pg_repo.create("scan")):
        with handle as s:
            s.append_message(None, msg("r"), id="r")
            s.append_entry("compaction", "r", compaction, id="k1")
            s.append_message("k1", msg("m"), id="m")
            s.append_entry("compaction", "m", compaction, id="k2")
            s.append_message("k2", msg("leaf"), id="leaf")
            newest = [e.id for e in s.scan_branch("leaf", stop_type="compaction")]
            oldest = [
                e.id for e in s.scan_branch("leaf", newest_first=False, stop_type="compaction")
            ]
            assert newest == ["leaf", "k2"] and oldest == ["k2", "leaf"]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_release_keeps_acquired_at_and_stamps_heartbeat_at(backend: Backend) -> None:
    """Decision (kept, documented): a release clears owner, token and expiry and
    keeps the generation; `acquired_at` stays (when the last holder got it) and
    `heartbeat_at` becomes the release time (its last act)."""
    s = backend.store
    rid = s.ensure_resource("run", "release")
    claim = s.claim(rid, Owner("host", "a"), 30, now=at(0))
    assert claim is not None
    s.renew(claim, 30, now=at(5))
    s.release(claim, now=at(7))
    lease = s.get(rid, now=at(8)).lease
    assert lease.owner is None and lease.expires_at is None and not lease.held
    assert lease.generation == 1
    assert lease.acquired_at == at(0) and lease.heartbeat_at == at(7)


def test_a_leased_write_records_its_owner_and_refuses_another_actor(backend: Backend) -> None:
    """Decision (kept, documented): the actor of a fenced write is the lease
    owner the token proves; a different `actor=` is refused (it used to be
    ignored silently), the generation is recorded in its own field."""
    s = backend.store
    rid = s.ensure_resource("run", "actor")
    owner = Owner("host", "a")
    claim = s.claim(rid, owner, 30)
    assert claim is not None
    with pytest.raises(InvalidOwnerError, match="differs from the lease owner"):
        s.mutate(Permit(rid, claim.revision, claim), "run.x", actor=Owner("system", "b"))
    assert s.get(rid).revision == claim.revision and len(s.events(rid)) == 1
    s.mutate(Permit(rid, claim.revision, claim), "run.x", actor=owner)
    s.mutate(Permit(rid, claim.revision + 1, claim), "run.y")
    for event in s.events(rid)[1:]:
        assert event.actor == owner and event.lease_generation == claim.generation
    s.release(claim)
    s.mutate(Permit(rid, s.get(rid).revision), "run.z", actor=Owner("system", "b"))
    last = s.events(rid)[-1]
    assert last.actor == Owner("system", "b") and last.lease_generation is None


# --- the format document ships with the package ----------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_session_docs_link_inside_the_repository() -> None:
    import importlib.resources

    shipped = importlib.resources.files("pglease.sessions") / "FORMAT.md"
    assert shipped.is_file() and "## Schema" in shipped.read_text(encoding="utf-8")
    for readme in (ROOT / "README.md", ROOT / "pglease" / "sessions" / "README.md"):
        text = readme.read_text(encoding="utf-8")
        assert "/work/" not in text
        links = re.findall(r"\]\(([^)#:]+)\)", text)
        assert links, readme
        for link in links:
            target = (readme.parent / link).resolve()
            assert target.is_file() and ROOT in target.parents, (readme, link)
