"""The `pglease` command line: scriptable (``--json``), with meaningful exit codes.

Exit codes: 0 success, 1 error, 2 usage or bad input, 3 held by another
owner, 4 lease no longer current or revision stale.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql

from .. import __version__, doctor
from ..dsn import redact_dsn, redact_text
from ..durations import duration_arg
from ..errors import (
    LeaseLostError,
    MigrationError,
    PgleaseError,
    StaleResourceError,
    UnknownResourceError,
    ValidationError,
)
from ..ids import resource_id
from ..listing import Listed, fetch_resource, iter_resources
from ..payloads import RawPayload
from ..postgres import PostgresStore
from ..types import Claim, Event, ResourceState
from ..validation import check_optional_revision, check_ttl
from ..watch._core import channel_name
from . import elect as elect_cli
from . import embedded as embedded_cli
from . import hold as fleet_cli
from . import sessions as sessions_cli
from . import top as top_cli
from . import watch as watch_cli
from .support import (
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
    to_jsonable,
)


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
    from ..migrations import grant, migrate, revoke
    from ..roles import RoleKind

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


#: Rows per keyset page of `ls`: the first line appears after one page's read.
LS_PAGE_SIZE = 1000


def cmd_ls(args: argparse.Namespace) -> int:
    if args.free and (args.owner is not None or args.expiring_within is not None):
        return fail("--free cannot be combined with --owner or --expiring-within", EXIT_USAGE)
    held = True if args.held else False if args.free else None
    with open_store(args, read_only=True) as store:
        listed = iter_resources(
            store, args.schema, resource_type=args.type, held=held, owner=args.owner,
            expiring_within=args.expiring_within, page_size=args.page_size, limit=args.limit,
        )  # fmt: skip
        if args.json:
            _ls_json(listed, args.page_size)
        else:
            _ls_table(listed, args.page_size)
    return EXIT_OK


def _ls_json(listed: Iterator[Listed], page_size: int) -> None:
    # One JSON array, as before paging, written row by row: memory stays one
    # page however long the list, and the output still parses as a whole.
    out = sys.stdout
    out.write("[")
    for n, item in enumerate(listed):
        row = to_jsonable(_resource_row(item.state, item.now))
        out.write(("" if n == 0 else ",\n") + json.dumps(row, sort_keys=True))
        if (n + 1) % page_size == 0:
            out.flush()  # a page is out before the next one is read
    out.write("]\n")
    out.flush()


def _ls_table(listed: Iterator[Listed], page_size: int) -> None:
    print(f"{'TYPE':<14} {'KEY':<32} {'REV':>6} {'GEN':>5} {'HOLDER':<28} TIME LEFT", flush=True)
    for n, item in enumerate(listed, 1):
        r = _resource_row(item.state, item.now)
        print(
            f"{r['type']!s:<14} {r['key']!s:<32} {r['revision']!s:>6} {r['generation']!s:>5}"
            f" {r['holder'] or '-'!s:<28} {r['time_left'] or '-'}"
        )
        if n % page_size == 0:
            sys.stdout.flush()  # a page is out before the next one is read


def _payload_text(payload: object) -> str:
    """A payload as JSON text (canonical: sorted keys, no spaces), never a Python repr."""
    if isinstance(payload, RawPayload):
        return payload.text  # the stored JSON exactly; it could not be decoded
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _event_view(e: Event) -> dict[str, object]:
    return {
        "type": e.type,
        "revision": e.revision,
        "created_at": e.created_at.isoformat(),
        "actor": str(e.actor) if e.actor else None,
        "generation": e.lease_generation,
        "payload": e.payload,
    }


def cmd_get(args: argparse.Namespace) -> int:
    rid = resource_id(args.type, args.key)  # computed, never created: reading must not write
    with open_store(args, read_only=True) as store, store.connection() as conn:
        found = fetch_resource(conn, args.schema, rid)
    if found is None:
        raise UnknownResourceError(
            f"unknown resource {args.type}/{args.key} (nothing was ever claimed there)"
        )
    item, last = found
    state, lease = item.state, item.state.lease
    view: dict[str, object] = {
        "id": state.id,
        "type": state.type,
        "key": state.key,
        "revision": state.revision,
        "created_at": state.created_at.isoformat(),
        "updated_at": state.updated_at.isoformat(),
        "db_now": item.now.isoformat(),
        "lease": {
            "held": lease.held,
            "holder": str(lease.owner) if lease.owner and lease.held else None,
            "generation": lease.generation,
            "acquired_at": lease.acquired_at.isoformat()
            if lease.held and lease.acquired_at
            else None,
            "heartbeat_at": lease.heartbeat_at.isoformat() if lease.heartbeat_at else None,
            "expires_at": lease.expires_at.isoformat() if lease.expires_at else None,
            "seconds_left": item.seconds_left,
        },
        "last_event": _event_view(last) if last is not None else None,
    }
    if args.json:
        print_json(view)
        return EXIT_OK
    print(f"resource:   {state.type}/{state.key} ({state.id})")
    print(f"revision:   {state.revision} (updated {state.updated_at.isoformat()})")
    if lease.held and lease.owner is not None:
        print(
            f"lease:      held by {lease.owner}, generation {lease.generation},"
            f" expires {_iso(lease.expires_at)}"
            f" ({item.seconds_left:.1f}s left by the database clock)"
        )
    else:
        expired = f", expired {_iso(lease.expires_at)}" if lease.expires_at else ""
        print(f"lease:      free, generation {lease.generation}{expired}")
    if last is None:
        print("last event: - (none in the log)")
    else:
        payload = "" if last.payload is None else f" payload {_payload_text(last.payload)}"
        actor = f" by {last.actor}" if last.actor else ""
        print(
            f"last event: {last.type} at revision {last.revision},"
            f" {last.created_at.isoformat()}{actor}{payload}"
        )
    return EXIT_OK


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value is not None else "-"


def _event_line(e: Event) -> str:
    actor = str(e.actor) if e.actor else "-"
    generation = "-" if e.lease_generation is None else str(e.lease_generation)
    payload = "" if e.payload is None else f" {_payload_text(e.payload)}"
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


def _hub_sessions(conn: psycopg.Connection[Any], schema: str) -> dict[str, object]:
    """Watcher hub connections of `schema` that pg_stat_activity shows this role.

    pglease sets no application_name, so a hub is recognised by its last
    statement: its LISTEN on the schema's channel, or the schema's
    watch_read (what a listening hub runs after every wake-up, and all a
    polling hub runs). Sessions of other roles show no query text unless this
    role may read all statistics; they are counted as hidden, not guessed at.
    """
    listen = sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(schema))).as_string(conn)
    read = sql.SQL("{}.watch_read(").format(sql.Identifier(schema)).as_string(conn)
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE strpos(query, %s) > 0 OR strpos(query, %s) > 0),"
        " count(*) FILTER (WHERE query IS NULL OR query = '<insufficient privilege>')"
        " FROM pg_catalog.pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        [listen, read],
    ).fetchone()
    assert row is not None
    return {"count": int(row[0]), "hidden_sessions": int(row[1]), "complete": row[1] == 0}


def _optional(conn: psycopg.Connection[Any], query: sql.Composed, args: list[Any]) -> Any:
    """The first row of `query`, or None where a schema behind on migrations lacks the table."""
    try:
        return conn.execute(query, args).fetchone()
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
        return None


def _status(conn: psycopg.Connection[Any], schema: str, within: float) -> dict[str, Any]:
    from ..migrations import migration_state

    state = migration_state(conn, schema)
    if not state.schema_exists:
        raise MigrationError(
            f"schema {schema!r} does not exist; run `pglease --schema {schema} migrate`"
            " as the schema's owner"
        )
    s = sql.Identifier(schema)
    version, now = conn.execute(
        "SELECT current_setting('server_version'), clock_timestamp()"
    ).fetchone() or (None, None)
    report: dict[str, Any] = {
        "schema": schema,
        "server_version": version,
        "db_now": now,
        "migrations": {
            "up_to_date": state.up_to_date,
            "pending": [] if state.up_to_date else state.describe().split(", "),
        },
        "resources": None,
        "held": None,
        "expiring": {"within_seconds": within, "count": None},
        "events": {"count": None, "oldest_at": None},
        "test_clock": None,
        "watcher_hubs": _hub_sessions(conn, schema),
    }
    counts = _optional(
        conn,
        sql.SQL(
            "SELECT (SELECT count(*) FROM {s}.resources),"
            " count(*) FILTER (WHERE l.owner_id IS NOT NULL AND l.expires_at > c.now),"
            " count(*) FILTER (WHERE l.owner_id IS NOT NULL AND l.expires_at > c.now"
            "   AND l.expires_at <= c.now + make_interval(secs => %s))"
            " FROM (SELECT clock_timestamp() AS now) c CROSS JOIN {s}.leases l"
        ).format(s=s),
        [within],
    )
    if counts is not None:
        report["resources"], report["held"] = int(counts[0]), int(counts[1])
        report["expiring"]["count"] = int(counts[2])
    events = _optional(
        conn, sql.SQL("SELECT count(*), min(created_at) FROM {s}.events").format(s=s), []
    )
    if events is not None:
        report["events"] = {"count": int(events[0]), "oldest_at": events[1]}
    clock = _optional(conn, sql.SQL("SELECT bool_or(test_clock) FROM {s}.settings").format(s=s), [])
    if clock is not None:
        report["test_clock"] = bool(clock[0])
    return report


def cmd_status(args: argparse.Namespace) -> int:
    # A direct connection, not a store: a store refuses a schema with pending
    # migrations, which is one of the things status is there to report. The
    # session is read-only, so nothing here can write even by mistake.
    with connect_direct(args) as conn:
        conn.execute("SET default_transaction_read_only = on")
        report = _status(conn, args.schema, args.within)
    if report["test_clock"]:
        print(
            f"pglease: WARNING: the test clock is ON in schema {args.schema}: callers can"
            " choose the time leases are judged by (now=); never let real hosts use it",
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        print_json({**report, "dsn_source": dsn_source(args)})
        return EXIT_OK
    migrations = report["migrations"]
    hubs = report["watcher_hubs"]
    events = report["events"]

    def shown(value: object) -> str:
        return "unavailable (schema behind on migrations)" if value is None else str(value)

    print(f"server:       PostgreSQL {report['server_version']} ({redact_dsn(args.dsn)})")
    print(f"schema:       {args.schema}")
    print(
        "migrations:   "
        + (
            "up to date"
            if migrations["up_to_date"]
            else "pending: " + ", ".join(migrations["pending"])
        )
    )
    print(f"resources:    {shown(report['resources'])}")
    print(f"held:         {shown(report['held'])}")
    print(f"expiring:     {shown(report['expiring']['count'])} within {args.within:g}s")
    oldest = events["oldest_at"]
    print(
        f"events:       {shown(events['count'])}"
        + (f" (oldest {oldest.isoformat()})" if oldest is not None else "")
    )
    clock = report["test_clock"]
    print("test clock:   " + ("ON (tests only!)" if clock else "off" if clock is False else "-"))
    if hubs["complete"]:
        print(f"watcher hubs: {hubs['count']}")
    elif hubs["count"]:
        print(
            f"watcher hubs: {hubs['count']} visible; {hubs['hidden_sessions']} sessions of"
            " other roles not visible (pg_read_all_stats shows them)"
        )
    else:
        print(
            f"watcher hubs: not visible ({hubs['hidden_sessions']} sessions of other roles;"
            " pg_read_all_stats shows them)"
        )
    return EXIT_OK


def cmd_revoke(args: argparse.Namespace) -> int:
    from ..admin import revoke_lease
    from ..migrations import migration_state

    rid = resource_id(args.type, args.key)
    note_embedded(args)
    # A direct connection: revoke_lease is the owner's, outside any store.
    with connect_direct(args) as conn:
        state = migration_state(conn, args.schema)
        if not state.up_to_date:
            raise state.not_migrated_error("revoke never migrates")
        try:
            done = revoke_lease(conn, args.schema, rid)
        except UnknownResourceError:
            raise UnknownResourceError(
                f"unknown resource {args.type}/{args.key} (nothing was ever claimed there)"
            ) from None
    if args.json:
        print_json(
            {
                "resource_id": rid,
                "type": args.type,
                "key": args.key,
                "revoked": done.revoked,
                "fenced": str(done.holder) if done.revoked and done.holder else None,
                "generation": done.generation,
                "revision": done.revision,
                "dsn_source": dsn_source(args),
            }
        )
    elif done.revoked:
        print(
            f"revoked {args.type}/{args.key}: {done.holder} is fenced (generation"
            f" {done.generation - 1} ended); generation now {done.generation},"
            f" revision {done.revision}"
        )
    else:
        print(
            f"{args.type}/{args.key} is not held: nothing revoked (generation"
            f" {done.generation}, revision {done.revision})"
        )
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.fleet import print_report, report_json, run_demo

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


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell), end="")
    return EXIT_OK


def _register_completion(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "completion",
        help="print a shell completion script (bash or zsh)",
        description="Print the completion script for SHELL. bash: pglease completion bash >"
        " ~/.pglease-completion.bash, then source that file from ~/.bashrc; zsh: pglease"
        " completion zsh > ~/.zfunc/_pglease, with ~/.zfunc on $fpath before compinit.",
    )
    p.add_argument("shell", choices=["bash", "zsh"])
    # connects=False: printing a script must not resolve a DSN or start a server.
    p.set_defaults(func=cmd_completion, connects=False)


def _lease_args(parser: argparse.ArgumentParser, *, ttl: bool, token: bool) -> None:
    parser.add_argument("type", help="resource type, e.g. run")
    parser.add_argument("key", help="resource key")
    parser.add_argument("--owner", type=owner_arg, required=True, help="OWNER_TYPE:OWNER_ID")
    if ttl:
        parser.add_argument(
            "--ttl",
            type=duration_arg("ttl", check_ttl),
            required=True,
            metavar="DURATION",
            help="lease length: 30 (seconds), 1.5s, 250ms, 5m, 1h",
        )
    if token:
        # Not required here: the token may come from --token-file or $PGLEASE_TOKEN.
        source = parser.add_mutually_exclusive_group()
        source.add_argument(
            "--token",
            help="the token printed by claim (visible to `ps`: prefer --token-file);"
            " write --token=VALUE for an older token that starts with -",
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 0 to 65535, got {value}")
    return value


def _metrics_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="N",
        help="serve Prometheus metrics at http://ADDR:N/metrics while it runs (0: a free"
        " port, printed on stderr; needs pip install 'pglease[metrics]')",
    )
    parser.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default 127.0.0.1)",
    )


def _call(args: argparse.Namespace) -> int:
    """Run the command, with a metrics endpoint around it when --metrics-port is given."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        code: int = args.func(args)
        return code
    # Imported only here: without the extra this raises MetricsUnavailableError.
    from .. import metrics

    with metrics.serve(port, args.metrics_addr) as server:
        print(f"pglease: metrics at {server.url}", file=sys.stderr, flush=True)
        code = args.func(args)
        return code


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
    parser.add_argument("--version", action="version", version=f"pglease {__version__}")
    parser.add_argument(
        "--pooler",
        action="store_true",
        default=os.environ.get("PGLEASE_POOLER", "") == "transaction",
        help="the DSN goes through a transaction-pooling PgBouncer (no prepared statements,"
        " no session state, watchers poll); also $PGLEASE_POOLER=transaction",
    )
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
    p = sub.add_parser(
        "ls",
        help="list resources with revision, holder and time left",
        description="List resources in (type, key) order, read in pages, each printed as it"
        " arrives. Held and time left are judged by the database clock.",
    )
    p.add_argument("--type", help="only this resource type")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--held", action="store_true", help="only resources with a live lease")
    which.add_argument("--free", action="store_true", help="only free or expired resources")
    p.add_argument("--owner", type=owner_arg, metavar="T:ID", help="only the live leases of T:ID")
    p.add_argument(
        "--expiring-within",
        type=duration_arg("--expiring-within"),
        metavar="DURATION",
        help="only live leases ending within DURATION (30s, 5m)",
    )
    p.add_argument("--limit", type=_positive_int, metavar="N", help="at most N resources")
    p.add_argument("--page-size", type=_positive_int, default=LS_PAGE_SIZE, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser(
        "get", help="one resource: its lease, time left, revision and last event (exit 2: unknown)"
    )
    p.add_argument("type")
    p.add_argument("key")
    p.set_defaults(func=cmd_get)
    p = sub.add_parser(
        "status",
        help="server, migrations, counts, event log, test clock and watcher hubs (read-only)",
    )
    p.add_argument(
        "--within",
        type=duration_arg("--within"),
        default=30.0,
        metavar="DURATION",
        help="count leases expiring within DURATION (default 30s)",
    )
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "revoke",
        help="end a stuck lease as the schema's owner: its holder is fenced (generation + 1)",
    )
    p.add_argument("type")
    p.add_argument("key")
    p.set_defaults(func=cmd_revoke)
    p = sub.add_parser("events", help="a resource's event history")
    p.add_argument("type")
    p.add_argument("key")
    p.add_argument("--after-revision", type=int, default=0)
    p.set_defaults(func=cmd_events)
    p = sub.add_parser("demo", help="run a small fleet on the embedded PostgreSQL and check it")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--resources", type=int, default=3)
    p.add_argument("--seconds", type=duration_arg("--seconds"), default=12.0, metavar="DURATION")
    p.add_argument("--ttl", type=duration_arg("ttl", check_ttl), default=1.0, metavar="DURATION")
    p.set_defaults(func=cmd_demo)
    fleet_cli.register(sub)
    elect_cli.register(sub)
    embedded_cli.register(sub)
    watch_cli.register(sub)
    sessions_cli.register(sub)
    doctor.register(sub)
    top_cli.register(sub)
    _register_completion(sub)
    for name in ("hold", "reap", "watch"):
        _metrics_args(sub.choices[name])
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
        if getattr(args, "connects", True):  # `embedded status` must not start a server
            resolve_connection(args)
        code = _call(args)
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
