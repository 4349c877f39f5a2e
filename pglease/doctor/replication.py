"""The checks of synchronous replication (what a failover may lose) and of pooler mode."""

from __future__ import annotations

import re
from typing import Any

from .report import Check, Conn, can_see_all_sessions, one_row, show_setting

_SYNC_NAMES = re.compile(r"^\s*(?:(FIRST|ANY)\s+)?(?:(\d+)\s*\()?(.*?)\)?\s*$", re.IGNORECASE)


def parse_sync_names(value: str) -> tuple[str, int, list[str]]:
    """`synchronous_standby_names` as (method, how many, names); ('', 0, []) when empty.

    ``a, b`` and ``n (a, b)`` are the old FIRST syntax; ``*`` matches any standby.
    """
    if not value.strip():
        return "", 0, []
    m = _SYNC_NAMES.match(value)
    if m is None:  # the server accepted it, so this is our parser's gap
        return "FIRST", 1, [value.strip()]
    method = (m.group(1) or "FIRST").upper()
    count = int(m.group(2)) if m.group(2) else 1
    names = [n.strip().strip('"') for n in m.group(3).split(",") if n.strip()]
    return method, count, names


def check_replication(conn: Conn, schema: str) -> list[Check]:
    """synchronous_commit, the synchronous standby, and inherited standby names."""
    commit = show_setting(conn, "synchronous_commit")
    names_value = show_setting(conn, "synchronous_standby_names")
    _method, wanted, names = parse_sync_names(names_value)
    privileged = can_see_all_sessions(conn)
    rows = conn.execute(
        "SELECT application_name, state, sync_state FROM pg_catalog.pg_stat_replication"
    ).fetchall()
    streaming = [r for r in rows if r[1] == "streaming"]
    sync = [r for r in rows if r[2] in ("sync", "quorum")]
    in_recovery = bool(one_row(conn, "SELECT pg_is_in_recovery()")[0])
    out: list[Check] = []

    if commit in ("on", "remote_apply"):
        out.append(Check("synchronous_commit", "ok", f"synchronous_commit = {commit}"))
    else:
        why = {
            "remote_write": "a commit is acknowledged once the standby has written it,"
            " before it is flushed: a crash of both can lose a grant",
            "local": "commits never wait for a standby: a failover can lose a grant",
            "off": "commits are acknowledged before they are flushed: even a restart"
            " of this server can lose a grant, and a generation be handed out twice",
        }.get(commit, "unexpected value")
        out.append(
            Check(
                "synchronous_commit",
                "warn",
                f"synchronous_commit = {commit}: {why}",
                "SET synchronous_commit = on (server, database or the store's role)",
            )
        )

    if not names:
        if in_recovery:
            detail = "this server is a standby; its primary decides"
            out.append(Check("synchronous_standby", "unknown", detail))
        else:
            # An asynchronous standby can be promoted without the last grants: a
            # warning. With none at all there is nothing to fail over to: advice.
            if rows:
                detail = (
                    f"synchronous_standby_names is empty ({len(rows)} asynchronous standby(s)"
                    " attached): a failover can lose acknowledged grants, and the new primary"
                    " hand the same generation out again"
                )
            else:
                detail = (
                    "synchronous_standby_names is empty (no standby): a single server, nothing"
                    " to fail over to; a standby added for failover must be synchronous, or a"
                    " failover can lose acknowledged grants"
                )
            out.append(
                Check(
                    "synchronous_standby",
                    "warn" if rows else "advice",
                    detail,
                    "run a synchronous standby: synchronous_standby_names = 'FIRST 1 (name)'"
                    " with application_name=name in the standby's primary_conninfo",
                )
            )
        return out

    def matches(app: Any) -> bool:
        return any(n == "*" or str(app or "").lower() == n.lower() for n in names)

    connected = [r for r in streaming if matches(r[0])]
    waiting = int(
        one_row(
            conn,
            "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE wait_event = 'SyncRep'",
        )[0]
    )
    hang = f"; {waiting} backend(s) are waiting for a standby right now" if waiting else ""
    if not privileged and rows and not streaming:
        out.append(
            Check(
                "synchronous_standby",
                "unknown",
                f"synchronous_standby_names = {names_value!r}; {len(rows)} WAL sender(s),"
                " their state hidden from this role",
                "run the doctor as a role with pg_read_all_stats (or pg_monitor)",
            )
        )
    elif len(connected) < wanted:
        out.append(
            Check(
                "synchronous_standby",
                "error",
                f"synchronous_standby_names = {names_value!r} wants {wanted} of"
                f" {', '.join(names)}, {len(connected)} connected: every commit waits for a"
                f" standby that is not there (claims and writes hang){hang}",
                "attach the standby, or, on a promoted standby that inherited the setting:"
                " ALTER SYSTEM SET synchronous_standby_names = ''; SELECT pg_reload_conf()"
                " (RESET does not override postgresql.conf)",
            )
        )
    elif sync:
        apps = ", ".join(f"{r[0]} ({r[2]})" for r in sync)
        out.append(Check("synchronous_standby", "ok", f"synchronous standby: {apps}"))
    else:
        out.append(
            Check(
                "synchronous_standby",
                "warn",
                f"synchronous_standby_names = {names_value!r}, standbys connected but none"
                " is synchronous yet (catching up?)",
                "wait until pg_stat_replication shows sync_state = 'sync'",
            )
        )
    return out


def check_pooler(conn: Conn, schema: str, pooler: bool | None = None) -> list[Check]:
    """Is a pooler or proxy between us and the server? (heuristic)

    A direct connection's BackendKeyData carries the backend's own pid; a
    pooler (PgBouncer, Odyssey, PgCat) hands out a key of its own. Its mode
    (session or transaction pooling) cannot be told from the client, so the
    verdict rests on the client's own pooler mode (`pooler`: None when unknown).
    """
    reported = conn.info.backend_pid
    actual = int(one_row(conn, "SELECT pg_backend_pid()")[0])
    mode = {True: "; pooler mode is on", False: "; pooler mode is off", None: ""}[pooler]
    if reported == actual:
        return [Check("pooler", "ok", f"direct connection (backend pid {actual}){mode}")]
    if not reported:
        return [
            Check(
                "pooler",
                "unknown",
                "the connection reported no backend pid: cannot tell whether a pooler"
                f" is in between{mode}",
            )
        ]
    between = (
        f"a pooler or proxy is in between (connection key pid {reported}, server"
        f" backend pid {actual}); whether it pools by transaction cannot be told"
    )
    if pooler:
        return [
            Check(
                "pooler",
                "ok",
                f"{between}; pooler mode is on (no prepared statements or session SETs,"
                " time limits per transaction, watchers poll), safe for either mode",
            )
        ]
    return [
        Check(
            "pooler",
            "warn",
            f"{between}{mode}",
            "with transaction pooling, open stores in pooler mode (pooler=True, CLI"
            " --pooler, or PGLEASE_POOLER=transaction): prepared statements, session"
            " SETs and LISTEN do not survive it; session pooling needs nothing",
        )
    ]
