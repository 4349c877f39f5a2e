"""The README's code is the code in examples/, and every example runs.

Each ```python block of README.md and pglease/sessions/README.md follows an
`<!-- example: examples/NAME.py ... -->` line and is that file, byte for byte;
each file in examples/ runs as a script against a database of its own on the
test server and prints what it says it does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
READMES = (ROOT / "README.md", ROOT / "pglease" / "sessions" / "README.md")
BLOCK = re.compile(r"(?:<!-- example: (\S+)[^\n]*-->\n)?```python\n(.*?)```\n", re.S)

#: What each example prints when it did what it says (a regular expression).
EXPECTED = {
    "async_store.py": r"claimed generation \d+",
    "batches.py": r"claimed 10 released 10",
    "fleet.py": r"elected\nleader was h1",
    "metrics.py": r"http://127\.0\.0\.1:\d+/metrics",
    "pg_session_import.py": r"^\[\]$",
    "session_lanes.py": r"forked \S+ 2 entries",
    "session_layer.py": r"forked True",
    "sqlite_fleet.py": (
        r"^holding generation 1\nthen Claim\(.*generation=2.*\n"
        r"leader Leader\(owner=Owner\(type='host', id='h1'\)"
    ),
    "sqlite_store.py": r"held by h1, refused to h2, released",
    "sqlite_watch.py": r"watched run\.started",
    "store_basics.py": r"generation \d+ revision \d+",
    "watch.py": r"seen lease\.claimed\nresumed with lease\.released",
}


def readme_blocks() -> list[tuple[Path, str | None, str]]:
    return [
        (readme, match.group(1), match.group(2))
        for readme in READMES
        for match in BLOCK.finditer(readme.read_text(encoding="utf-8"))
    ]


def test_every_readme_block_is_an_example_file() -> None:
    blocks = readme_blocks()
    assert blocks, "no python blocks found: the pattern is broken"
    for readme, name, code in blocks:
        assert name is not None, f"{readme.name}: a python block without an example line:\n{code}"
        path = ROOT / name
        assert path.is_file(), f"{readme.name} names {name}, which does not exist"
        differs = f"{readme.name}: the block of {name} differs from the file (copy it in)"
        assert code == path.read_text(encoding="utf-8"), differs


def test_every_example_is_shown_and_checked() -> None:
    shown = {Path(name).name for _, name, _ in readme_blocks() if name is not None}
    files = {path.name for path in EXAMPLES.glob("*.py")}
    assert files == shown, f"examples not in a README: {files - shown}; missing: {shown - files}"
    assert files == set(EXPECTED), f"EXPECTED is out of step: {files ^ set(EXPECTED)}"


@pytest.fixture(scope="module")
def examples_dsn(pg_dsn: str) -> Iterator[str]:
    """A database of its own, so the examples' default schema touches no test's."""
    name = f"pglease_examples_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_conninfo(pg_dsn, dbname=name)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str, examples_dsn: str, tmp_path: Path) -> None:
    env = {**os.environ, "PGLEASE_DSN": examples_dsn, "PYTHONPATH": str(ROOT)}
    env.pop("PGLEASE_POOLER", None)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stderr}"
    assert re.search(EXPECTED[name], done.stdout, re.M), f"{name} printed:\n{done.stdout}"
