"""Soak under stalls (issue 31): hosts each behind their own fault-injecting
proxy, partitions inside and outside transactions, heals by resume and by
reset, whole-server outages; checked by an independent reader of the raw tables.

    PYTHONPATH=$PWD .venv/bin/python bench/stall_soak.py --minutes 10 --outages 2 \\
        --outage-seconds 10 --seed 31

Without ``--dsn`` it starts a throwaway embedded PostgreSQL. Prints a text
summary (``--json``: the report as JSON) and exits 1 if any violation was
found. The engine is ``tests/_stall_soak.py``; bench/README.md says what each
figure means.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._server import throwaway_server
from tests._stall_soak import Settings, run_soak, summary


@contextlib.contextmanager
def _server(dsn: str | None) -> Iterator[str]:
    if dsn is not None:
        yield dsn
    else:
        with throwaway_server() as made:
            yield made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--outages", type=int, default=2)
    parser.add_argument("--outage-seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--holders", type=int, default=2, help="hold() workers per host")
    parser.add_argument("--ttl", type=float, default=2.5)
    parser.add_argument("--dsn", help="an existing server (default: a throwaway one)")
    parser.add_argument("--workdir", help="keep the hosts' logs here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    settings = Settings(
        hosts=args.hosts, holders=args.holders, seconds=args.minutes * 60,
        outages=args.outages, outage_seconds=args.outage_seconds, seed=args.seed, ttl=args.ttl,
    )  # fmt: skip
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pglease-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    schema = f"soak_{uuid.uuid4().hex[:8]}"
    started = time.time()
    with _server(args.dsn) as dsn:
        report = run_soak(dsn, schema, workdir, settings,
                          progress=lambda m: print(f"[{time.time() - started:6.0f} s] {m}",
                                                   file=sys.stderr, flush=True))  # fmt: skip
    report.figures["load_average"] = [round(x, 2) for x in os.getloadavg()]
    report.figures["settings"] = vars(args) | {"store_bound": settings.store_bound}
    report.figures["logs"] = str(workdir)
    print(report.to_json() if args.json else summary(report))
    if not args.json:
        print(f"load average at the end: {report.figures['load_average']}; logs in {workdir}")
    return 1 if report.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
