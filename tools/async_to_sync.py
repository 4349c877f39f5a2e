"""Generate the blocking twin of each asyncio module: the async code is the source.

Each pair in `PAIRS` maps a hand-written asyncio module to the sync module
generated from it. The rewrite works on tokens, so comments, docstrings and
layout survive, then `ruff format` settles the layout:

- ``async def`` / ``async with`` / ``async for`` lose ``async``; ``await`` goes;
- names are renamed: `RENAMES` first, then ``AsyncName`` -> ``Name`` and
  ``name_async`` -> ``name`` (so ``AsyncConnection``, ``migrate_async`` and the
  compat module ``_compat_async`` map to their sync counterparts);
- ``Awaitable[X]`` becomes ``X`` (a callback's type: it returns the value);
- the brackets of ``(await a.b(c)).d`` go with the ``await``: ``a.b(c).d``;
- a line ending in ``# sync: CODE`` becomes ``CODE`` (same indentation), a
  line ending in ``# sync: -`` is dropped, and so is every line from one
  ``# async-only: begin`` to the next ``# async-only: end`` (both included):
  for the few places where the two flavours differ by more than names;
- imports the twin no longer uses (say ``asyncio`` or ``Awaitable``) go.

Strings are never touched. Run ``python tools/async_to_sync.py`` to write the
twins, ``--check`` to fail (exit 1) when a generated file is out of date.
"""

from __future__ import annotations

import argparse
import difflib
import io
import keyword
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (asyncio source, generated sync twin), relative to the repository root.
PAIRS: tuple[tuple[str, str], ...] = (
    ("pglease/_compat_async.py", "pglease/_compat.py"),
    ("pglease/_migrate_async.py", "pglease/_migrate.py"),
    ("pglease/sessions/pg_base_async.py", "pglease/sessions/pg_base.py"),
    ("pglease/sessions/pg_handle_async.py", "pglease/sessions/pg_handle.py"),
    ("pglease/sessions/pg_io_async.py", "pglease/sessions/pg_io.py"),
    ("pglease/sessions/pg_lease_async.py", "pglease/sessions/pg_lease.py"),
    ("pglease/sessions/pg_repository_async.py", "pglease/sessions/pg_repository.py"),
    ("pglease/sessions/pg_transfers_async.py", "pglease/sessions/pg_transfers.py"),
    ("pglease/sessions/session_async.py", "pglease/sessions/session.py"),
    ("pglease/sessions/_protocol_async.py", "pglease/sessions/_protocol.py"),
    ("pglease/sessions/_conveniences_async.py", "pglease/sessions/_conveniences.py"),
    ("pglease/sessions/_handle_async.py", "pglease/sessions/_handle.py"),
    ("pglease/sessions/_repo_async.py", "pglease/sessions/_repo.py"),
    ("pglease/sessions/_file_channel_async.py", "pglease/sessions/_file_channel.py"),
    ("pglease/postgres/_reuse_async.py", "pglease/postgres/_reuse.py"),
    ("pglease/postgres/_runtime_async.py", "pglease/postgres/_runtime.py"),
    ("pglease/postgres/_maintenance_async.py", "pglease/postgres/_maintenance.py"),
    ("pglease/driver/store_async.py", "pglease/driver/store.py"),
    ("pglease/store/_store_async.py", "pglease/store/_store.py"),
    ("pglease/postgres/_driver_async.py", "pglease/postgres/_driver.py"),
    ("pglease/postgres/async_store.py", "pglease/postgres/store.py"),
    ("pglease/sqlite/_driver_async.py", "pglease/sqlite/_driver.py"),
    ("pglease/sqlite/async_store.py", "pglease/sqlite/store.py"),
    ("pglease/watch/_watcher_async.py", "pglease/watch/_watcher.py"),
    ("pglease/runtime/_room_async.py", "pglease/runtime/_room.py"),
    ("pglease/runtime/_acquire_async.py", "pglease/runtime/_acquire.py"),
    ("pglease/runtime/_election_async.py", "pglease/runtime/_election.py"),
    ("pglease/sqlite/_watch_async.py", "pglease/sqlite/_watch.py"),
    ("pglease/driver/listen_async.py", "pglease/driver/listen.py"),
    ("pglease/postgres/_log_reader_async.py", "pglease/postgres/_log_reader.py"),
)

RENAMES = {
    "AbstractAsyncContextManager": "AbstractContextManager",
    "asynccontextmanager": "contextmanager",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "StopAsyncIteration": "StopIteration",
    "aclose": "close",
}
_ASYNC_PREFIX = re.compile(r"Async([A-Z]\w*)")
_SYNC_LINE = re.compile(r"#\s*sync:\s*(.*?)\s*$")
_BLOCK_BEGIN = re.compile(r"^\s*#\s*async-only:\s*begin\s*$")
_BLOCK_END = re.compile(r"^\s*#\s*async-only:\s*end\s*$")
KEYWORDS = ("def", "with", "for")
HEADER = "# Generated from {source} by tools/async_to_sync.py: do not edit.\n"


def rename(name: str) -> str:
    if name in RENAMES:
        return RENAMES[name]
    if match := _ASYNC_PREFIX.fullmatch(name):
        return match[1]
    if name.endswith("_async") and len(name) > len("_async"):
        return name[: -len("_async")]
    return name


def _apply_line_markers(text: str) -> str:
    out: list[str] = []
    in_block = 0  # line number of the open `# async-only: begin`, or 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if _BLOCK_BEGIN.match(line):
            if in_block:
                raise ValueError(f"line {number}: `# async-only: begin` inside another")
            in_block = number
            continue
        if _BLOCK_END.match(line):
            if not in_block:
                raise ValueError(f"line {number}: `# async-only: end` without a begin")
            in_block = 0
            continue
        if in_block:
            continue
        match = _SYNC_LINE.search(line)
        if match is None:
            out.append(line)
            continue
        replacement = match[1]
        if replacement == "-":
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(f"{indent}{replacement}\n")
    if in_block:
        raise ValueError(f"line {in_block}: `# async-only: begin` is never ended")
    return "".join(out)


def _closing_bracket(tokens: list[tokenize.TokenInfo], opening: int) -> int:
    """The index of the token closing the bracket at `opening`."""
    depth = 0
    for index in range(opening, len(tokens)):
        if tokens[index].type == tokenize.OP and tokens[index].string in "([{":
            depth += 1
        elif tokens[index].type == tokenize.OP and tokens[index].string in ")]}":
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"line {tokens[opening].start[0]}: unclosed bracket")


def _bare_await_group(tokens: list[tokenize.TokenInfo], opening: int) -> int | None:
    """The closing index when the bracket at `opening` holds only an awaited
    primary (``(await a.b(c)[0])``), not a call's arguments or a tuple: once
    ``await`` goes, those brackets are noise. None otherwise."""
    if tokens[opening].string != "(" or tokens[opening + 1].string != "await":
        return None
    before = tokens[opening - 1] if opening else None
    if before is not None and (
        (before.type == tokenize.NAME and not keyword.iskeyword(before.string))
        or before.string in (")", "]")
    ):
        return None  # a call: these are its argument brackets
    closing = _closing_bracket(tokens, opening)
    index = opening + 2
    while index < closing:
        tok = tokens[index]
        if tok.type == tokenize.OP and tok.string in "([{":
            index = _closing_bracket(tokens, index) + 1
        elif (tok.type == tokenize.NAME and not keyword.iskeyword(tok.string)) or (
            tok.type == tokenize.OP and tok.string == "."
        ):
            index += 1
        else:
            return None  # an operator, a comma, a keyword (`for`, `if`): keep them
    return closing


def convert(source: str) -> str:
    """The sync twin of asyncio module text `source` (before formatting)."""
    text = _apply_line_markers(source)
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def at(position: tuple[int, int]) -> int:
        return offsets[position[0] - 1] + position[1]

    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), in text order
    for index, tok in enumerate(tokens):
        if (closing_index := _bare_await_group(tokens, index)) is not None:
            closing = tokens[closing_index]
            edits.append((at(tok.start), at(tok.end), ""))
            edits.append((at(closing.start), at(closing.end), ""))
            continue
        if tok.type != tokenize.NAME:
            continue
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if tok.string == "Awaitable" and following is not None and following.string == "[":
            # `Awaitable[X]` -> `X`: drop the name with its bracket, and the closing one.
            closing = tokens[_closing_bracket(tokens, index + 1)]
            edits.append((at(tok.start), at(following.end), ""))
            edits.append((at(closing.start), at(closing.end), ""))
            continue
        # Only the keywords: `await` before an expression, `async` before def/with/for.
        if tok.string == "await" or (
            tok.string == "async" and following is not None and following.string in KEYWORDS
        ):
            end = at(following.start) if following is not None else at(tok.end)
            edits.append((at(tok.start), end, ""))
        elif (renamed := rename(tok.string)) != tok.string:
            edits.append((at(tok.start), at(tok.end), renamed))
    edits.sort()  # an Awaitable's closing bracket was queued before the names inside it
    for start, end, replacement in reversed(edits):
        text = text[:start] + replacement + text[end:]
    return text


def _ruff(args: list[str], text: str, target: Path) -> str:
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff) if ruff.exists() else "ruff", *args, "--stdin-filename", str(target), "-"]
    done = subprocess.run(
        command, input=text, capture_output=True, text=True, check=False, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(f"ruff {args[0]} failed on the twin of {target}:\n{done.stderr}")
    return done.stdout


def _format(text: str, target: Path) -> str:
    # Renames can unsort an import block, and a dropped line or `Awaitable` can
    # leave an import unused: sort and prune imports first, then format.
    fix = ["check", "--fix", "--select", "I,F401", "--quiet", "--exit-zero"]
    text = _ruff(fix, text, target)
    return _ruff(["format", "--quiet"], text, target)


def generate(source: Path, target: Path) -> str:
    try:
        body = convert(source.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise SystemExit(f"{source.relative_to(ROOT)}: {exc}") from exc
    return _format(HEADER.format(source=source.relative_to(ROOT)) + body, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a twin is out of date")
    args = parser.parse_args()
    stale = 0
    for source_name, target_name in PAIRS:
        source, target = ROOT / source_name, ROOT / target_name
        text = generate(source, target)
        current = target.read_text(encoding="utf-8") if target.exists() else ""
        if text == current:
            continue
        if args.check:
            stale += 1
            diff = difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                f"{target_name} (committed)", f"{target_name} (generated)",
            )  # fmt: skip
            sys.stdout.writelines(diff)
        else:
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target_name}")
    if stale:
        print(f"{stale} generated file(s) out of date: run python tools/async_to_sync.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
