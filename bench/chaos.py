"""Longer chaos run on a throwaway embedded PostgreSQL (restarted once mid-run).

.venv/bin/python bench/chaos.py [--hosts 4] [--workers 3] [--keys 4] [--ttl 1] [--seconds 60]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _server import throwaway_server  # noqa: E402

from tests._chaos import run_chaos  # noqa: E402
from tests._watch_helpers import restart_server, wait_for_server  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("hosts", 4), ("workers", 3), ("keys", 4), ("kills", 6)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    with throwaway_server() as dsn, tempfile.TemporaryDirectory() as work:

        def restart() -> None:
            restart_server(dsn)
            wait_for_server(dsn)

        report = run_chaos(
            dsn, "chaos", Path(work), hosts=args.hosts, workers=args.workers, keys=args.keys,
            ttl=args.ttl, seconds=args.seconds, kills=args.kills, restart=restart,
        )  # fmt: skip
    print(report)
    sys.exit(1 if report.violations else 0)


if __name__ == "__main__":
    main()
