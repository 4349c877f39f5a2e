"""Shared loop for the peer workers: stdlib only, since it runs in every peer's own venv.

A worker supplies one `cycle(rng, index)` callable per thread (or an async one per
task); the harness runs them for `--warmup` then `--seconds`, and prints one JSON
object: cycles, refused, errors, the window, this process's CPU over the window and
per-cycle latency percentiles.

`cycle` returns True when the claim was granted (and released), False when it was
refused; an exception counts as an error, and the loop carries on (the first few
messages are kept), so a flaky peer shows up as errors instead of a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

Cycle = Callable[[random.Random], bool]
AsyncCycle = Callable[[random.Random], Awaitable[bool]]
Closer = Callable[[], Awaitable[None]]

#: Errors stop being timed after this many per thread, so a peer that fails
#: instantly does not spin a tight loop of exceptions for the whole window.
MAX_ERRORS_PER_THREAD = 1000


def parse_args(
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True, help="DSN or endpoint of the server")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--keys", type=int, default=10_000)
    p.add_argument("--hot", action="store_true", help="every cycle picks key 0")
    p.add_argument("--mode", default="")
    if extra is not None:
        extra(p)
    return p.parse_args()


def key_index(rng: random.Random, args: argparse.Namespace) -> int:
    return 0 if args.hot else rng.randrange(args.keys)


class _Counter:
    __slots__ = ("cycles", "errors", "lat", "measuring", "messages", "refused")

    def __init__(self) -> None:
        self.cycles = 0
        self.refused = 0
        self.errors = 0
        self.lat: list[float] = []
        self.measuring = False
        self.messages: list[str] = []

    def record(self, granted: bool | None, started: float, ended: float) -> None:
        if not self.measuring:
            return
        self.cycles += 1
        if granted is None:
            self.errors += 1
        elif not granted:
            self.refused += 1
        self.lat.append(ended - started)


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def _report(counters: list[_Counter], window: float, cpu: float, extra: dict[str, Any]) -> None:
    lat = sorted(x for c in counters for x in c.lat)
    messages = [m for c in counters for m in c.messages][:5]
    out = {
        "cycles": sum(c.cycles for c in counters),
        "refused": sum(c.refused for c in counters),
        "errors": sum(c.errors for c in counters),
        "seconds": window,
        "cpu": cpu,
        "p50_ms": None if not lat else _percentile(lat, 0.50) * 1e3,  # type: ignore[operator]
        "p99_ms": None if not lat else _percentile(lat, 0.99) * 1e3,  # type: ignore[operator]
        "error_messages": messages,
        **extra,
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()


def _note(counter: _Counter, exc: BaseException) -> None:
    if len(counter.messages) < 3:
        counter.messages.append(f"{type(exc).__name__}: {exc}"[:300])


def run_threads(
    args: argparse.Namespace,
    make_cycle: Callable[[int], Cycle],
    extra: dict[str, Any] | None = None,
    close: Callable[[], None] | None = None,
) -> None:
    """Run `args.threads` threads, each looping the cycle that `make_cycle(i)` built."""
    counters = [_Counter() for _ in range(args.threads)]
    stop = threading.Event()
    cycles = [make_cycle(i) for i in range(args.threads)]  # set-up (connections) before timing

    def run(i: int) -> None:
        rng = random.Random(1000 + i)
        counter, cycle, clock = counters[i], cycles[i], time.perf_counter
        while not stop.is_set():
            t0 = clock()
            try:
                granted: bool | None = cycle(rng)
            except Exception as exc:  # a peer's failure is a figure, not a crash
                granted = None
                _note(counter, exc)
            counter.record(granted, t0, clock())
            if counter.errors >= MAX_ERRORS_PER_THREAD:
                stop.wait(0.01)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.threads)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    for c in counters:
        c.measuring = True
    t0, p0 = time.perf_counter(), time.process_time()
    time.sleep(args.seconds)
    for c in counters:
        c.measuring = False
    t1, p1 = time.perf_counter(), time.process_time()
    stop.set()
    for t in threads:
        t.join(timeout=60)
    if close is not None:
        close()
    _report(counters, t1 - t0, p1 - p0, extra or {})


def run_tasks(
    args: argparse.Namespace,
    setup: Callable[[], Awaitable[tuple[Callable[[int], Awaitable[AsyncCycle]], Closer]]],
    extra: dict[str, Any] | None = None,
) -> None:
    """Run `args.threads` asyncio tasks in one loop; `setup()` (run inside the loop) returns
    a per-task cycle factory and a coroutine function that cleans up."""

    async def main() -> None:
        make_cycle, aclose = await setup()
        counters = [_Counter() for _ in range(args.threads)]
        cycles = [await make_cycle(i) for i in range(args.threads)]
        stop = asyncio.Event()

        async def run(i: int) -> None:
            rng = random.Random(1000 + i)
            counter, cycle, clock = counters[i], cycles[i], time.perf_counter
            while not stop.is_set():
                t0 = clock()
                try:
                    granted: bool | None = await cycle(rng)
                except Exception as exc:
                    granted = None
                    _note(counter, exc)
                counter.record(granted, t0, clock())
                if counter.errors >= MAX_ERRORS_PER_THREAD:
                    await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(run(i)) for i in range(args.threads)]
        await asyncio.sleep(args.warmup)
        for c in counters:
            c.measuring = True
        t0, p0 = time.perf_counter(), time.process_time()
        await asyncio.sleep(args.seconds)
        for c in counters:
            c.measuring = False
        t1, p1 = time.perf_counter(), time.process_time()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        await aclose()
        _report(counters, t1 - t0, p1 - p0, extra or {})

    asyncio.run(main())
