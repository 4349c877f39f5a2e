"""CLI commands that only read: ``ls``, ``get``, ``events``, ``status``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql

from ..dsn import redact_dsn
from ..errors import (
    UnknownResourceError,
)
from ..ids import resource_id
from ..listing import Listed, fetch_resource, iter_resources
from ..payloads import RawPayload
from ..types import Event, ResourceState
from ..watch._core import channel_name
from .leases import existing_resource
from .support import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    connect_direct,
    dsn_source,
    fail,
    open_store,
    print_json,
    to_jsonable,
)


def _time_left(expires_at: datetime | None, now: datetime) -> str:
    if expires_at is None:
        return "-"
    left = (expires_at - now).total_seconds()
    return f"{left:.1f}s" if left > 0 else "expired"


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
        # Free but not claimable yet: a revoked holder's last granted expiry.
        "claimable_at": lease.claimable_at.isoformat() if lease.claimable_at else None,
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
        holder, left = r["holder"] or "-", r["time_left"] or "-"
        if (claimable := item.state.lease.claimable_at) is not None:
            holder, left = "(revoked)", f"{_time_left(claimable, item.now)} until claimable"
        print(
            f"{r['type']!s:<14} {r['key']!s:<32} {r['revision']!s:>6} {r['generation']!s:>5}"
            f" {holder!s:<28} {left}"
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
            "claimable_at": lease.claimable_at.isoformat() if lease.claimable_at else None,
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
    elif lease.claimable_at is not None:
        wait = (lease.claimable_at - item.now).total_seconds()
        print(
            f"lease:      free (revoked), generation {lease.generation}; claimable again at"
            f" {_iso(lease.claimable_at)} ({wait:.1f}s by the database clock: the revoked"
            " holder's last expiry)"
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
        rid = existing_resource(store, args).id
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
        raise state.not_migrated_error(None)
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
    from ..doctor.writes import probe_writes

    # A direct connection, not a store: a store refuses a schema with pending
    # migrations, which is one of the things status is there to report.
    with connect_direct(args) as conn:
        # Whether writes go through can only be told by trying one: the one
        # write of status, a claim that is always rolled back (see
        # pglease.doctor.writes for what it leaves: nothing anyone can read).
        writes = probe_writes(conn, args.schema)
        # From here on the session is read-only: nothing can write by mistake.
        conn.execute("SET default_transaction_read_only = on")
        report = _status(conn, args.schema, args.within)
    report["writes"] = {
        "ok": writes.ok,
        "sqlstate": writes.sqlstate,
        "condition": writes.condition,
        "detail": writes.message,
    }
    # A fleet whose writes fail is an error, as each of its writes would be.
    code = EXIT_ERROR if writes.ok is False else EXIT_OK
    if report["test_clock"]:
        print(
            f"pglease: WARNING: the test clock is ON in schema {args.schema}: callers can"
            " choose the time leases are judged by (now=); never let real hosts use it",
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        print_json({**report, "dsn_source": dsn_source(args)})
        return code
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
    print(f"writes:       {writes.line()}")
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
    if writes.ok is False and writes.advice:
        print(f"pglease: writes fail: {writes.advice}", file=sys.stderr, flush=True)
    return code
