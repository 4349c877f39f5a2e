"""The sync twins are generated from their asyncio sources, and are current."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("async_to_sync", ROOT / "tools/async_to_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_to_sync"] = module
    spec.loader.exec_module(module)
    return module


SOURCE = '''"""Docs mention asyncio and await, untouched."""
import asyncio
from contextlib import asynccontextmanager

from ._compat_async import sleep


class AsyncThing:
    async def __aenter__(self) -> "AsyncThing":
        await sleep(0)  # a comment stays
        return self

    async def run_async(self, conn: AsyncConnection) -> None:
        async with conn.transaction():
            async for row in await conn.stream("SELECT 1"):
                print(row, "await")
        await asyncio.to_thread(print, 1)  # sync: print(1)
        await self._only_async()  # sync: -
'''


def test_convert_rewrites_keywords_and_names_but_not_strings_or_comments() -> None:
    out = _tool().convert(SOURCE)
    assert '"""Docs mention asyncio and await, untouched."""' in out
    assert "from contextlib import contextmanager" in out
    assert "from ._compat import sleep" in out
    assert "class Thing:" in out
    assert 'def __enter__(self) -> "AsyncThing":' in out  # strings are never touched
    assert "        sleep(0)  # a comment stays" in out
    assert "def run(self, conn: Connection) -> None:" in out
    assert "        with conn.transaction():" in out
    assert '            for row in conn.stream("SELECT 1"):' in out
    assert 'print(row, "await")' in out
    assert "        print(1)\n" in out
    assert "_only_async" not in out and "await " not in out.replace('"await"', "")


def test_every_generated_twin_is_current() -> None:
    tool = _tool()
    for source, target in tool.PAIRS:
        expected = tool.generate(ROOT / source, ROOT / target)
        assert (ROOT / target).read_text(encoding="utf-8") == expected, (
            f"{target} is out of date: run python tools/async_to_sync.py"
        )
