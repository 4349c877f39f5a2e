"""Entry points run as real OS processes by the multi-host tests."""

from __future__ import annotations

import contextlib
import json
import sys
import time

from pglease import LeaseLostError, Owner, PostgresStore


def race(dsn: str, schema: str, rid: str, owner_id: str, seconds: float, start_at: float) -> None:
    """Claim one resource in a loop; print each won generation as JSON lines."""
    with PostgresStore(dsn, schema=schema, max_size=1, auto_migrate=False) as store:
        owner = Owner("host", owner_id)
        while time.time() < start_at:
            time.sleep(0.001)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            claim = store.claim(rid, owner, 0.05)
            if claim is None:
                continue
            print(json.dumps({"generation": claim.generation, "revision": claim.revision}))
            if claim.generation % 3:  # otherwise let it expire: takeovers happen too
                # Descheduled past the short TTL and taken over: fenced, as it must be.
                with contextlib.suppress(LeaseLostError):
                    store.release(claim)


def migrate(dsn: str, schema: str, start_at: float) -> None:
    while time.time() < start_at:
        time.sleep(0.001)
    with PostgresStore(dsn, schema=schema, max_size=1) as store:
        print(json.dumps({"applied": store.migrate()}))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "race":
        race(args[0], args[1], args[2], args[3], float(args[4]), float(args[5]))
    elif command == "migrate":
        migrate(args[0], args[1], float(args[2]))
    else:
        raise SystemExit(f"unknown command {command}")
