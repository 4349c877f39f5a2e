"""README's SQLite fleet-runtime example runs as shown, in its own process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_sqlite_runtime_example_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n#### Fleet runtime on SQLite\n", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "one python block under 'Fleet runtime on SQLite'"
    done = subprocess.run(
        [sys.executable, "-c", blocks[0]],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "holding generation 1", done.stdout
    assert lines[1].startswith("then Claim(") and "generation=2" in lines[1], done.stdout
    assert lines[2].startswith("leader Leader(owner=Owner(type='host', id='h1')"), done.stdout
