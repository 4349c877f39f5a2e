"""`pglease top`: the live loop around `pglease.top.TopModel`, and its subcommand.

It reads the database clock once (the model's offset), starts a watcher,
then lists the held leases in keyset pages, and redraws at most `--fps` times
a second from what the watcher delivers; `q`, Ctrl-C and SIGTERM end it with
the terminal restored. Errors reach the CLI's one-line report as PgleaseErrors.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import psycopg

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import DatabaseUnavailableError
from ..listing import iter_resources
from ..postgres import PostgresStore
from ..postgres._core import driver_error
from ..validation import check_resource_type
from .support import EXIT_OK, EXIT_USAGE, fail, open_store, sigterm_as_interrupt

if TYPE_CHECKING:  # rich is imported when the view runs, not by every CLI command
    from rich.console import Console

    from ..top import TopModel

__all__ = ["register", "run", "warnings_to"]

#: Frames per second at most, by default.
DEFAULT_FPS = 4.0
#: Seconds between readings of the database clock (its offset to the host's).
CLOCK_REMEASURE = 60.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``top`` subcommand."""
    p = subparsers.add_parser(
        "top",
        help="live view: leases by expiry with holder, generation and time left; event rate,"
        " recent events, watcher lag (q quits)",
        description="A live terminal view of the held leases, sorted by expiry, refreshed from"
        " a watcher. Time left is judged by the database clock. q or Ctrl-C quits.",
    )
    p.add_argument("--type", metavar="T", help="only resources of this type")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument(
        "--fps",
        type=_fps,
        default=DEFAULT_FPS,
        metavar="N",
        help="frames per second at most (default 4, between 0.1 and 10)",
    )
    p.set_defaults(func=cmd_top)


def _fps(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.1 <= value <= 10:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 10, got {text}")
    return value


def cmd_top(args: argparse.Namespace) -> int:
    if getattr(args, "json", False):
        return fail(
            "top draws a terminal view and has no JSON output (for a listing: pglease --json ls"
            " --held)",
            EXIT_USAGE,
        )
    if args.type is not None:
        check_resource_type(args.type)  # bad input: refused before anything connects
    if not args.once and not sys.stdout.isatty():
        return fail(
            "top draws on a terminal and stdout is not one: --once prints one frame", EXIT_USAGE
        )
    # SIGTERM ends the view as Ctrl-C and q do: the terminal is restored first.
    with (
        sigterm_as_interrupt(),
        contextlib.suppress(KeyboardInterrupt),
        open_store(args, read_only=True) as store,
    ):
        run(store, resource_type=args.type, once=args.once, fps=args.fps)
    return EXIT_OK


def measure_db_clock(store: PostgresStore, model: TopModel) -> None:
    """Read the database clock once and give the model its offset."""
    try:
        with store.connection() as conn:
            sent = model.clock.time()
            row = conn.execute("SELECT clock_timestamp()").fetchone()
            received = model.clock.time()
    except psycopg.Error as exc:
        raise driver_error(exc, dsn=store.dsn) from exc
    assert row is not None
    model.set_db_clock(row[0], sent, received)


def load_leases(store: PostgresStore, model: TopModel, resource_type: str | None) -> None:
    """The held leases, read once in keyset pages."""
    try:
        listed = iter_resources(store, store.schema, resource_type=resource_type, held=True)
        model.load(item.state for item in listed)
    except psycopg.Error as exc:
        raise driver_error(exc, dsn=store.dsn) from exc


class _WarningsToModel(logging.Handler):
    """Log records (the watcher's retries, the pool's reconnects) go to the
    status line while the view owns the screen; on stderr they would garble it."""

    def __init__(self, model: TopModel) -> None:
        super().__init__(logging.WARNING)
        self.model = model

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.model.warn(f"{record.name}: {record.getMessage()}")
        except Exception:
            self.handleError(record)  # logging's own way: never raise into the caller


@contextlib.contextmanager
def warnings_to(model: TopModel) -> Iterator[None]:
    """Within the block, logged warnings go to `model`'s status line."""
    root = logging.getLogger()
    handler = _WarningsToModel(model)
    # With a handler on the root logger, logging's last-resort stderr handler
    # stays quiet; the records an application's own handlers get are unchanged.
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


class _Keys:
    """Single key presses from a terminal stdin (cbreak mode: Ctrl-C still
    interrupts); nothing at all when stdin is not a terminal."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._saved: list[Any] | None = None

    def __enter__(self) -> _Keys:
        # Here, not at module level: `pglease` imports this module for every command.
        import termios
        import tty

        # No terminal on stdin (a pipe, a closed stdin): the view runs without keys.
        with contextlib.suppress(AttributeError, ValueError, OSError, termios.error):
            fd = sys.stdin.fileno()
            if os.isatty(fd):
                self._saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)
                self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None and self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def pressed(self) -> Iterator[str]:
        """The keys pressed since the last call (never blocks)."""
        while self._fd is not None and select.select([self._fd], [], [], 0)[0]:
            data = os.read(self._fd, 64)
            if not data:
                return
            yield from data.decode(errors="replace")


def run(
    store: PostgresStore,
    *,
    resource_type: str | None = None,
    once: bool = False,
    fps: float = DEFAULT_FPS,
    console: Console | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Show the live view until `q`, Ctrl-C or an error (raised as a PgleaseError);
    with `once`, print one frame of the current leases and return."""
    from rich.console import Console
    from rich.live import Live

    from ..top import TopModel

    console = console or Console()
    model = TopModel(schema=store.schema, clock=clock)
    if once:
        measure_db_clock(store, model)
        load_leases(store, model, resource_type)
        console.print(model.render())
        return
    # The watcher first: every change committed after the listing's read, or
    # during it, is delivered (an event the listing already shows is skipped
    # by its revision).
    with store.watch(after="now", types=resource_type) as watcher:
        measure_db_clock(store, model)
        load_leases(store, model, resource_type)
        period = 1.0 / fps
        with (
            warnings_to(model),
            _Keys() as keys,
            Live(console=console, screen=True, auto_refresh=False, redirect_stderr=False) as live,
        ):
            next_frame = 0.0
            measured = time.monotonic()
            while True:
                wait = max(0.0, next_frame - time.monotonic())
                for event in watcher.get_batch(timeout=min(wait, period)):
                    model.apply(event)
                if any(key in "qQ" for key in keys.pressed()):
                    return
                if time.monotonic() < next_frame:
                    continue
                if time.monotonic() - measured >= CLOCK_REMEASURE:
                    # The host clock may have been stepped or slewed (NTP) since.
                    measured = time.monotonic()
                    _quietly(model, lambda: measure_db_clock(store, model))
                _quietly(model, lambda: _recheck(store, model))
                model.set_health(watcher.health)
                live.update(model.render(console.size.height), refresh=True)
                next_frame = time.monotonic() + period


def _recheck(store: PostgresStore, model: TopModel) -> bool:
    """Re-read the leases past their known expiry (a heartbeat may have extended
    them); whether there was any."""
    due = model.due_rechecks()
    for rid in due:
        model.apply_state(store.get(rid))
    return bool(due)


def _quietly(model: TopModel, read: Callable[[], object]) -> None:
    """Run one of the view's own reads (`read` returns False when it had nothing
    to read); a lost server is shown on screen until a read succeeds (it is
    tried again later): the watcher's retry window decides when the view gives up."""
    try:
        did_read = read() is not False
    except DatabaseUnavailableError as exc:
        model.read_error = str(exc)
    else:
        if did_read:
            model.read_error = None
