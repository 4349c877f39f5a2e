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
  into a file and the import of that file back;
- big sessions (``--big 1000,100000,...``; ``--big-only`` skips the rest):
  for each size, a session file of that many entries (a chain with a
  compaction every 1,000 entries, each followed by a one-entry side
  branch), imported into PostgreSQL in chunks, then forked back into files (tree export, branch fork
  at the middle entry). Each operation runs in its own process: wall time,
  its peak RSS (``VmHWM``) and its RSS before the operation (``VmRSS``); while
  it runs, this process samples ``pg_stat_activity`` every 2 ms for the
  oldest open client transaction that holds an xid (what holds back every
  watcher's snapshot xmin; autovacuum's are not counted). The gap between
  two import chunks is the time of one chunk: reading it from the file and
  its transaction. ``--big-before`` also runs the one-snapshot, one-transaction
  path (``plan_fork`` over a full snapshot) for comparison; ``--big-pg-fork``
  adds a tree fork inside PostgreSQL, ``--big-fail`` an import that fails
  after its last chunk (and purges what it wrote).

Run ``python bench/sessions_bench.py`` (a throwaway embedded server) or
``--dsn ...``; ``--markdown FILE`` also writes the tables to FILE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
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


# --- big sessions: streamed forks and chunked imports in their own processes ---------------

#: Runs one operation in a fresh interpreter; prints one JSON line.
CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from pglease import PostgresStore
from pglease.sessions import PostgresSessionRepository, SessionRepository, plan_fork
from pglease.sessions import read_session_file

op, dsn, schema, arg, new_id, chunk = sys.argv[2:8]
def rss(field="VmHWM"):
    # /proc, not ru_maxrss: Linux carries ru_maxrss over from the forking
    # parent, while VmHWM (peak) and VmRSS (now) belong to this image only.
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    return -1
with PostgresStore(dsn, schema=schema, max_size=2) as store:
    repo = PostgresSessionRepository(store, renew_interval=None, import_chunk_entries=int(chunk))
    gaps = []
    last = [time.perf_counter()]
    def progress(_n):
        now = time.perf_counter()
        gaps.append(now - last[0])
        last[0] = now
    before = rss("VmRSS")
    purge = None
    started = time.perf_counter()
    if op == "import":
        repo.import_file(arg, id=new_id, on_progress=progress).close()
    elif op == "import-fail":
        # fails after its last chunk: the time is the import plus its purge
        path, total = arg.split("|")
        def fail(n):
            progress(n)
            if n >= int(total):
                global failed_at
                failed_at = time.perf_counter()
                raise RuntimeError("stop")
        try:
            repo.import_file(path, id=new_id, on_progress=fail)
        except RuntimeError:
            pass
        purge = time.perf_counter() - failed_at
    elif op == "import-before":
        plan = plan_fork(read_session_file(arg), Path(arg).stem, "tree")
        repo.create_from_plan(plan, new_id).close()
    elif op == "fork-pg":
        repo.fork(arg, "tree", id=new_id).close()
    elif op == "fork-pg-before":
        plan = plan_fork(repo.snapshot(arg), arg, "tree")
        repo.create_from_plan(plan, new_id).close()
    elif op in ("export", "fork-branch"):
        source, directory, entry = arg.split("|")
        scope = "tree" if op == "export" else "branch"
        repo.fork_to_file(source, directory, scope, entry or None, id=new_id)
    elif op in ("export-before", "fork-branch-before"):
        source, directory, entry = arg.split("|")
        scope = "tree" if op == "export-before" else "branch"
        plan = plan_fork(repo.snapshot(source), source, scope, entry or None)
        SessionRepository(directory, renew_interval=None).write_plan(plan, new_id)
    elif op == "delete":
        repo.delete(arg, on_progress=progress)
    elif op == "delete-before":
        # the old path: one DELETE, the rows going by ON DELETE CASCADE
        with store.connection() as conn, conn.transaction():
            conn.execute(f'DELETE FROM "{schema}".sessions WHERE id = %s', (arg,))
    elif op in ("file-fork", "file-fork-branch"):
        directory, source, entry = arg.split("|")
        scope = "tree" if op == "file-fork" else "branch"
        files = SessionRepository(directory, renew_interval=None)
        files.fork(source, scope, entry or None, id=new_id).close()
    elif op in ("file-fork-before", "file-fork-branch-before"):
        directory, source, entry = arg.split("|")
        scope = "tree" if op == "file-fork-before" else "branch"
        files = SessionRepository(directory, renew_interval=None)
        plan = plan_fork(files.snapshot(source), source, scope, entry or None)
        files.create_from_plan(plan, new_id).close()
    seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "rss_before_mb": before, "rss_peak_mb": rss(),
                  "chunks": len(gaps), "longest_chunk_ms": max(gaps, default=0) * 1000,
                  "median_chunk_ms": statistics.median(gaps) * 1000 if gaps else 0,
                  "purge_s": purge}))
"""


class XactSampler:
    """The oldest open transaction with an xid, sampled from pg_stat_activity."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.wait(0.002):
                row = conn.execute(
                    "SELECT extract(epoch FROM max(clock_timestamp() - xact_start))"
                    " FROM pg_stat_activity"
                    " WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()"
                    " AND backend_type = 'client backend'"
                ).fetchone()
                if row and row[0] is not None:
                    self.longest = max(self.longest, float(row[0]))

    def __enter__(self) -> XactSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class StallSampler(XactSampler):
    """`XactSampler` that also keeps, every 2 ms, what each client transaction
    with an xid waits on and what the checkpointer and autovacuum do: enough
    to tell a slow chunk's own work from a stall of the server."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.samples: list[tuple[Any, ...]] = []
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    @staticmethod
    def counters(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for view in ("pg_stat_checkpointer", "pg_stat_wal"):
            cur = conn.execute(f"SELECT * FROM {view}")
            row = cur.fetchone()
            names = [d.name for d in cur.description or ()]
            out.update({f"{view}.{n}": v for n, v in zip(names, row or (), strict=False)})
        return out

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self.before = self.counters(conn)
            while not self._stop.wait(0.002):
                rows = conn.execute(
                    "SELECT extract(epoch FROM clock_timestamp())::float8, backend_type,"
                    " pid, extract(epoch FROM xact_start)::float8, wait_event_type, wait_event,"
                    " backend_xid IS NOT NULL FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                    " AND ((backend_type = 'client backend' AND xact_start IS NOT NULL)"
                    " OR backend_type IN ('checkpointer', 'autovacuum worker', 'walwriter'))"
                ).fetchall()
                for row in rows:
                    self.samples.append(row)
                    if row[1] == "client backend" and row[6]:
                        self.longest = max(self.longest, row[0] - row[3])
            self.after = self.counters(conn)

    def report(self, slow_ms: float = 100.0) -> list[str]:
        """Transactions longer than `slow_ms`, with the waits seen in them."""
        from collections import Counter

        xacts: dict[tuple[Any, Any], list[Any]] = {}
        for row in self.samples:
            if row[1] == "client backend" and row[3] is not None:
                xacts.setdefault((row[2], row[3]), []).append(row)
        whole = sorted((rows[-1][0] - start) * 1000 for (_p, start), rows in xacts.items())
        # from here on: the part of each transaction that holds an xid
        xacts = {k: [r for r in rows if r[6]] for k, rows in xacts.items()}
        xacts = {k: rows for k, rows in xacts.items() if rows}
        durations = sorted(
            ((rows[-1][0] - rows[0][0]) * 1000, start, rows)
            for (_pid, start), rows in xacts.items()
        )
        lines = [f"transactions seen: {len(whole)}, {len(durations)} with an xid"]
        if whole:
            lines.append(
                f"whole transaction ms: median {statistics.median(whole):.0f},"
                f" p99 {whole[int(len(whole) * 0.99)]:.0f}, max {whole[-1]:.0f}"
            )
        if durations:
            ms = [d for d, _s, _r in durations]
            lines.append(
                f"with the xid, ms: median {statistics.median(ms):.0f}, p99"
                f" {ms[int(len(ms) * 0.99)]:.0f}, max {ms[-1]:.0f}"
            )
        by_start = sorted(durations, key=lambda d: d[1])
        if len(by_start) >= 8:
            q = len(by_start) // 4
            parts = [by_start[i * q : (i + 1) * q] for i in range(4)]
            lines.append(
                "median duration by quarter of the run (ms): "
                + ", ".join(f"{statistics.median(d for d, _s, _r in p):.0f}" for p in parts)
            )
        for duration, start, rows in durations:
            if duration < slow_ms:
                continue
            end = rows[-1][0]
            waits = Counter(f"{r[4]}:{r[5]}" for r in rows)
            others = Counter(
                f"{r[1]} {r[4]}:{r[5]}"
                for r in self.samples
                if r[1] != "client backend" and start <= r[0] <= end and r[4] is not None
            )
            lines.append(
                f"- {duration:.0f} ms: own waits {dict(waits.most_common(4))};"
                f" beside it {dict(others.most_common(4))}"
            )
        keys = [k for k in self.after if isinstance(self.after[k], int | float)]
        delta = {
            k.split(".", 1)[1]: self.after[k] - self.before.get(k, 0)
            for k in keys
            if self.after[k] != self.before.get(k)
        }
        lines.append(f"counter deltas: {delta}")
        return lines


def run_child(
    op: str,
    dsn: str,
    schema: str,
    arg: str,
    new_id: str,
    chunk: int,
    diagnose: bool = False,
    code: Path | None = None,
) -> dict[str, Any]:
    root = str(code or Path(__file__).resolve().parent.parent)
    with StallSampler(dsn) if diagnose else XactSampler(dsn) as sampler:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, root, op, dsn, schema, arg, new_id, str(chunk)],
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"{op} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["longest_xact_ms"] = sampler.longest * 1000
    if isinstance(sampler, StallSampler):
        result["diagnosis"] = sampler.report()
        print(f"{op}:", *sampler.report(), sep="\n  ", flush=True)
    return result


def synthetic_file(directory: Path, name: str, entries: int) -> tuple[Path, str]:
    """A session file of `entries` entries, written by the streamed writer:
    a chain (a compaction every 1,000), each compaction with a one-entry side branch.
    Returns the path and the id of the chain's middle entry."""
    from pglease.sessions.fork import ForkStream
    from pglease.sessions.model import Entry, dump_json

    def generate() -> Iterator[Entry]:
        parent: str | None = None
        seq = 0
        for i in range(entries):
            seq += 1
            if i % 1000 == 0 and parent is not None:
                # a side branch off the chain's previous entry
                payload = dump_json(message(i))
                yield Entry(f"s{i}", parent, seq, "message", None, 1_700_000_000_000, payload)
                continue
            kind = "compaction" if i % 1000 == 999 else "message"
            payload = dump_json(COMPACTION if kind == "compaction" else message(i))
            entry = Entry(f"e{i}", parent, seq, kind, None, 1_700_000_000_000, payload)
            parent = entry.id
            yield entry

    from pglease.sessions.model import Register

    last = entries - 1
    leaf_id = f"e{last - 1 if last and last % 1000 == 0 else last}"
    registers = (
        Register("lane.leaf", "main", 1, dump_json(leaf_id)),
        Register("lane.state", "main", 2, '{"currentOperationId":null,"pendingNextRun":[]}'),
        Register("fact.name", "", 3, '"big"'),
    )
    stream = ForkStream(generate(), (("main", leaf_id),), registers, None)
    path = SessionRepository(directory, renew_interval=None).write_stream(stream, name)
    middle = entries // 2 + (1 if entries // 2 % 1000 == 0 else 0)
    return path, f"e{middle}"


def big_sessions(args: argparse.Namespace, dsn: str) -> list[str]:
    schema = args.schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    with PostgresStore(dsn, schema=schema, max_size=2):
        pass  # migrations
    rows: list[str] = []
    modes = ["", "-before"] if args.big_before else [""]
    with tempfile.TemporaryDirectory(prefix="pglease-big-sessions-") as tmp:
        for size in args.big:
            src_dir = Path(tmp) / f"src-{size}"
            src_dir.mkdir()
            path, middle = synthetic_file(src_dir, f"big-{size}", size)
            for mode in modes:
                if mode and size > args.big_before:
                    continue
                out_dir = Path(tmp) / f"out-{size}{mode}"
                out_dir.mkdir()
                pg_id = f"pg-{size}{mode}"
                steps = []
                if not args.big_no_pg:
                    steps += [
                        (f"import{mode}", str(path), pg_id, size),
                        (f"export{mode}", f"{pg_id}|{out_dir}|", "exported", size),
                        (f"fork-branch{mode}", f"{pg_id}|{out_dir}|{middle}", "branch", 0),
                    ]
                if args.big_files:
                    # file -> file in the source's directory (SessionRepository.fork)
                    steps += [
                        (f"file-fork{mode}", f"{src_dir}|{path.stem}|", f"ff{mode}", 0),
                        (
                            f"file-fork-branch{mode}",
                            f"{src_dir}|{path.stem}|{middle}",
                            f"ffb{mode}",
                            0,
                        ),
                    ]
                if args.big_pg_fork:
                    steps.append((f"fork-pg{mode}", pg_id, f"copy-{size}{mode}", size))
                if args.big_delete and not args.big_no_pg:
                    steps.append((f"delete{mode}", pg_id, pg_id, 0))
                if not mode and args.big_fail:
                    steps.append(("import-fail", f"{path}|{size}", f"failed-{size}", 0))
                if args.big_ops:
                    steps = [s for s in steps if s[0].startswith(tuple(args.big_ops))]
                for op, arg, new_id, copied in steps:
                    r = run_child(
                        op,
                        dsn,
                        schema,
                        arg,
                        new_id,
                        args.import_chunk,
                        args.big_diagnose and op.startswith(("import", "delete")),
                        args.big_code,
                    )
                    if op.startswith(("import", "fork-pg", "delete")):
                        with psycopg.connect(dsn) as conn:
                            count = conn.execute(
                                f'SELECT count(*) FROM "{schema}".session_entries'
                                " WHERE session_id = %s",
                                (new_id,),
                            ).fetchone()
                        copied = int(count[0]) if count else -1
                    else:
                        out = src_dir if op.startswith("file-") else out_dir
                        copied = len(read_session_file_entries(out / f"{new_id}.sqlite"))
                    if r["purge_s"] is not None:
                        op = f"{op} (then its purge: {r['purge_s']:.2f} s)"
                    rows.append(
                        f"| {op} | {size:,} | {copied:,} | {r['seconds']:.2f} |"
                        f" {r['rss_before_mb']} | {r['rss_peak_mb']} |"
                        f" {r['rss_peak_mb'] - r['rss_before_mb']} |"
                        f" {r['longest_xact_ms']:,.0f} |"
                        + (
                            f" {r['chunks']:,} / {r['median_chunk_ms']:.0f}"
                            f" / {r['longest_chunk_ms']:.0f} |"
                            if r["chunks"]
                            else " - |"
                        )
                    )
                    print(rows[-1], flush=True)
                    if args.big_explain and op == "import":
                        print(*explain_chunk(dsn, schema, new_id), sep="\n", flush=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return [
        f"### Big sessions (imports in chunks of {args.import_chunk:,} entries)",
        "",
        "| operation | source entries | entries written | seconds | RSS before, MB |"
        " peak RSS, MB | growth, MB | longest xid transaction, ms |"
        " chunks / median / longest gap, ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def explain_chunk(dsn: str, schema: str, session_id: str, n: int = 500) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of one import chunk's statements against an
    imported session (`n` new entries after its last seq, one branch), in a
    transaction that is rolled back: what a late chunk costs once the tables
    hold the session's rows."""
    from pglease.sessions.pg_core import Sql

    q = Sql(schema)
    out: list[str] = []
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f'SELECT max(seq) FROM "{schema}".session_entries WHERE session_id = %s',
            (session_id,),
        ).fetchone()
        top = int(row[0]) if row and row[0] is not None else 0
        tip = conn.execute(
            f'SELECT id FROM "{schema}".session_entries WHERE session_id = %s AND seq = %s',
            (session_id, top),
        ).fetchone()
        parent = tip[0] if tip else None

        def explain(label: str, query: bytes, params: tuple[Any, ...]) -> None:
            plan = conn.execute(b"EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) " + query, params)
            text = [r[0] for r in plan.fetchall()]
            total = next((t for t in text if t.startswith("Execution Time")), "?")
            buffers = next((t.strip() for t in text if "Buffers:" in t), "")
            out.append(f"- {label}: {total}; {buffers}; {text[0].strip()}")

        explain("known_entries (1 parent)", q.known_entries, (session_id, [parent]))
        explain("segments_by_tips (1 tip)", q.segments_by_tips, (session_id, [parent]))
        started = time.perf_counter()
        for i in range(n):
            new_id = f"x{i}"
            params = (session_id, new_id, parent, top + 1 + i, "message", None, 1, '{"m":1}')
            if i in (0, n - 1):
                explain(f"insert_entry #{i + 1}", q.insert_entry, params)
                explain(
                    f"insert_branch_row #{i + 1}",
                    q.insert_branch_row,
                    (session_id, "b", new_id, top + 1 + i, "message"),
                )
            else:
                conn.execute(q.insert_entry, params)
                conn.execute(q.insert_branch_row, (session_id, "b", new_id, top + 1 + i, "message"))
            parent = new_id
        out.append(
            f"- {n} entries + branch rows, one statement each: "
            f"{(time.perf_counter() - started) * 1000:.0f} ms (rolled back)"
        )
        conn.rollback()
    return out


def read_session_file_entries(path: Path) -> list[Any]:
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT id FROM entries").fetchall()
    finally:
        conn.close()


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
    parser.add_argument(
        "--big", type=lambda s: [int(x) for x in s.split(",")], default=[], help="sizes"
    )
    parser.add_argument("--big-only", action="store_true")
    parser.add_argument("--big-fail", action="store_true", help="also an import that fails")
    parser.add_argument("--big-pg-fork", action="store_true", help="also a tree fork in PostgreSQL")
    parser.add_argument(
        "--big-files", action="store_true", help="also file-to-file forks (tree and branch)"
    )
    parser.add_argument(
        "--big-ops",
        type=lambda s: s.split(","),
        default=[],
        help="only the big-session steps whose names start with one of these",
    )
    parser.add_argument(
        "--big-code",
        type=Path,
        help="run the steps with the pglease of another checkout (a before/after pair)",
    )
    parser.add_argument(
        "--big-explain", action="store_true", help="EXPLAIN a chunk's statements after imports"
    )
    parser.add_argument(
        "--big-delete", action="store_true", help="also delete the imported session"
    )
    parser.add_argument(
        "--big-diagnose",
        action="store_true",
        help="sample waits, checkpoints and WAL during imports and deletes",
    )
    parser.add_argument(
        "--big-no-pg", action="store_true", help="skip the import, export and branch export"
    )
    parser.add_argument(
        "--big-before", type=int, default=0, help="also the old path, up to this size"
    )
    parser.add_argument("--import-chunk", type=int, default=500)

    args = parser.parse_args()
    info = machine_info()
    for key, value in info.items():
        print(f"{key}: {value}")
    server = nullcontext(args.dsn) if args.dsn else throwaway_server()
    with server as dsn:
        lines = [] if args.big_only else run(args, dsn)
        if args.big:
            lines += ["", *big_sessions(args, dsn)]
    print("\n".join(lines))
    if args.markdown:
        machine = ", ".join(f"{k} {v}" for k, v in info.items())
        args.markdown.write_text("\n".join([f"Machine: {machine}", "", *lines, ""]))


if __name__ == "__main__":
    main()
