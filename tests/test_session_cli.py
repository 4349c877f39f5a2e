"""`pglease session ...` as a real subprocess against real PostgreSQL and real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pglease import PostgresStore
from pglease.sessions import (
    PostgresSessionRepository,
    SessionRepository,
    SetRegister,
    read_session_file,
)

from .test_session_cross import check_file_format, populate

ROOT = Path(__file__).resolve().parent.parent


def run(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pglease", "--dsn", dsn, "--schema", schema, "session", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def run_json(dsn: str, schema: str, *args: str) -> Any:
    done = run(dsn, schema, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def repo(pg_store: PostgresStore) -> PostgresSessionRepository:
    repo = PostgresSessionRepository(pg_store, renew_interval=None)
    with repo.create("src") as session:
        populate(session)
    return repo


def test_ls_and_show(repo: PostgresSessionRepository, pg_dsn: str, schema: str) -> None:
    held = repo.create("other", parent_session_id="src")
    listing = run_json(pg_dsn, schema, "ls")
    assert [s["id"] for s in listing["sessions"]] == ["other", "src"]
    assert listing["problems"] == []
    other, src = listing["sessions"]
    assert other["holder"] == held.owner_id and other["generation"] == 1
    assert other["parent_session_id"] == "src"
    assert src["holder"] is None and src["message_count"] == 9
    text = run(pg_dsn, schema, "ls")
    assert text.returncode == 0 and "other" in text.stdout and held.owner_id in text.stdout
    held.close()

    shown = run_json(pg_dsn, schema, "show", "src")
    assert shown["entry_count"] == 13 and shown["next_seq"] == 30
    assert shown["entry_types"] == {
        "message": 9,
        "compaction": 2,
        "branch_summary": 1,
        "custom": 1,
    }
    assert shown["lanes"]["main"]["leaf"] == "u1"
    assert shown["lanes"]["side"]["leaf"] == "f"
    assert shown["facts"] == {
        "name": "The session",
        "custom": {"color": {"v": "blue"}},
        "labels": {"b": "on b", "f": "on f"},
    }
    assert shown["usage"]["input"] == 10
    # --json before the subcommand works too
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pglease", "--dsn", pg_dsn, "--schema", schema]
    done = subprocess.run(
        [*argv, "--json", "session", "show", "src"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert json.loads(done.stdout)["id"] == "src"
    text = run(pg_dsn, schema, "show", "src")
    assert text.returncode == 0 and "lane side" in text.stdout and "writer: -" in text.stdout


def test_human_output_has_no_python_reprs_and_zoned_times(
    repo: PostgresSessionRepository, pg_dsn: str, schema: str
) -> None:
    shown = run_json(pg_dsn, schema, "show", "src")
    text = run(pg_dsn, schema, "show", "src")
    assert text.returncode == 0, text.stderr
    lines = dict(line.split(": ", 1) for line in text.stdout.splitlines())
    # Structures print as JSON (what --json prints), none as "-": never {'k': v} or None.
    assert json.loads(lines["usage"]) == shown["usage"]
    assert json.loads(lines["facts"]) == shown["facts"]
    assert json.loads(lines["entry_types"]) == shown["entry_types"]
    assert json.loads(lines["lane side"]) == shown["lanes"]["side"]
    assert lines["parent_session_id"] == "-"
    assert "None" not in text.stdout and "'" not in text.stdout
    assert lines["created"] == shown["created"] and shown["created"].endswith("+00:00")
    listed = run(pg_dsn, schema, "ls").stdout.splitlines()
    [row] = [line for line in listed if line.startswith("src ")]
    assert shown["created"] in row.split()  # with its zone, not cut at 26 characters


def test_fork_export_import_round_trip(
    repo: PostgresSessionRepository, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    out = run_json(
        pg_dsn,
        schema,
        "fork",
        "src",
        "--to",
        str(tmp_path),
        "--entry",
        "i",
        "--position",
        "before",
        "--id",
        "before-i",
    )
    assert out["id"] == "before-i" and out["parent_session_id"] == "src"
    assert out["entries"] == 6 and out["scope"] == "branch"
    path = Path(out["path"])
    assert path == tmp_path / "before-i.sqlite"
    check_file_format(path)
    assert [e.id for e in read_session_file(path).entries] == ["a", "b", "c", "d", "g", "h"]

    out = run_json(pg_dsn, schema, "fork", "src", "--scope", "tree", "--to", str(tmp_path))
    assert out["entries"] == 13
    check_file_format(Path(out["path"]))

    exported = run_json(pg_dsn, schema, "export", "src", "--to", str(tmp_path), "--id", "copy")
    assert exported["entries"] == 13 and exported["path"] == str(tmp_path / "copy.sqlite")
    # work on the file locally, then bring it back
    files = SessionRepository(tmp_path, renew_interval=None)
    with files.open("copy") as local:
        leaf = local.get_register("lane.leaf", "main")
        assert leaf is not None
        entry = local.append_message(leaf.value, {"role": "user", "content": "offline"})
        local.commit([SetRegister("lane.leaf", "main", entry.id)])
    imported = run_json(pg_dsn, schema, "import", exported["path"], "--id", "back")
    # 10 registers (2 lanes x config/leaf/state, name, custom, 2 labels) after the last entry
    assert imported == {
        "id": "back",
        "parent_session_id": "copy",
        "entries": 14,
        "next_seq": entry.seq + 11,
    }
    with repo.open("back") as back:
        leaf = back.get_register("lane.leaf", "main")
        assert leaf is not None and leaf.value == entry.id
        assert [e.id for e in back.scan_branch(entry.id, limit=3)] == [entry.id, "u1", "k"]
        assert back.get_entry(entry.id) == files.snapshot("copy").entry_map()[entry.id]
    text = run(pg_dsn, schema, "import", exported["path"])
    assert text.returncode == 0 and "parent copy" in text.stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["show", "missing"], 2, "does not exist"),
        (["show", "../bad"], 2, "session id"),
        (["fork", "src", "--to", "{tmp}", "--entry", "nope"], 2, "does not exist"),
        # a refused fork creates no directory (a good one creates it on demand)
        (["fork", "missing", "--to", "{tmp}/absent"], 2, "does not exist"),
        (["fork", "src", "--to", "{tmp}", "--scope", "tree", "--entry", "a"], 2, "branch scope"),
        (["fork", "src", "--to", "{tmp}", "--scope", "leaf"], 2, "invalid choice"),
        (["export", "missing", "--to", "{tmp}"], 2, "does not exist"),
        (["import", "{tmp}/none.sqlite"], 2, "does not exist"),
        (["import", "{tmp}/garbage.sqlite"], 1, "not a usable database"),
        (["import", "{tmp}/notes.txt"], 2, ".sqlite"),
        (["fork"], 2, "required"),
    ],
)
def test_errors_and_exit_codes(
    repo: PostgresSessionRepository,
    pg_dsn: str,
    schema: str,
    tmp_path: Path,
    args: list[str],
    code: int,
    message: str,
) -> None:
    (tmp_path / "garbage.sqlite").write_bytes(b"garbage" * 500)
    (tmp_path / "notes.txt").write_text("hi")
    before = sorted(p.name for p in tmp_path.iterdir())
    done = run(pg_dsn, schema, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert done.returncode == code, (done.stdout, done.stderr)
    assert message in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert repo.list().ids() == ["src"]
