"""The `pglease` command line: scriptable (``--json``), with meaningful exit codes.

Exit codes: 0 success, 1 error, 2 usage or bad input, 3 held by another
owner, 4 lease no longer current or revision stale.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from datetime import datetime

import psycopg
import psycopg.errors

from .cli_support import (
    EXIT_ERROR,
    EXIT_HELD,
    EXIT_NOT_CURRENT,
    EXIT_OK,
    EXIT_USAGE,
    connect_direct,
    dsn_source,
    fail,
    note_embedded,
    open_store,
    owner_arg,
    print_json,
    read_token,
    resolve_connection,
)
from .dsn import redact_text
from .errors import (
    LeaseLostError,
    PgleaseError,
    StaleResourceError,
    UnknownResourceError,
    ValidationError,
)
from .fleet import cli as fleet_cli
from .ids import resource_id
from .postgres import PostgresStore
from .sessions import cli as sessions_cli
from .types import Claim, Event, ResourceState
from .validation import check_optional_revision, check_ttl
from .watch import cli as watch_cli


def _time_left(expires_at: datetime | None, now: datetime) -> str:
    if expires_at is None:
        return "-"
    left = (expires_at - now).total_seconds()
    return f"{left:.1f}s" if left > 0 else "expired"


def _db_now(store: PostgresStore) -> datetime:
    with store.connection() as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def _claim_view(claim: Claim) -> dict[str, object]:
    return {
        "resource_id": claim.resource_id,
        "owner": str(claim.owner),
        "token": claim.token,
        "generation": claim.generation,
        "revision": claim.revision,
        "expires_at": claim.expires_at.isoformat(),
    }


def _print_claim(args: argparse.Namespace, claim: Claim) -> None:
    if args.json:
        print_json({**_claim_view(claim), "dsn_source": dsn_source(args)})
    else:
        for key, value in _claim_view(claim).items():
            print(f"{key}: {value}")


def _existing(store: PostgresStore, args: argparse.Namespace) -> ResourceState:
    """The resource named on the command line; never created (reading must not write)."""
    try:
        return store.get(resource_id(args.type, args.key))
    except UnknownResourceError:
        raise UnknownResourceError(
            f"unknown resource {args.type}/{args.key} (nothing was ever claimed there)"
        ) from None


def _current_claim(store: PostgresStore, args: argparse.Namespace) -> Claim:
    """Rebuild a claim from the command line; the token is what proves ownership."""
    state = _existing(store, args)
    rid = state.id
    generation = args.generation if args.generation is not None else state.lease.generation
    expires = state.lease.expires_at or state.updated_at
    return Claim(rid, args.owner, args.token, generation, expires, state.revision)


def cmd_migrate(args: argparse.Namespace) -> int:
    # migrate is the explicit form of auto-migration: --no-migrate does not apply.
    note_embedded(args)
    from .migrations import grant, migrate, revoke
    from .roles import RoleKind

    # A direct connection: a store refuses to open a schema with pending work.
    with connect_direct(args) as conn:
        applied = [m.label for m in migrate(conn, args.schema)]
        grants: list[tuple[str, RoleKind]] = [(r, "client") for r in args.grant_client or []]
        grants += [(r, "reader") for r in args.grant_reader or []]
        for role, kind in grants:
            grant(conn, args.schema, role, kind)
        for role in args.revoke or []:
            revoke(conn, args.schema, role)
    if args.json:
        print_json(
            {
                "schema": args.schema,
                "applied": applied,
                "granted": [{"role": r, "kind": k} for r, k in grants],
                "revoked": args.revoke or [],
                "dsn_source": dsn_source(args),
            }
        )
    else:
        print(
            f"schema {args.schema}: "
            + (f"applied {', '.join(applied)}" if applied else "up to date")
        )
        for role, kind in grants:
            print(f"granted {kind} to {role}")
        for role in args.revoke or []:
            print(f"revoked every pglease privilege from {role}")
    return EXIT_OK


def cmd_claim(args: argparse.Namespace) -> int:
    # Everything that can refuse the claim is checked before ensure_resource,
    # so a refused claim leaves no resource row behind.
    resource_id(args.type, args.key)
    check_ttl(args.ttl)
    check_optional_revision(args.expected_revision)
    with open_store(args) as store:
        rid = store.ensure_resource(args.type, args.key)
        claim = store.claim(rid, args.owner, args.ttl, args.expected_revision)
        if claim is None:
            state = store.get(rid)
            holder = state.lease
            if args.json:
                print_json(
                    {
                        "claimed": False,
                        "resource_id": rid,
                        "holder": holder.owner,
                        "generation": holder.generation,
                        "expires_at": holder.expires_at,
                        "dsn_source": dsn_source(args),
                    }
                )
            print(
                f"pglease: {args.type}/{args.key} is held by {holder.owner} (generation "
                f"{holder.generation}) until {holder.expires_at}",
                file=sys.stderr,
            )
            return EXIT_HELD
        _print_claim(args, claim)
    return EXIT_OK


def cmd_renew(args: argparse.Namespace) -> int:
    check_ttl(args.ttl)
    with open_store(args) as store:
        claim = store.renew(_current_claim(store, args), args.ttl, args.expected_revision)
        _print_claim(args, claim)
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        revision = store.release(_current_claim(store, args), args.expected_revision)
    if args.json:
        print_json({"released": True, "revision": revision, "dsn_source": dsn_source(args)})
    else:
        print(f"released; revision {revision}")
    return EXIT_OK


def _resource_row(state: ResourceState, now: datetime) -> dict[str, object]:
    lease = state.lease
    return {
        "id": state.id,
        "type": state.type,
        "key": state.key,
        "revision": state.revision,
        "holder": str(lease.owner) if lease.owner and lease.held else None,
        "generation": lease.generation,
        "expires_at": lease.expires_at.isoformat() if lease.expires_at else None,
        "time_left": _time_left(lease.expires_at, now) if lease.held else None,
    }


def cmd_ls(args: argparse.Namespace) -> int:
    with open_store(args, read_only=True) as store:
        now = _db_now(store)
        rows = [_resource_row(s, now) for s in store.list_resources(args.type)]
    if args.json:
        print_json(rows)
        return EXIT_OK
    print(f"{'TYPE':<14} {'KEY':<32} {'REV':>6} {'GEN':>5} {'HOLDER':<28} TIME LEFT")
    for r in rows:
        print(
            f"{r['type']!s:<14} {r['key']!s:<32} {r['revision']!s:>6} {r['generation']!s:>5}"
            f" {r['holder'] or '-'!s:<28} {r['time_left'] or '-'}"
        )
    return EXIT_OK


def _event_line(e: Event) -> str:
    actor = str(e.actor) if e.actor else "-"
    generation = "-" if e.lease_generation is None else str(e.lease_generation)
    payload = "" if e.payload is None else f" {e.payload}"
    return (
        f"{e.revision:>6} {e.created_at.isoformat()} {e.type:<16} {actor:<24} "
        f"gen {generation}{payload}"
    )


def cmd_events(args: argparse.Namespace) -> int:
    with open_store(args, read_only=True) as store:
        rid = _existing(store, args).id
        events: list[Event] = []
        while page := store.events(rid, events[-1].revision if events else args.after_revision):
            events.extend(page)
    for e in events:
        if args.json:
            print_json(e)
        else:
            print(_event_line(e))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.fleet import print_report, report_json, run_demo

    note_embedded(args)
    dsn = args.dsn
    out = sys.stderr if args.json else sys.stdout
    # The demo gets a schema of its own, recreated on every run.
    report = run_demo(
        dsn,
        schema=f"{args.schema}_demo",
        hosts=args.hosts,
        resources=args.resources,
        seconds=args.seconds,
        ttl=args.ttl,
        out=out,
    )
    if args.json:
        print_json(report_json(report))
    else:
        print_report(report)
    return EXIT_OK if report.ok else EXIT_ERROR


def _lease_args(parser: argparse.ArgumentParser, *, ttl: bool, token: bool) -> None:
    parser.add_argument("type", help="resource type, e.g. run")
    parser.add_argument("key", help="resource key")
    parser.add_argument("--owner", type=owner_arg, required=True, help="OWNER_TYPE:OWNER_ID")
    if ttl:
        parser.add_argument("--ttl", type=float, required=True, help="lease length in seconds")
    if token:
        # Not required here: the token may come from --token-file or $PGLEASE_TOKEN.
        source = parser.add_mutually_exclusive_group()
        source.add_argument(
            "--token", help="the token printed by claim (visible to `ps`: prefer --token-file)"
        )
        source.add_argument(
            "--token-file",
            metavar="FILE",
            help="read the token from FILE ('-' for stdin); default $PGLEASE_TOKEN",
        )
        parser.add_argument(
            "--generation",
            type=int,
            help="the claim's generation (default: the current one; the token still has to match)",
        )
    parser.add_argument("--expected-revision", type=int, help="refuse unless at this revision")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pglease", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dsn",
        help="PostgreSQL DSN (default: $PGLEASE_DSN, else libpq's PGHOST, PGSERVICE, ...,"
        " else the embedded server)",
    )
    parser.add_argument(
        "--schema",
        default=os.environ.get("PGLEASE_SCHEMA", "pglease"),
        help="schema holding pglease's tables (default: pglease)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--no-migrate",
        action="store_true",
        help="never apply migrations implicitly (read-only commands never do)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "migrate",
        help="apply pending schema migrations (as the schema's owner); grant pglease roles",
    )
    p.add_argument(
        "--grant-client",
        action="append",
        metavar="ROLE",
        help="let ROLE claim, renew, release, mutate and watch (repeatable)",
    )
    p.add_argument(
        "--grant-reader",
        action="append",
        metavar="ROLE",
        help="let ROLE read resources, events and sessions, and watch (repeatable)",
    )
    p.add_argument(
        "--revoke", action="append", metavar="ROLE", help="take every pglease privilege from ROLE"
    )
    p.set_defaults(func=cmd_migrate)
    p = sub.add_parser("claim", help="claim a lease (exit 3 when held by another owner)")
    _lease_args(p, ttl=True, token=False)
    p.set_defaults(func=cmd_claim)
    p = sub.add_parser("renew", help="renew a lease (exit 4 when no longer current)")
    _lease_args(p, ttl=True, token=True)
    p.set_defaults(func=cmd_renew)
    p = sub.add_parser("release", help="release a lease (exit 4 when no longer current)")
    _lease_args(p, ttl=False, token=True)
    p.set_defaults(func=cmd_release)
    p = sub.add_parser("ls", help="list resources with revision, holder and time left")
    p.add_argument("--type", help="only this resource type")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("events", help="a resource's event history")
    p.add_argument("type")
    p.add_argument("key")
    p.add_argument("--after-revision", type=int, default=0)
    p.set_defaults(func=cmd_events)
    p = sub.add_parser("demo", help="run a small fleet on the embedded PostgreSQL and check it")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--resources", type=int, default=3)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--ttl", type=float, default=1.0)
    p.set_defaults(func=cmd_demo)
    fleet_cli.register(sub)
    watch_cli.register(sub)
    sessions_cli.register(sub)
    for command in sub.choices.values():
        # Accept --json after the subcommand too: `pglease ls --json`.
        command.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


#: Exit code after a closed stdout (`pglease ls | head -1`): 128 + SIGPIPE, as
#: the shell reports a command killed by the signal.
EXIT_BROKEN_PIPE = 141

#: What a read-only command meets on a schema that was never migrated.
_UNMIGRATED = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.InvalidSchemaName,
)


def _run(args: argparse.Namespace) -> int:
    def failed(message: str, code: int) -> int:
        return fail(redact_text(message, args.dsn), code)

    try:
        if hasattr(args, "token_file"):
            args.token = read_token(args.token, args.token_file)
        resolve_connection(args)
        code: int = args.func(args)
        sys.stdout.flush()  # inside the try: a closed pipe must fail here, not at exit
    except (LeaseLostError, StaleResourceError) as exc:
        return failed(str(exc), EXIT_NOT_CURRENT)
    except (ValidationError, UnknownResourceError) as exc:
        return failed(str(exc), EXIT_USAGE)
    except PgleaseError as exc:
        return failed(str(exc), EXIT_ERROR)
    except _UNMIGRATED as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return failed(
            f"database error: {first} (is schema {args.schema} migrated? run `pglease migrate`)",
            EXIT_ERROR,
        )
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return failed(f"database error: {first}", EXIT_ERROR)
    except KeyboardInterrupt:
        return 130
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code. Never ends in a traceback for
    expected faults (bad input, database errors, a closed stdout, Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        # The reader went away (`| head`). Point stdout at /dev/null so the
        # interpreter's final flush cannot raise again (Python docs, "Note on SIGPIPE").
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
