"""CLI subcommands ``pglease session ls|show|fork|export|import`` (registered by `pglease.cli`).

Sessions live in PostgreSQL (the global ``--dsn`` / ``--schema``); ``fork`` and
``export`` write a session file into ``--to DIR``; ``import`` reads one back as
a new PostgreSQL session whose parent is the file's session.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from ..sessions.model import SessionInfo, SessionSnapshot, lane_names
from ..sessions.postgres import PostgresSessionRepository
from ..sessions.repository import SessionListing, SessionRepository, read_session_file
from .support import EXIT_OK, open_store, print_json, to_jsonable


def _when(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _info_view(info: SessionInfo) -> dict[str, Any]:
    lease = info.lease
    return {
        "id": info.id,
        "created_at": info.created_at,
        "created": _when(info.created_at),
        "parent_session_id": info.parent_session_id,
        "storage_version": info.storage_version,
        "message_count": info.message_count,
        "next_seq": info.next_seq,
        "usage": info.usage,
        "holder": None if lease is None else lease.owner_id,
        "generation": None if lease is None else lease.fence,
        "lease_expires_at": None if lease is None else _when(lease.expires_at_ms),
    }


def _repository(store: Any) -> PostgresSessionRepository:
    # The CLI never holds a writer lease longer than one command: no heartbeat.
    return PostgresSessionRepository(store, renew_interval=None)


def cmd_ls(args: argparse.Namespace) -> int:
    listing: SessionListing
    if args.dir is not None:
        # Session files: only read (no directory made, no leftovers removed), so
        # crash leftovers show up among the problems.
        files = SessionRepository(args.dir, renew_interval=None, create=False, clean_temp=False)
        listing = files.list()
    else:
        with open_store(args, read_only=True) as store:
            listing = _repository(store).list()
    rows = [_info_view(s) for s in listing.sessions]
    problems = [{"id": p.id, "error": str(p.error)} for p in listing.problems]
    if args.json:
        print_json({"sessions": rows, "problems": problems})
        return EXIT_OK
    # CREATED keeps its zone (+00:00), as every timestamp the CLI prints.
    print(f"{'ID':<38} {'CREATED':<32} {'MSGS':>6} {'NEXT':>7} {'PARENT':<38} HOLDER")
    for r in rows:
        print(
            f"{r['id']:<38} {r['created']:<32} {r['message_count']:>6} {r['next_seq']:>7}"
            f" {r['parent_session_id'] or '-':<38} {r['holder'] or '-'}"
        )
    for p in problems:
        print(f"! {p['id']}: {p['error']}")
    return EXIT_OK


def _lanes(snapshot: SessionSnapshot) -> dict[str, dict[str, Any]]:
    regs = snapshot.register_map()
    lanes: dict[str, dict[str, Any]] = {}
    for lane in lane_names(snapshot.registers):
        view: dict[str, Any] = {}
        for namespace in ("lane.leaf", "lane.config", "lane.state", "lane.lastResult"):
            found = regs.get((namespace, lane))
            if found is not None:
                view[namespace.removeprefix("lane.")] = found.value
        lanes[lane] = view
    return lanes


def _facts(snapshot: SessionSnapshot) -> dict[str, Any]:
    regs = snapshot.registers
    name = next((r.value for r in regs if r.namespace == "fact.name" and r.key == ""), None)
    return {
        "name": name,
        "custom": {r.key: r.value for r in regs if r.namespace == "fact.custom"},
        "labels": {r.key: r.value for r in regs if r.namespace == "fact.label"},
    }


def cmd_show(args: argparse.Namespace) -> int:
    with open_store(args, read_only=True) as store:
        repo = _repository(store)
        info = repo.info(args.id)
        snapshot = repo.snapshot(args.id)
    view = _info_view(info)
    view["entry_count"] = len(snapshot.entries)
    view["entry_types"] = {
        t: n
        for t in ("message", "compaction", "branch_summary", "custom")
        if (n := sum(1 for e in snapshot.entries if e.type == t))
    }
    view["lanes"] = _lanes(snapshot)
    view["facts"] = _facts(snapshot)
    if args.json:
        print_json(view)
        return EXIT_OK
    for key in ("id", "created", "parent_session_id", "message_count", "entry_count", "next_seq"):
        print(f"{key}: {_text(view[key])}")
    print(f"entry_types: {_text(view['entry_types'])}")
    print(f"usage: {_text(view['usage'])}")
    holder = view["holder"]
    print(
        "writer: -"
        if holder is None
        else f"writer: {holder} (generation {view['generation']}, until {view['lease_expires_at']})"
    )
    for lane, lane_view in view["lanes"].items():
        print(f"lane {lane}: {_text(lane_view)}")
    print(f"facts: {_text(view['facts'])}")
    return EXIT_OK


def _text(value: Any) -> str:
    """A value for the human output: "-" for none, JSON for structures (never a
    Python repr such as ``{'input': 0}`` or ``None``), plain text otherwise."""
    if value is None:
        return "-"
    if isinstance(value, str | int | float):
        return str(value)
    return json.dumps(to_jsonable(value), sort_keys=True, ensure_ascii=False)


def _print_written(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.json:
        print_json(result)
    else:
        where = f" -> {result['path']}" if "path" in result else ""
        print(
            f"session {result['id']} (parent {result['parent_session_id']}, "
            f"{result['entries']} entries){where}"
        )


def _fork(args: argparse.Namespace, scope: Any, entry: str | None, position: Any) -> int:
    # Only reads PostgreSQL (the new session goes into a file): never migrates.
    with open_store(args, read_only=True) as store:
        path = _repository(store).fork_to_file(
            args.id, args.to, scope, entry, position, id=args.new_id
        )
    snapshot = read_session_file(path)
    _print_written(
        args,
        {
            "id": path.name.removesuffix(".sqlite"),
            "path": str(path),
            "parent_session_id": snapshot.parent_session_id,
            "scope": scope,
            "entries": len(snapshot.entries),
        },
    )
    return EXIT_OK


def cmd_fork(args: argparse.Namespace) -> int:
    return _fork(args, args.scope, args.entry, args.position)


def cmd_export(args: argparse.Namespace) -> int:
    return _fork(args, "tree", None, "at")


def cmd_import(args: argparse.Namespace) -> int:
    with open_store(args) as store, _repository(store).import_file(args.file, id=args.new_id) as s:
        stats = s.stats()
        result = {
            "id": s.id,
            "parent_session_id": stats.parent_session_id,
            "entries": stats.entry_count,
            "next_seq": stats.next_seq,
        }
    _print_written(args, result)
    return EXIT_OK


def _json_flag(parser: argparse.ArgumentParser) -> None:
    # Accept --json after the subcommand too: `pglease session ls --json`.
    parser.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``session`` command and its subcommands."""
    parser = subparsers.add_parser(
        "session",
        help="agent sessions in PostgreSQL: list, show, fork/export to a file, import",
        description="Sessions live in PostgreSQL (the global --dsn / --schema). fork and"
        " export write a session file into --to DIR; import reads one back as a new"
        " PostgreSQL session whose parent is the file's session.",
    )
    sub = parser.add_subparsers(dest="session_command", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser("ls", help="list sessions, newest first, with their writer")
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="list the session files in DIR instead (and leftovers of crashed forks)",
    )
    p.set_defaults(func=cmd_ls)
    _json_flag(p)

    p = sub.add_parser("show", help="one session: counts, usage, writer, lanes, facts")
    p.add_argument("id", help="session id")
    p.set_defaults(func=cmd_show)
    _json_flag(p)

    p = sub.add_parser("fork", help="fork a session into a new .sqlite session file")
    p.add_argument("id", help="source session id")
    p.add_argument("--scope", choices=("branch", "tree"), default="branch")
    p.add_argument("--entry", help="fork at this entry (branch scope; default: main lane leaf)")
    p.add_argument("--position", choices=("at", "before"), default="at")
    p.add_argument("--to", required=True, metavar="DIR", help="directory of session files")
    p.add_argument("--id", dest="new_id", metavar="NEW_ID", help="id of the new session")
    p.set_defaults(func=cmd_fork)
    _json_flag(p)

    p = sub.add_parser("export", help="copy a whole session into a .sqlite file (tree fork)")
    p.add_argument("id", help="source session id")
    p.add_argument("--to", required=True, metavar="DIR", help="directory of session files")
    p.add_argument("--id", dest="new_id", metavar="NEW_ID", help="id of the new session")
    p.set_defaults(func=cmd_export)
    _json_flag(p)

    p = sub.add_parser("import", help="import a .sqlite session file as a new session")
    p.add_argument("file", help="path of <id>.sqlite")
    p.add_argument("--id", dest="new_id", metavar="NEW_ID", help="id of the new session")
    p.set_defaults(func=cmd_import)
    _json_flag(p)
