"""The check of transactions that hold every watcher of the cluster back."""

from __future__ import annotations

from .report import HOLDBACK_WARN_SECONDS, Check, Conn, can_see_all_sessions


def check_holdback(conn: Conn, schema: str) -> list[Check]:
    """The oldest transaction holding an xid: watchers read only below it.

    Watchers read the log below `pg_snapshot_xmin`, the oldest running xid of
    the whole cluster, so any long transaction that wrote something (in any
    database, pglease's or not), or a forgotten prepared transaction, delays
    every watcher by as long as it stays open. The one named is the one with
    the oldest xid (it is what holds the frontier), not the one that began
    first: a transaction that only read for a while before writing began
    earlier but holds nothing back until it writes.
    """
    row = conn.execute(
        "SELECT pid, extract(epoch FROM clock_timestamp() - xact_start), datname,"
        " application_name, state, query_start, xact_start, backend_xid::text"
        " FROM pg_catalog.pg_stat_activity"
        " WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()"
        " ORDER BY age(backend_xid) DESC, xact_start LIMIT 1"
    ).fetchone()
    prepared = conn.execute(
        "SELECT gid, extract(epoch FROM clock_timestamp() - prepared), database,"
        " transaction::text FROM pg_catalog.pg_prepared_xacts ORDER BY age(transaction) DESC"
        " LIMIT 1"
    ).fetchone()
    hidden = "" if can_see_all_sessions(conn) else " (only this role's sessions are visible)"
    out: list[Check] = []
    if prepared is not None and float(prepared[1]) > HOLDBACK_WARN_SECONDS:
        out.append(
            Check(
                "watch_holdback",
                "warn",
                f"prepared transaction {prepared[0]!r} in {prepared[2]} is"
                f" {float(prepared[1]):.1f} s old: watchers deliver nothing committed after"
                " it began until it is resolved",
                "COMMIT PREPARED or ROLLBACK PREPARED it",
                {
                    "gid": prepared[0],
                    "database": prepared[2],
                    "age_seconds": round(float(prepared[1]), 3),
                    "xid": prepared[3],
                },
            )
        )
    if row is not None and row[1] is not None and float(row[1]) > HOLDBACK_WARN_SECONDS:
        pid, age, db, app, state, query_start, xact_start, xid = row
        since = query_start.isoformat() if query_start is not None else "unknown"
        out.append(
            Check(
                "watch_holdback",
                "warn",
                f"pid {pid} ({app or 'no application_name'}, database {db}, {state}, query"
                f" started {since}) has held transaction id {xid} for {float(age):.3f} s:"
                f" watchers deliver events only up to the oldest running transaction{hidden}",
                "keep writing transactions short; idle_in_transaction_session_timeout ends"
                f" stalled ones; SELECT pg_terminate_backend({pid}) if it is stuck",
                {
                    "pid": pid,
                    "application_name": app,
                    "database": db,
                    "state": state,
                    "age_seconds": round(float(age), 3),
                    "xact_start": xact_start.isoformat() if xact_start is not None else None,
                    "query_start": query_start.isoformat() if query_start is not None else None,
                    "xid": xid,
                },
            )
        )
    if not out:
        out.append(
            Check(
                "watch_holdback",
                "ok",
                f"no transaction older than {HOLDBACK_WARN_SECONDS * 1000:.0f} ms holds"
                f" watchers back{hidden}",
            )
        )
    return out
