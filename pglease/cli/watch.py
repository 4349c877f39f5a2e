"""CLI subcommands: ``watch``, ``prune`` and ``reap`` (registered by `pglease.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from .._watch_common import (
    DEFAULT_RETRY_WINDOW,
    DEFAULT_STALL_TIMEOUT,
    check_retry_window,
    check_stall_timeout,
)
from ..durations import duration_arg
from ..errors import CursorExpiredError, ForeignCursorError, PgleaseError, ValidationError
from ..types import Event, Owner
from ..watch._core import check_interval
from ..watch.prune import DEFAULT_CHUNK, check_chunk, prune
from ..watch.reaper import Reaper, reap_once
from ..watch.watcher import Watcher
from .support import (
    EXIT_OK,
    EXIT_USAGE,
    error_code,
    fail,
    open_store,
    print_json,
    sigterm_as_interrupt,
)

#: Exit code when the cursor cannot be resumed from in this log: older than the
#: prune horizon, or not a position in it (ahead of its end, another history).
#: A well-formed cursor that names a state the log no longer (or never) had is a
#: resync, not a usage error; a malformed cursor is bad input (2).
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
    p.add_argument(
        "--stall-timeout",
        type=duration_arg("--stall-timeout", _stall_timeout),
        default=DEFAULT_STALL_TIMEOUT,
        metavar="DURATION",
        help=f"a read unanswered this long counts as a failure and its connection is"
        f" replaced (default {DEFAULT_STALL_TIMEOUT:g}s, at most 1h)",
    )
    p.add_argument(
        "--retry-window",
        type=duration_arg("--retry-window", _retry_window),
        default=DEFAULT_RETRY_WINDOW,
        metavar="DURATION",
        help=f"exit with an error when reads keep failing this long"
        f" (default {DEFAULT_RETRY_WINDOW:g}s)",
    )
    p.set_defaults(func=cmd_watch)

    p = subparsers.add_parser(
        "prune",
        conflict_handler="resolve",
        help="delete old events and unreferenced payloads",
        description="Delete events older than DURATION (90s, 15m, 12h,"
        " 7d, 1h30m), then the payloads no remaining event references."
        " Watchers behind the deleted range get CursorExpiredError. A DURATION"
        " below the floor (1d, or the longest TTL of a held lease if longer) needs --force.",
    )
    p.add_argument(
        "--older-than", required=True, type=duration_arg("--older-than"), metavar="DURATION"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="count what would be deleted (read-only); delete nothing",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="prune even below the floor: 1d, or the longest TTL of a held lease if longer",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK,
        metavar="N",
        help=f"events per transaction (default {DEFAULT_CHUNK}); each chunk holds watchers"
        " back only while it runs",
    )
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    p.set_defaults(func=cmd_prune)

    p = subparsers.add_parser(
        "reap",
        conflict_handler="resolve",
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
    p.add_argument(
        "--interval",
        type=duration_arg("--interval", lambda s: check_interval(s, "--interval")),
        default=0.5,
        metavar="DURATION",
    )
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    p.set_defaults(func=cmd_reap)  # fmt: skip


def format_event(event: Event) -> str:
    actor = str(event.actor) if event.actor else "-"
    gen = event.lease_generation if event.lease_generation is not None else "-"
    return (
        f"{event.cursor} {event.type} {event.resource_type}/{event.resource_key}"
        f" rev={event.revision} gen={gen} actor={actor}"
    )


def _stall_timeout(seconds: float) -> float:
    """--stall-timeout as the watcher checks it, worded as a usage error."""
    try:
        return check_stall_timeout(seconds)
    except ValidationError as exc:
        raise ValueError(str(exc).replace("stall_timeout", "--stall-timeout")) from None


def _retry_window(seconds: float) -> float:
    """--retry-window as the watcher checks it, worded as a usage error."""
    try:
        return check_retry_window(seconds)
    except ValidationError as exc:
        raise ValueError(str(exc).replace("retry_window", "--retry-window")) from None


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
                event_types=args.event_types, mode="poll" if args.poll else None,
                stall_timeout=args.stall_timeout, retry_window=args.retry_window,
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
    except (CursorExpiredError, ForeignCursorError) as exc:
        return fail(str(exc), EXIT_CURSOR_EXPIRED)
    except ValidationError as exc:
        return fail(str(exc), EXIT_USAGE)
    except PgleaseError as exc:
        return fail(str(exc), error_code(exc))
    return EXIT_OK


#: The shortest age `pglease prune` deletes without --force: the log is the
#: fleet's audit trail and every watcher's resume point, and an age of minutes
#: is more often a slip (1m for 1h, 0s) than a plan.
PRUNE_FLOOR_SECONDS = 86400.0


def _short(seconds: float) -> str:
    """86400 -> 1d, 600 -> 10m, 1.5 -> 1.5s."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def prune_floor(longest_ttl: float | None) -> tuple[float, str]:
    """The floor below which prune needs --force, and what sets it."""
    if longest_ttl is not None and longest_ttl > PRUNE_FLOOR_SECONDS:
        return longest_ttl, f"the longest TTL in use, {longest_ttl:g}s, a held lease"
    return PRUNE_FLOOR_SECONDS, "the minimum retention"


def _below_floor(older_than: float, longest_ttl: float | None) -> str | None:
    """Why prune refuses `older_than` without --force (None: it does not)."""
    floor, why = prune_floor(longest_ttl)
    if older_than >= floor:
        return None
    return f"--older-than {_short(older_than)} is below the floor of {_short(floor)} ({why})"


def _longest_ttl(conn: psycopg.Connection[Any], schema: str) -> float | None:
    """The longest lease length among live leases (from the last renewal), in seconds."""
    row = conn.execute(
        sql.SQL(
            "SELECT extract(epoch FROM max(expires_at - coalesce(heartbeat_at, acquired_at)))"
            " FROM {}.leases WHERE owner_id IS NOT NULL AND expires_at > clock_timestamp()"
        ).format(sql.Identifier(schema))
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _would_prune(
    conn: psycopg.Connection[Any], schema: str, older_than: float
) -> tuple[int, datetime | None, datetime | None]:
    """What prune_log would delete now, read without deleting: the prefix of the log
    (in read order) below the readable frontier and before the first event that is
    either newer than the cutoff or not yet readable (sql/0007_expiry_gc.sql)."""
    row = conn.execute(
        sql.SQL(
            "WITH k AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin,"
            "   clock_timestamp() - make_interval(secs => %s) AS cutoff),"
            " keep AS (SELECT e.xid, e.id FROM {s}.events e, k"
            "   WHERE e.created_at >= k.cutoff OR e.xid >= k.xmin ORDER BY e.xid, e.id LIMIT 1)"
            " SELECT count(e.id), min(e.created_at), max(e.created_at)"
            " FROM k LEFT JOIN keep ON true JOIN {s}.events e ON e.xid < k.xmin"
            "   AND (keep.xid IS NULL OR (e.xid, e.id) < (keep.xid, keep.id))"
        ).format(s=sql.Identifier(schema)),
        [older_than],
    ).fetchone()
    assert row is not None
    return int(row[0]), row[1], row[2]


def cmd_prune(args: argparse.Namespace) -> int:
    as_json = bool(getattr(args, "json", False))
    try:
        check_chunk(args.chunk)
    except ValidationError as exc:
        return fail(f"--chunk: {exc}", EXIT_USAGE)
    try:
        # A dry run only reads: it never migrates, like every read-only command.
        with open_store(args, read_only=args.dry_run) as store:
            with store.connection() as conn:
                longest = _longest_ttl(conn, store.schema)
                would = _would_prune(conn, store.schema, args.older_than) if args.dry_run else None
            refusal = _below_floor(args.older_than, longest)
            if would is not None:
                return _print_dry_run(args, would, longest, refusal, as_json)
            if refusal is not None and not args.force:
                # Checked before anything is deleted: nothing was.
                return fail(f"{refusal}; pass --force to prune anyway", EXIT_USAGE)
            deleted = prune(store, args.older_than, chunk=args.chunk)
    except ValidationError as exc:
        return fail(str(exc), EXIT_USAGE)
    except PgleaseError as exc:
        return fail(str(exc), error_code(exc))
    if as_json:
        # "deleted" stays the number of events, as before payloads were collected.
        print_json({"deleted": deleted.events, "payloads_deleted": deleted.payloads})
    elif deleted.payloads:
        print(f"deleted {deleted.events} events and {deleted.payloads} unreferenced payloads")
    else:
        print(f"deleted {deleted.events} events")
    return EXIT_OK


def _print_dry_run(
    args: argparse.Namespace,
    would: tuple[int, datetime | None, datetime | None],
    longest: float | None,
    refusal: str | None,
    as_json: bool,
) -> int:
    count, oldest, newest = would
    if as_json:
        print_json(
            {
                "dry_run": True,
                "would_delete": count,
                "oldest": oldest,
                "newest": newest,
                "older_than_seconds": args.older_than,
                "longest_ttl_seconds": longest,
                "floor_seconds": prune_floor(longest)[0],
                "needs_force": refusal is not None,
            }
        )
    else:
        span = ""
        if oldest is not None and newest is not None:
            span = f" (created {oldest.isoformat()} to {newest.isoformat()})"
        print(f"would delete {count} events{span}; nothing deleted (dry run)")
    if refusal is not None:
        print(f"pglease: note: without --force, prune would refuse: {refusal}", file=sys.stderr)
    return EXIT_OK


def cmd_reap(args: argparse.Namespace) -> int:
    import os
    import socket

    try:
        owner = Owner.parse(args.owner or f"host:{socket.gethostname()}-{os.getpid()}")
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    as_json = bool(getattr(args, "json", False))
    try:
        with open_store(args) as store:
            if args.once:
                reaped = reap_once(store)
                if as_json:
                    print_json({"reaped": reaped})
                else:
                    print(f"reaped {reaped} leases")
                return EXIT_OK
            stop = threading.Event()
            reaper = Reaper(store, owner, interval=args.interval)
            # SIGTERM stops it like Ctrl-C: the election lease is released on the way out.
            with sigterm_as_interrupt(), reaper, contextlib.suppress(KeyboardInterrupt):
                stop.wait()
            if as_json:
                # The summary goes to stdout here: it is the command's one result.
                print_json({"reaped": reaper.reaped})
            else:
                print(f"reaped {reaper.reaped} leases", file=sys.stderr)
    except ValidationError as exc:  # a --schema migrate never set up, say
        return fail(str(exc), EXIT_USAGE)
    except PgleaseError as exc:
        return fail(str(exc), error_code(exc))
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK
