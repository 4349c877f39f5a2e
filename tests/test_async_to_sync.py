"""The sync twins are generated from their asyncio sources, and are current."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

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


def test_awaitable_types_become_their_value_type() -> None:
    out = _tool().convert(
        "Read = Callable[[AsyncConnection[Any]], Awaitable[dict[str, list[int]]]]\n"
        "def f(fn: Callable[[], Awaitable[T]], x: Awaitable) -> Awaitable[None]: ...\n"
    )
    assert out == (
        "Read = Callable[[Connection[Any]], dict[str, list[int]]]\n"
        "def f(fn: Callable[[], T], x: Awaitable) -> None: ...\n"
    )


BLOCK = """class AsyncStore:
    # async-only: begin
    @classmethod
    async def open(cls) -> "AsyncStore":
        return cls()
    # async-only: end

    async def close(self) -> None:
        pass
"""


def test_async_only_blocks_are_left_out_of_the_twin() -> None:
    assert _tool().convert(BLOCK) == "class Store:\n\n    def close(self) -> None:\n        pass\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("# async-only: begin\nx = 1\n", "line 1: `# async-only: begin` is never ended"),
        ("x = 1\n# async-only: end\n", "line 2: `# async-only: end` without a begin"),
        (
            "# async-only: begin\n# async-only: begin\n# async-only: end\n",
            "line 2: `# async-only: begin` inside another",
        ),
    ],
)
def test_unbalanced_async_only_markers_are_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        _tool().convert(text)


def test_imports_the_twin_no_longer_uses_are_pruned() -> None:
    tool = _tool()
    source = (
        "import asyncio\nfrom collections.abc import AsyncIterator, Awaitable\n\n\n"
        "async def f(g: Callable[[], Awaitable[int]]) -> AsyncIterator[int]:\n"
        "    yield await asyncio.to_thread(g)  # sync: yield g()\n"
    )
    out = tool._format(tool.convert(source), ROOT / "pglease/_twin_example.py")
    assert "asyncio" not in out and "Awaitable" not in out
    assert "from collections.abc import Iterator\n" in out
    assert "def f(g: Callable[[], int]) -> Iterator[int]:\n    yield g()\n" in out


def test_brackets_around_an_awaited_primary_go_with_the_await() -> None:
    out = _tool().convert(
        "row = await (await conn.execute(q, (a, b))).fetchone()\n"
        "n = (await self.get(rid)).lease[0]\n"
        "args = f(await g(), (await h()) + 1, (await a, b), -(await x))\n"
        "also = [(await a)(b)]\n"
        "gen = (await x for x in y), (await a if b else c)\n"
    )
    assert out == (
        "row = conn.execute(q, (a, b)).fetchone()\n"
        "n = self.get(rid).lease[0]\n"
        "args = f(g(), h() + 1, (a, b), -x)\n"
        "also = [a(b)]\n"
        "gen = (x for x in y), (a if b else c)\n"
    )
