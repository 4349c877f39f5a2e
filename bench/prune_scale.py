"""Prune at scale: duration, longest transaction, and a watcher's lag during it.

For each log size N (default 1,000,000 events) a schema is filled with N old
events (created two days ago, 1 in 10 with a payload, 1 in 100 of those
shared), then pruned with ``--older-than 1d`` while a writer appends one
event every --write-every seconds and a pglease `Watcher` reads them:

- ``single``: the prune before sql/0014, one transaction (the previous
  `prune_log` body, installed here as ``bench_prune_log_0013``);
- ``chunked C``: `pglease.watch.prune(store, 86400, chunk=C)`, each chunk its
  own transaction.

Figures per run: the prune's wall time; the longest transaction the prune's
connection held an xid for (a sampler reads pg_stat_activity every 5 ms, so
it is a lower bound within ~5 ms); the watcher's lag (from the writer's
commit returning to the watcher receiving that event), max and p99, over the
events written while the prune ran. The writer's own commits are short, so
the lag is what the prune's transactions hold back.

``--partition-scratch`` also times, on scratch tables outside pglease
(a plain table and one partitioned by id ranges of --part-rows, both with the
event log's indexes), dropping the oldest --part-rows rows by chunked DELETE
versus DETACH + DROP of a partition, and one watcher-style read
(``(xid, id) > (...) ORDER BY xid, id LIMIT 100``) on each.

    .venv/bin/python bench/prune_scale.py [--dsn DSN] [--sizes 1000000] [--chunks 1000]
        [--no-single] [--profile] [--partition-scratch --scratch-rows 10000000
        --part-rows 1000000]    (--sizes '' for the scratch tables alone)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _server import machine_info, throwaway_server

from pglease import Permit, PostgresStore
from pglease.watch import Watcher, prune
from pglease.watch.prune import DEFAULT_CHUNK

# The prune_log body before sql/0014 (one DELETE of the whole prefix, then an
# anti-join of every payload), kept to measure "before".
OLD_PRUNE = """
CREATE OR REPLACE FUNCTION {s}.bench_prune_log_0013(
    p_older_than interval, OUT events bigint, OUT payloads bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_cutoff timestamptz := clock_timestamp() - p_older_than;
    v_xmin xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_keep_xid xid8; v_keep_id bigint; v_max_xid xid8; v_max_id bigint;
    v_candidates bytea[];
BEGIN
    PERFORM 1 FROM {s}.event_horizon FOR UPDATE;
    SELECT e.xid, e.id INTO v_keep_xid, v_keep_id FROM {s}.events e
     WHERE e.created_at >= v_cutoff OR e.xid >= v_xmin ORDER BY e.xid, e.id LIMIT 1;
    WITH gone AS (
        DELETE FROM {s}.events e WHERE e.xid < v_xmin
           AND (v_keep_xid IS NULL OR (e.xid, e.id) < (v_keep_xid, v_keep_id))
        RETURNING e.xid, e.id)
    SELECT count(*), (array_agg(g.xid ORDER BY g.xid DESC, g.id DESC))[1],
           (array_agg(g.id ORDER BY g.xid DESC, g.id DESC))[1]
      INTO bench_prune_log_0013.events, v_max_xid, v_max_id FROM gone g;
    IF bench_prune_log_0013.events > 0 THEN
        UPDATE {s}.event_horizon SET pruned_xid = v_max_xid, pruned_id = v_max_id,
            pruned_at = clock_timestamp() WHERE (pruned_xid, pruned_id) < (v_max_xid, v_max_id);
    END IF;
    SELECT array_agg(c.sha256) INTO v_candidates FROM (
        SELECT p.sha256 FROM {s}.payloads p
         WHERE NOT EXISTS (SELECT 1 FROM {s}.events e WHERE e.payload_sha256 = p.sha256)
           FOR UPDATE OF p SKIP LOCKED) c;
    WITH gone AS (
        DELETE FROM {s}.payloads p WHERE p.sha256 = ANY (v_candidates)
           AND NOT EXISTS (SELECT 1 FROM {s}.events e WHERE e.payload_sha256 = p.sha256)
        RETURNING 1)
    SELECT count(*) INTO bench_prune_log_0013.payloads FROM gone;
    TRUNCATE {s}.payload_gc_queue;  -- what 0014 queued is judged by the scan above
END $$;
"""


def fill(dsn: str, schema: str, n: int, batch: int = 250_000) -> None:
    """N events dated two days ago on 1,000 resources, in batches of `batch`
    per transaction; every 10th carries a payload, 1 in 100 of them shared."""
    s = f'"{schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {s}.resources (id, type, key, revision)"
            " SELECT 'r' || g, 'bench', 'k' || g, 0 FROM generate_series(0, 999) g"
        )
        conn.execute(f"INSERT INTO {s}.leases (resource_id) SELECT id FROM {s}.resources")
        done = 0
        while done < n:
            m = min(batch, n - done)
            # Payload bodies: unique per 10th event, except every 100th shares one of 50.
            conn.execute(
                f"INSERT INTO {s}.payloads (sha256, body)"
                " SELECT sha256(convert_to(b, 'UTF8')), b FROM ("
                "  SELECT DISTINCT CASE WHEN mod(g, 100) = 0"
                "   THEN '{\"shared\":' || mod(g / 100, 50) || '}'"
                "   ELSE '{\"n\":' || g || '}' END AS b"
                "  FROM generate_series(%s::bigint, %s::bigint) g WHERE mod(g, 10) = 0) x"
                " ON CONFLICT DO NOTHING",
                [done, done + m - 1],
            )
            conn.execute(
                f"INSERT INTO {s}.events (resource_id, revision, type, payload_sha256, created_at)"
                " SELECT 'r' || (mod(g, 1000)), g / 1000 + 1, 'bench.old',"
                "  CASE WHEN mod(g, 10) <> 0 THEN NULL WHEN mod(g, 100) = 0"
                "   THEN sha256(convert_to('{\"shared\":' || mod(g / 100, 50) || '}', 'UTF8'))"
                "   ELSE sha256(convert_to('{\"n\":' || g || '}', 'UTF8')) END,"
                "  clock_timestamp() - interval '2 days'"
                " FROM generate_series(%s::bigint, %s::bigint) g",
                [done, done + m - 1],
            )
            done += m
        conn.execute(
            f"UPDATE {s}.resources r SET revision = m.rev FROM (SELECT resource_id,"
            f" max(revision) AS rev FROM {s}.events GROUP BY resource_id) m"
            " WHERE r.id = m.resource_id"
        )
        conn.execute(f"VACUUM ANALYZE {s}.events")
        conn.execute(f"VACUUM ANALYZE {s}.payloads")


class Sampler(threading.Thread):
    """The longest time a backend with this application_name held an xid."""

    def __init__(self, dsn: str, app: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.app = dsn, app
        self.longest = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            query = (
                "SELECT extract(epoch FROM clock_timestamp() - xact_start) FROM pg_stat_activity"
                " WHERE application_name = %s AND backend_xid IS NOT NULL"
            )
            while not self.stop.is_set():
                for (age,) in conn.execute(query, [self.app]).fetchall():
                    self.longest = max(self.longest, float(age))
                time.sleep(0.005)


class Traffic:
    """A writer appending one event every `every` s and a watcher reading them;
    lag = watcher receipt - writer's commit returning, per event."""

    def __init__(self, store: PostgresStore, every: float) -> None:
        self.store, self.every = store, every
        self.rid = store.ensure_resource("bench", "live")
        self.committed: dict[int, float] = {}
        self.lags: dict[int, float] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.watcher = Watcher(store)
        self._threads = [
            threading.Thread(target=self._write, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(60)
        self.watcher.close()

    def _write(self) -> None:
        try:
            revision = self.store.get(self.rid).revision
            while not self.stop.is_set():
                result = self.store.mutate(Permit(self.rid, revision), "bench.live")
                self.committed[result.revision] = time.monotonic()
                revision = result.revision
                time.sleep(self.every)
        except BaseException as exc:
            self.error = exc

    def _watch(self) -> None:
        try:
            while not self.stop.is_set():
                event = self.watcher.get(0.2)
                if event is not None and event.resource_id == self.rid:
                    now = time.monotonic()
                    sent = self.committed.get(event.revision)
                    if sent is not None:
                        self.lags[event.revision] = now - sent
        except BaseException as exc:
            self.error = exc

    def lag_between(self, start: float, end: float) -> list[float]:
        return [
            self.lags[r]
            for r, t in list(self.committed.items())
            if start <= t <= end and r in self.lags
        ]


def run_one(dsn: str, n: int, mode: str, chunk: int, every: float) -> dict[str, Any]:
    schema = f"pglease_prunescale_{uuid.uuid4().hex[:6]}"
    app = f"bench-prune-{uuid.uuid4().hex[:6]}"
    with PostgresStore(dsn, schema=schema, max_size=4) as store:
        t0 = time.monotonic()
        fill(dsn, schema, n)
        filled = time.monotonic() - t0
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(OLD_PRUNE.format(s=f'"{schema}"'))
        prune_dsn = conninfo.make_conninfo(dsn, application_name=app)
        with (
            PostgresStore(prune_dsn, schema=schema, max_size=1) as pruner,
            Traffic(store, every) as traffic,
        ):
            time.sleep(1.0)  # the watcher is live and keeping up
            sampler = Sampler(dsn, app)
            sampler.start()
            start = time.monotonic()
            if mode == "single":
                with pruner.connection() as conn:
                    conn.execute("SET statement_timeout = 0")  # it runs long: that is the point
                    row = conn.execute(
                        f"SELECT * FROM \"{schema}\".bench_prune_log_0013(interval '1 day')"
                    ).fetchone()
                assert row is not None
                events, payloads = int(row[0]), int(row[1])
            else:
                result = prune(pruner, 86400, chunk=chunk)
                events, payloads = result.events, result.payloads
            end = time.monotonic()
            sampler.stop.set()
            sampler.join(10)
            time.sleep(1.0)  # let the watcher deliver what the prune held back
        if traffic.error is not None:
            raise traffic.error
        lags = sorted(traffic.lag_between(start, end))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return {
        "events": n,
        "mode": mode if mode == "single" else f"chunked {chunk}",
        "fill_s": filled,
        "prune_s": end - start,
        "deleted": events,
        "payloads": payloads,
        "longest_xact_s": sampler.longest,
        "lag_max_s": lags[-1] if lags else float("nan"),
        "lag_p99_s": lags[int(len(lags) * 0.99)] if lags else float("nan"),
        "lag_median_s": statistics.median(lags) if lags else float("nan"),
        "lag_samples": len(lags),
    }


def profile(dsn: str, n: int, chunk: int) -> list[str]:
    """Every chunk of a prune of N events timed on its own (no writer, no
    watcher): the distribution of transaction lengths, events then payloads,
    and how many of the chunks over 100 ms ran while an autovacuum worker was
    busy with the events table."""
    schema = f"pglease_pruneprof_{uuid.uuid4().hex[:6]}"
    autovacuum = (
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
        " AND query ILIKE '%%events%%'"
    )
    with PostgresStore(dsn, schema=schema, max_size=1):
        pass
    fill(dsn, schema, n)
    out = []
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as mon,
    ):
        row = conn.execute("SELECT clock_timestamp() - interval '1 day'").fetchone()
        assert row is not None
        steps: dict[str, list[float]] = {"events": [], "payloads": []}
        slow_during_vacuum = 0
        after: bytes = b""
        for name in steps:
            done = False
            while not done:
                t = time.monotonic()
                if name == "events":
                    q = f'SELECT done FROM "{schema}".prune_chunk(%s, %s)'
                    got = conn.execute(q, [row[0], chunk]).fetchone()
                    assert got is not None
                    done = bool(got[0])
                else:
                    q = f'SELECT last_sha256, done FROM "{schema}".gc_payloads_chunk(%s, %s)'
                    got = conn.execute(q, [after, max(1, chunk // 2)]).fetchone()
                    assert got is not None
                    after, done = bytes(got[0]), bool(got[1])
                took = time.monotonic() - t
                steps[name].append(took)
                if took > 0.1:
                    vac = mon.execute(autovacuum).fetchone()
                    slow_during_vacuum += bool(vac and vac[0])
        for name, xs in steps.items():
            s = sorted(xs)
            out.append(
                f"{n:,} events, chunk {chunk}, {name}: {len(s)} chunks, {sum(s):.1f} s;"
                f" median {statistics.median(s) * 1000:.1f} ms, p99"
                f" {s[int(len(s) * 0.99)] * 1000:.1f} ms, max {s[-1] * 1000:.1f} ms;"
                f" {sum(x > 0.1 for x in s)} over 100 ms"
            )
        out.append(f"chunks over 100 ms while autovacuum worked on events: {slow_during_vacuum}")
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return out


# ---------------------------------------------------------------------- partitions


def scratch(dsn: str, rows: int, part_rows: int, chunk: int) -> dict[str, float]:
    """Chunked DELETE of the oldest part_rows rows vs DETACH + DROP of a partition."""
    out: dict[str, float] = {}
    cols = (
        "id bigint NOT NULL, xid xid8 NOT NULL, resource_id text NOT NULL,"
        " revision bigint NOT NULL, type text NOT NULL, payload_sha256 bytea,"
        " created_at timestamptz NOT NULL"
    )
    fill = (
        "INSERT INTO {t} SELECT g, (1000 + g / 1000)::text::xid8, 'r' || mod(g, 1000),"
        " g / 1000 + 1,"
        " 'bench.old', NULL, clock_timestamp() FROM generate_series(%s::bigint, %s::bigint) g"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS bench_scratch CASCADE; CREATE SCHEMA bench_scratch")
        conn.execute(f"CREATE TABLE bench_scratch.plain ({cols})")
        conn.execute(f"CREATE TABLE bench_scratch.part ({cols}) PARTITION BY RANGE (id)")
        for p in range(rows // part_rows):
            conn.execute(
                f"CREATE TABLE bench_scratch.part_{p} PARTITION OF bench_scratch.part"
                f" FOR VALUES FROM ({p * part_rows}) TO ({(p + 1) * part_rows})"
            )
        for table in ("plain", "part"):
            conn.execute(f"ALTER TABLE bench_scratch.{table} ADD PRIMARY KEY (id)")
            for lo in range(0, rows, 1_000_000):
                conn.execute(
                    fill.format(t=f"bench_scratch.{table}"), [lo, min(rows, lo + 1_000_000) - 1]
                )
            # The event log's indexes (the unique one must include the partition key there).
            key = "(resource_id, revision)" if table == "plain" else "(resource_id, revision, id)"
            conn.execute(f"CREATE UNIQUE INDEX ON bench_scratch.{table} {key}")
            conn.execute(f"CREATE INDEX ON bench_scratch.{table} (xid, id)")
            conn.execute(
                f"CREATE INDEX ON bench_scratch.{table} (payload_sha256)"
                " WHERE payload_sha256 IS NOT NULL"
            )
            conn.execute(f"VACUUM ANALYZE bench_scratch.{table}")

        def read(table: str) -> float:
            best = float("inf")
            for _ in range(20):
                t = time.monotonic()
                conn.execute(
                    f"SELECT * FROM bench_scratch.{table} WHERE (xid, id) > (%s::xid8, %s)"
                    " ORDER BY xid, id LIMIT 100",
                    [str(1000 + rows // 2000), rows // 2],
                ).fetchall()
                best = min(best, time.monotonic() - t)
            return best

        out["read_plain_s"] = read("plain")
        out["read_part_s"] = read("part")
        t = time.monotonic()
        longest, n, last = 0.0, 0, ("0", -1)
        while n < part_rows:
            # As prune_chunk does: the next `chunk` rows in read order after
            # the last deleted one (the horizon).
            c = time.monotonic()
            row = conn.execute(
                "WITH d AS (DELETE FROM bench_scratch.plain WHERE (xid, id) IN (SELECT xid, id"
                " FROM bench_scratch.plain WHERE (xid, id) > (%s::xid8, %s)"
                " ORDER BY xid, id LIMIT %s) RETURNING xid, id)"
                " SELECT count(*), (array_agg(xid::text ORDER BY xid DESC, id DESC))[1],"
                " max(id) FROM d",
                [last[0], last[1], min(chunk, part_rows - n)],
            ).fetchone()
            assert row is not None
            n, last = n + int(row[0]), (str(row[1]), int(row[2]))
            longest = max(longest, time.monotonic() - c)
        out["chunked_delete_s"] = time.monotonic() - t
        out["chunked_delete_longest_xact_s"] = longest
        t = time.monotonic()
        with conn.transaction():
            conn.execute("ALTER TABLE bench_scratch.part DETACH PARTITION bench_scratch.part_0")
            conn.execute("DROP TABLE bench_scratch.part_0")
        out["detach_drop_s"] = time.monotonic() - t
        out["read_plain_after_s"] = read("plain")
        out["read_part_after_s"] = read("part")
        conn.execute("DROP SCHEMA bench_scratch CASCADE")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="a server to use (default: a throwaway embedded one)")
    parser.add_argument("--sizes", default="1000000")
    parser.add_argument("--chunks", default="1000", help="chunk sizes for the chunked runs")
    parser.add_argument("--no-single", action="store_true", help="skip the one-transaction prune")
    parser.add_argument("--write-every", type=float, default=0.02)
    parser.add_argument(
        "--profile", action="store_true", help="time every chunk alone instead (no traffic)"
    )
    parser.add_argument("--partition-scratch", action="store_true")
    parser.add_argument("--scratch-rows", type=int, default=10_000_000)
    parser.add_argument("--part-rows", type=int, default=1_000_000)
    args = parser.parse_args()
    print(machine_info())

    def go(dsn: str) -> None:
        sizes = [int(x) for x in args.sizes.split(",") if x]
        if args.profile:
            for n in sizes:
                for chunk in (int(c) for c in args.chunks.split(",")):
                    print("\n".join(profile(dsn, n, chunk)), flush=True)
            sizes = []
        for n in sizes:
            modes = [] if args.no_single else [("single", 0)]
            modes += [("chunked", int(c)) for c in args.chunks.split(",")]
            for mode, chunk in modes:
                r = run_one(dsn, n, mode, chunk, args.write_every)
                print(
                    f"{r['events']:>10,} {r['mode']:<14} prune {r['prune_s']:7.2f} s"
                    f"  deleted {r['deleted']:,} events, {r['payloads']:,} payloads"
                    f"  longest xact {r['longest_xact_s'] * 1000:7.1f} ms"
                    f"  watcher lag max {r['lag_max_s'] * 1000:7.1f} ms"
                    f" p99 {r['lag_p99_s'] * 1000:6.1f} ms"
                    f" median {r['lag_median_s'] * 1000:5.1f} ms"
                    f" ({r['lag_samples']} events; fill {r['fill_s']:.0f} s)",
                    flush=True,
                )
        if args.partition_scratch:
            r = scratch(dsn, args.scratch_rows, args.part_rows, DEFAULT_CHUNK)
            print(f"scratch {args.scratch_rows:,} rows, drop the oldest {args.part_rows:,}:")
            for k, v in r.items():
                print(f"  {k:<32} {v * 1000:10.1f} ms", flush=True)

    if args.dsn:
        go(args.dsn)
    else:
        with throwaway_server() as dsn:
            go(dsn)


if __name__ == "__main__":
    main()
