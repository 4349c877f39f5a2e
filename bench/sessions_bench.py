"""Sessions on both backends: appending 10,000 entries and scanning a 10,000-entry branch.

For each backend (a session file in a temporary directory; PostgreSQL tables
through `PostgresSessionRepository`) and each commit size in ``--batches``:

- append: ``--entries`` message entries as one chain (each the child of the
  previous), entries 1000, 2000, ... (``--compaction-every``) compactions, in commits of
  ``batch`` entries; entries/s and commits/s (wall clock, one writer);
- scan (on the batch-100 session): the whole branch from the leaf to the root
  newest first, the same oldest first, the last 50 entries (``limit=50``), and
  the path back to the newest compaction (``stop_type="compaction"``); the
  median of ``--repeat`` runs, in ms;
- across stores (PostgreSQL only): a tree fork of the 10,000-entry session
  into a file and the import of that file back.

Run ``python bench/sessions_bench.py`` (a throwaway embedded server) or
``--dsn ...``; ``--markdown FILE`` also writes the tables to FILE.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from _server import machine_info, throwaway_server

from pglease import Owner, Permit, PostgresStore
from pglease.sessions import (
    AppendEntry,
    PostgresSessionRepository,
    SessionHandle,
    SessionRepository,
)

COMPACTION = {"summary": "summary", "retainedTail": [], "tokensBefore": 1000, "fromHook": False}


def message(i: int) -> dict[str, Any]:
    # a small but realistic message payload (~120 bytes)
    return {
        "message": {
            "role": "assistant" if i % 2 else "user",
            "content": [{"type": "text", "text": f"entry {i}: " + "lorem ipsum " * 6}],
        }
    }


def append_chain(session: SessionHandle, entries: int, batch: int, every: int) -> tuple[float, str]:
    """Append a chain of `entries`; return (seconds, leaf id)."""
    parent: str | None = None
    ids = [str(uuid.uuid4()) for _ in range(entries)]
    started = time.perf_counter()
    for start in range(0, entries, batch):
        writes = []
        for i in range(start, min(start + batch, entries)):
            if every and i % every == 0 and i > 0:
                writes.append(AppendEntry("compaction", parent, COMPACTION, id=ids[i]))
            else:
                writes.append(AppendEntry("message", parent, message(i), id=ids[i]))
            parent = ids[i]
        session.commit(writes)
    return time.perf_counter() - started, ids[-1]


def scanner(session: SessionHandle, leaf: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    return lambda: session.scan_branch(leaf, **kwargs)


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median milliseconds over `repeat` runs, and the last result."""
    times = []
    result = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


def interleaved(pg: PostgresSessionRepository, rounds: int, count: int) -> list[str]:
    store = pg.store
    rid = store.ensure_resource("bench", "bare-mutate")
    claim = store.claim(rid, Owner("bench", "bare"), 3600)
    assert claim is not None
    revision = claim.revision
    rows: list[str] = []
    ratios: list[float] = []
    with pg.create("interleaved") as session:
        parent: str | None = None
        for r in range(rounds):
            started = time.perf_counter()
            for i in range(count):
                payload = {"first_seq": i, "next_seq": i + 1, "entries": 1, "registers": 0}
                revision = store.mutate(
                    Permit(rid, revision, claim), "bench.bare", None, payload
                ).revision
            bare = count / (time.perf_counter() - started)
            started = time.perf_counter()
            for i in range(count):
                parent = session.append_entry("message", parent, message(i)).id
            fenced = count / (time.perf_counter() - started)
            ratios.append(fenced / bare)
            rows.append(f"| {r + 1} | {bare:,.0f} | {fenced:,.0f} | {fenced / bare:.2f} |")
            print(rows[-1], flush=True)
    rows.append(f"| median | | | {statistics.median(ratios):.2f} |")
    return rows


@contextmanager
def backends(dsn: str, schema: str, directory: Path) -> Iterator[dict[str, Any]]:
    # default leases: 30 s, renewed every 15 s in the background (runs outlast 30 s)
    files = SessionRepository(directory)
    with PostgresStore(dsn, schema=schema, max_size=4) as store:
        pg = PostgresSessionRepository(store)
        try:
            yield {"sqlite": files, "postgres": pg}
        finally:
            files.close()
            pg.close()


def run(args: argparse.Namespace, dsn: str) -> list[str]:
    schema = args.schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    lines: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="pglease-sessions-bench-") as tmp,
        backends(dsn, schema, Path(tmp)) as repos,
    ):
        append_rows: list[str] = []
        scan_rows: list[str] = []
        scan_leaf: dict[str, str] = {}
        for name, repo in repos.items():
            for batch in args.batches:
                with repo.create(f"{name}-{batch}") as session:
                    seconds, leaf = append_chain(
                        session, args.entries, batch, args.compaction_every
                    )
                    commits = -(-args.entries // batch)
                    append_rows.append(
                        f"| {name} | {args.entries:,} | {batch} | {commits:,} | {seconds:.2f} |"
                        f" {args.entries / seconds:,.0f} | {commits / seconds:,.0f} |"
                    )
                    print(append_rows[-1], flush=True)
                    if batch == max(args.batches):
                        scan_leaf[name] = leaf
                        figures = []
                        scans: list[tuple[str, dict[str, Any]]] = [
                            ("full, newest first", {}),
                            ("full, oldest first", {"newest_first": False}),
                            ("last 50 (limit=50)", {"limit": 50}),
                            ("to newest compaction", {"stop_type": "compaction"}),
                        ]
                        for label, kwargs in scans:
                            ms, got = timed(scanner(session, leaf, kwargs), args.repeat)
                            figures.append((label, ms, len(got)))
                        for label, ms, count in figures:
                            scan_rows.append(
                                f"| {name} | {label} | {count:,} | {ms:.1f} |"
                                f" {count / ms * 1000 if ms else 0:,.0f} |"
                            )
                            print(scan_rows[-1], flush=True)
        pg: PostgresSessionRepository = repos["postgres"]
        # The ceiling of a fenced commit: bare lease-store mutations (lease
        # check, revision bump, event, same-size payload) with no session rows,
        # in interleaved rounds with single-entry session commits so load on
        # the host hits both alike.
        ratio_rows = interleaved(pg, args.rounds, args.round_commits)
        source = f"postgres-{max(args.batches)}"
        started = time.perf_counter()
        path = pg.export_to_file(source, tmp, id="exported")
        export_s = time.perf_counter() - started
        started = time.perf_counter()
        pg.import_file(path, id="imported").close()
        import_s = time.perf_counter() - started
        cross = [
            f"| PostgreSQL -> file (export, tree fork) | {args.entries:,} | {export_s:.2f} |",
            f"| file -> PostgreSQL (import) | {args.entries:,} | {import_s:.2f} |",
        ]
        for row in cross:
            print(row, flush=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        server = conn.execute("SHOW server_version").fetchone()
    lines += [
        "### Append",
        "",
        "| backend | entries | entries/commit | commits | seconds | entries/s | commits/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *append_rows,
        "",
        f"### Branch scan ({args.entries:,}-entry chain, median of {args.repeat})",
        "",
        "| backend | scan | entries returned | ms | entries/s |",
        "|---|---|---:|---:|---:|",
        *scan_rows,
        "",
        f"### Single-entry commit vs the lease store's own mutation ({args.rounds} interleaved"
        f" rounds of {args.round_commits:,} each)",
        "",
        "| round | bare `mutate`/s | session commit/s | ratio |",
        "|---:|---:|---:|---:|",
        *ratio_rows,
        "",
        "### Across stores",
        "",
        "| operation | entries | seconds |",
        "|---|---:|---:|",
        *cross,
        "",
        f"PostgreSQL {server[0] if server else '?'}",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="an existing server (default: a throwaway embedded one)")
    parser.add_argument("--schema", default="pglease_sessions_bench")
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 100]
    )
    parser.add_argument("--compaction-every", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-commits", type=int, default=500)
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    args = parser.parse_args()
    info = machine_info()
    for key, value in info.items():
        print(f"{key}: {value}")
    server = nullcontext(args.dsn) if args.dsn else throwaway_server()
    with server as dsn:
        lines = run(args, dsn)
    print("\n".join(lines))
    if args.markdown:
        machine = ", ".join(f"{k} {v}" for k, v in info.items())
        args.markdown.write_text("\n".join([f"Machine: {machine}", "", *lines, ""]))


if __name__ == "__main__":
    main()
