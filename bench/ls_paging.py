"""`ls` paging: time to the first row, total time and peak Python memory, keyset
pages (`pglease.listing.iter_resources`) against one `list_resources` query.

    .venv/bin/python bench/ls_paging.py [--sizes 1000 100000] [--page-size 1000] [--dsn DSN]

Without --dsn it starts a throwaway embedded PostgreSQL. It prints figures
only; nothing is written to RESULTS files.
"""

from __future__ import annotations

import argparse
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


def bench(dsn: str, size: int, page_size: int) -> None:
    schema = f"bench_ls_{uuid.uuid4().hex[:8]}"
    try:
        with PostgresStore(dsn, schema=schema, max_size=2) as store:
            with store.connection() as conn:
                # Through the SQL entry point, as hosts create them (ids checked).
                conn.execute(
                    f"SELECT \"{schema}\".ensure_resource('bench', 'k' || g)"
                    " FROM generate_series(1, %s) g",
                    [size],
                )
            paged = _measure(lambda: iter_resources(store, schema, page_size=page_size))
            whole = _measure(lambda: store.list_resources())
        print(
            f"{size:>8} resources  keyset pages of {page_size}:"
            f" first row {paged[0] * 1000:7.1f} ms,"
            f" all {paged[1]:6.2f} s, peak {paged[2]:7.1f} MiB | one query: first row"
            f" {whole[0] * 1000:7.1f} ms, all {whole[1]:6.2f} s, peak {whole[2]:7.1f} MiB",
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
