"""`ls` paging: time to the first row, total time and peak Python memory, keyset
pages (`pglease.listing.iter_resources`) against one `list_resources` query.

    .venv/bin/python bench/ls_paging.py [--sizes 1000 100000] [--page-size 1000] [--dsn DSN]

Without --dsn it starts a throwaway embedded PostgreSQL. Beside the two walks
in this process it runs the real CLI (`pglease ls` and `pglease ls --json`) as
a child process reading its stdout: time to the first line, to the last, and
the child's peak resident memory (ru_maxrss, the whole interpreter included).
It prints figures; `RESULTS-ls.md` records runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import machine_info, throwaway_server

from pglease import PostgresStore
from pglease.listing import iter_resources


def _measure(walk: Callable[[], Any]) -> tuple[float, float, float]:
    """(seconds to the first row, seconds in all, peak traced MiB) of one walk;
    the times include tracemalloc's own overhead, the same for both walks."""
    tracemalloc.start()
    start = time.perf_counter()
    first = None
    for _ in walk():
        if first is None:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return first or total, total, peak


#: The child reports its own peak RSS (VmHWM): the peak of wait4's rusage would
#: include this process's memory at fork time, as Linux carries it across exec.
_CHILD = """
import atexit, sys
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("peak_kib " + line.split()[1] + "\\n")
atexit.register(peak)
from pglease.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(dsn: str, schema: str, extra: list[str]) -> tuple[float, float, int, float]:
    """(seconds to the first line, seconds in all, lines, peak RSS MiB) of the
    real `pglease ls` in a child process."""
    argv = [sys.executable, "-c", _CHILD, "--dsn", dsn, "--schema", schema, *extra, "ls"]
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stderr is not None
    first = None
    lines = 0
    for _ in child.stdout:
        if first is None:
            first = time.perf_counter() - start
        lines += 1
    errors = child.stderr.read()
    total = time.perf_counter() - start
    if child.wait() != 0:
        raise SystemExit(f"pglease ls exited {child.returncode}: {errors}")
    peak = [int(line.split()[1]) for line in errors.splitlines() if line.startswith("peak_kib")]
    return first or total, total, lines, peak[-1] / 1024


def bench(dsn: str, size: int, page_size: int) -> None:
    schema = f"bench_ls_{uuid.uuid4().hex[:8]}"
    try:
        with PostgresStore(dsn, schema=schema, max_size=2) as store:
            with store.connection() as conn:
                conn.execute("SET statement_timeout = 0")  # 1M rows outlast the default
                # Through the SQL entry point, as hosts create them (ids checked).
                conn.execute(
                    f"SELECT \"{schema}\".ensure_resource('bench', 'k' || g)"
                    " FROM generate_series(1, %s) g",
                    [size],
                )
            paged = _measure(lambda: iter_resources(store, schema, page_size=page_size))
            whole = _measure(lambda: store.list_resources())
            cli = [_cli(dsn, schema, fmt) for fmt in ([], ["--json"])]
        print(
            f"{size:>8} resources  keyset pages of {page_size}:"
            f" first row {paged[0] * 1000:7.1f} ms,"
            f" all {paged[1]:6.2f} s, peak {paged[2]:7.1f} MiB | one query: first row"
            f" {whole[0] * 1000:7.1f} ms, all {whole[1]:6.2f} s, peak {whole[2]:7.1f} MiB",
            flush=True,
        )
        for label, (first, total, lines, rss) in zip(("ls", "ls --json"), cli, strict=True):
            print(
                f"{size:>8} resources  CLI `pglease {label}`: first line {first * 1000:7.1f} ms,"
                f" all {total:6.2f} s, {lines} lines, peak RSS {rss:7.1f} MiB",
                flush=True,
            )
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100000])
    parser.add_argument("--page-size", type=int, default=1000)
    parser.add_argument("--dsn")
    args = parser.parse_args()
    print(machine_info())
    if args.dsn:
        for size in args.sizes:
            bench(args.dsn, size, args.page_size)
        return
    with throwaway_server() as dsn:
        for size in args.sizes:
            bench(dsn, size, args.page_size)


if __name__ == "__main__":
    main()
