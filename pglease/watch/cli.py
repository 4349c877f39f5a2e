"""CLI subcommands: ``watch``, ``prune`` and ``reap`` (registered by `pglease.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading

from ..cli_support import EXIT_OK, EXIT_USAGE, fail, open_store, print_json, sigterm_as_interrupt
from ..errors import CursorExpiredError, PgleaseError, ValidationError
from ..types import Event, Owner
from .prune import parse_duration, prune
from .reaper import Reaper, reap_once
from .watcher import Watcher

#: Exit code when the cursor is older than the prune horizon.
EXIT_CURSOR_EXPIRED = 5


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``watch``, ``prune`` and ``reap`` subcommands."""
    # "resolve": the main parser may add its own --json to every subcommand.
    p = subparsers.add_parser(
        "watch",
        conflict_handler="resolve",
        help="print events live, one per line",
        description="Print committed events as they happen, one per line. On Ctrl-C,"
        " print the last cursor to stderr and exit 0; pass it to --after to continue.",
    )
    p.add_argument(
        "--type",
        dest="types",
        action="append",
        metavar="T",
        help="only resources of this type (repeatable)",
    )
    p.add_argument(
        "--resource",
        dest="resources",
        action="append",
        metavar="ID",
        help="only this resource id (repeatable)",
    )
    p.add_argument(
        "--event-type",
        dest="event_types",
        action="append",
        metavar="E",
        help="only this event type, e.g. lease.expired (repeatable)",
    )
    p.add_argument(
        "--after", default="now", metavar="CURSOR", help="a cursor, 'now' (default) or 'start'"
    )
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="one JSON object per line"
    )
    p.add_argument(
        "--poll",
        action="store_true",
        help="poll instead of LISTEN (for PgBouncer transaction pooling)",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="exit after N events")
    p.set_defaults(func=cmd_watch)

    p = subparsers.add_parser(
        "prune",
        conflict_handler="resolve",
        help="delete old events and unreferenced payloads",
        description="Delete events older than DURATION (90s, 15m, 12h,"
        " 7d, 1h30m), then the payloads no remaining event references."
        " Watchers behind the deleted range get CursorExpiredError.",
    )
    p.add_argument("--older-than", required=True, type=_duration, metavar="DURATION")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    p.set_defaults(func=cmd_prune)

    p = subparsers.add_parser(
        "reap",
        help="write lease.expired events for expired leases",
        description="Run the expiry reaper (one per fleet is elected"
        " through a pglease lease), or one pass with --once.",
    )
    p.add_argument("--once", action="store_true", help="one pass, no election")
    p.add_argument(
        "--owner",
        default=None,
        metavar="TYPE:ID",
        help="reaper lease owner (default host:<hostname>-<pid>)",
    )
    p.add_argument("--interval", type=float, default=0.5, metavar="SECONDS")
    p.set_defaults(func=cmd_reap)  # fmt: skip


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_event(event: Event) -> str:
    actor = str(event.actor) if event.actor else "-"
    gen = event.lease_generation if event.lease_generation is not None else "-"
    return (
        f"{event.cursor} {event.type} {event.resource_type}/{event.resource_key}"
        f" rev={event.revision} gen={gen} actor={actor}"
    )


def cmd_watch(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        return fail("--limit must be at least 1", EXIT_USAGE)
    # SIGTERM (kill, systemd, docker stop) ends the watch like Ctrl-C: with the cursor.
    with sigterm_as_interrupt():
        return _watch(args)


def _watch(args: argparse.Namespace) -> int:
    as_json = bool(getattr(args, "json", False))
    watcher: Watcher | None = None
    try:
        with open_store(args, read_only=True) as store:
            watcher = Watcher(
                store, after=args.after, types=args.types, resources=args.resources,
                event_types=args.event_types, mode="poll" if args.poll else "listen",
            )  # fmt: skip
            count = 0
            try:
                for event in watcher:
                    if as_json:
                        print_json(event)
                    else:
                        print(format_event(event), flush=True)
                    count += 1
                    if args.limit is not None and count >= args.limit:
                        break
            except KeyboardInterrupt:
                pass
            print(f"cursor: {watcher.cursor}", file=sys.stderr, flush=True)
            watcher.close()
    except KeyboardInterrupt:
        # Interrupted while connecting: there is no cursor to report.
        if watcher is not None:
            print(f"cursor: {watcher.cursor}", file=sys.stderr, flush=True)
        return EXIT_OK
    except CursorExpiredError as exc:
        return fail(str(exc), EXIT_CURSOR_EXPIRED)
    except ValidationError as exc:
        return fail(str(exc), EXIT_USAGE)
    except PgleaseError as exc:
        return fail(str(exc))
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    try:
        with open_store(args) as store:
            deleted = prune(store, args.older_than)
    except PgleaseError as exc:
        return fail(str(exc))
    if getattr(args, "json", False):
        # "deleted" stays the number of events, as before payloads were collected.
        print_json({"deleted": deleted.events, "payloads_deleted": deleted.payloads})
    elif deleted.payloads:
        print(f"deleted {deleted.events} events and {deleted.payloads} unreferenced payloads")
    else:
        print(f"deleted {deleted.events} events")
    return EXIT_OK


def cmd_reap(args: argparse.Namespace) -> int:
    import os
    import socket

    try:
        owner = Owner.parse(args.owner or f"host:{socket.gethostname()}-{os.getpid()}")
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        with open_store(args) as store:
            if args.once:
                print(f"reaped {reap_once(store)} leases")
                return EXIT_OK
            stop = threading.Event()
            reaper = Reaper(store, owner, interval=args.interval)
            # SIGTERM stops it like Ctrl-C: the election lease is released on the way out.
            with sigterm_as_interrupt(), reaper, contextlib.suppress(KeyboardInterrupt):
                stop.wait()
            print(f"reaped {reaper.reaped} leases", file=sys.stderr)
    except PgleaseError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK
