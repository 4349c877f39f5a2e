"""Upgrading a big database in place: migration 0018 and its chunked row move.

One throwaway server. A schema is built at migration 0017 with the functions
of that time (tests/migration_0017_functions), filled with N resources and
their lease rows (default 1,000,000), then upgraded while one client claims
and releases random leases without pause. Printed: how long the migration
transaction took (its ACCESS EXCLUSIVE lock on `leases` is what claims wait
for), each chunk of the row move (move_revisions_chunk, 1,000 rows, its own
transaction), and the longest claim or release the client saw during each
phase: the bound issue 24 item 6 sets is about 100 ms.

    .venv/bin/python bench/lease_row_move.py [--rows 1000000] [--chunk 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import throwaway_server

import pglease._migrate as migrate_module
import pglease.migration_files as migration_files
from pglease.migrations import migrate

SCHEMA = "pglease"
OLD_FUNCTIONS = Path(__file__).resolve().parent.parent / "tests" / "migration_0017_functions"


def at_0017(tmp: Path) -> Path:
    copy = tmp / "sql"
    shutil.copytree(migration_files.migrations_dir(), copy)
    for path in copy.glob("*.sql"):
        if int(path.name[:4]) >= 18:
            path.unlink()
    shutil.rmtree(copy / "functions")
    shutil.copytree(OLD_FUNCTIONS, copy / "functions", ignore=shutil.ignore_patterns("*.md"))
    return copy


def fill(dsn: str, rows: int) -> list[str]:
    s = SCHEMA
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {s}.resources (id, type, key, revision)"
            " SELECT 'bench-' || left(encode(sha256(convert_to('k' || g, 'UTF8')), 'hex'), 40),"
            " 'bench', 'k' || g, 0 FROM generate_series(1, %s) g",
            [rows],
        )
        conn.execute(f"INSERT INTO {s}.leases (resource_id) SELECT id FROM {s}.resources")
        conn.execute(f"VACUUM ANALYZE {s}.resources")
        conn.execute(f"VACUUM ANALYZE {s}.leases")
        sample = conn.execute(
            f"SELECT id FROM {s}.resources TABLESAMPLE SYSTEM (1) LIMIT 20000"
        ).fetchall()
    return [str(r[0]) for r in sample]


class Client(threading.Thread):
    """Claims and releases random leases, one statement per call, and keeps the
    longest call per phase."""

    def __init__(self, dsn: str, ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.dsn, self.ids = dsn, ids
        self.phase = "before"
        self.worst: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stop = threading.Event()

    def timed(self, conn: psycopg.Connection[tuple[object, ...]], query: str, args: list[object]):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        row = conn.execute(query, args).fetchone()
        took = time.perf_counter() - t
        phase = self.phase
        self.worst[phase] = max(self.worst.get(phase, 0.0), took)
        self.calls[phase] = self.calls.get(phase, 0) + 1
        return row

    def run(self) -> None:
        token = hashlib.sha256(b"bench").digest()
        rnd = random.Random(1)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                rid = rnd.choice(self.ids)
                row = self.timed(
                    conn,
                    f"SELECT claimed, generation FROM {SCHEMA}.claim(%s, 'bench', 'c', %s, 30,"
                    " NULL, NULL)",
                    [rid, token],
                )
                if row and row[0]:
                    self.timed(
                        conn,
                        f"SELECT {SCHEMA}.release(%s, 'bench', 'c', %s, %s, NULL, NULL)",
                        [rid, row[1], token],
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=1000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pglease-move-"))
    try:
        with throwaway_server() as dsn:
            old = at_0017(tmp)
            real = migration_files.migrations_dir
            migration_files.migrations_dir = lambda: old  # type: ignore[assignment]
            with psycopg.connect(dsn, autocommit=True) as conn:
                migrate(conn, SCHEMA)
            migration_files.migrations_dir = real  # type: ignore[assignment]
            t = time.perf_counter()
            ids = fill(dsn, args.rows)
            print(f"{args.rows} lease rows at 0017 in {time.perf_counter() - t:.1f} s;"
                  f" load {os.getloadavg()[0]:.1f}")  # fmt: skip
            client = Client(dsn, ids)
            client.start()
            time.sleep(2)
            client.phase = "migration"
            moves = migrate_module.move_revisions
            migrate_module.move_revisions = lambda *a, **k: 0  # type: ignore[assignment]
            with psycopg.connect(dsn, autocommit=True) as conn:
                t = time.perf_counter()
                applied = migrate(conn, SCHEMA)
                migration = time.perf_counter() - t
                migrate_module.move_revisions = moves  # type: ignore[assignment]
                client.phase = "move"
                chunks: list[float] = []
                t0 = time.perf_counter()
                while True:
                    t = time.perf_counter()
                    row = conn.execute(
                        f"SELECT {SCHEMA}.move_revisions_chunk(%s)", [args.chunk]
                    ).fetchone()
                    chunks.append(time.perf_counter() - t)
                    if not row or not row[0]:
                        break
                moved = time.perf_counter() - t0
                client.phase = "after"
                time.sleep(2)
                client.stop.set()
                client.join()
                left = conn.execute(
                    f"SELECT count(*) FROM {SCHEMA}.leases WHERE revision IS NULL"
                ).fetchone()
            chunks.sort()
            print(f"applied {', '.join(a.label for a in applied)}:"
                  f" migration transaction {1000 * migration:.0f} ms")  # fmt: skip
            print(
                f"move: {len(chunks)} chunks of {args.chunk} in {moved:.1f} s;"
                f" chunk p50 {1000 * statistics.median(chunks):.1f} ms,"
                f" p99 {1000 * chunks[int(0.99 * (len(chunks) - 1))]:.1f} ms,"
                f" max {1000 * chunks[-1]:.1f} ms; rows left unmoved {left[0] if left else '?'}"
            )
            for phase in ("before", "migration", "move", "after"):
                print(f"client, {phase:<9}: {client.calls.get(phase, 0):6d} calls,"
                      f" longest {1000 * client.worst.get(phase, 0.0):6.1f} ms")  # fmt: skip
            print(f"load {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
