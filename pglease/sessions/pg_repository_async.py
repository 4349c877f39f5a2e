"""The PostgreSQL session repository, asyncio source of `pg_repository`:
opening, creating and forking sessions, and listing them.
"""

from __future__ import annotations

import json

import psycopg

from ..ids import resource_id
from ..types import Permit
from ..validation import check_timeout
from .errors import (
    InvalidSessionWriteError,
    SessionCorruptError,
    SessionError,
    SessionExistsError,
    SessionNotFoundError,
)
from .fork import ForkPlan, ForkPosition, ForkScope, plan_fork
from .ids import uuid7
from .model import LeaseInfo, SessionInfo
from .pg_core import (
    RESOURCE_TYPE,
    cause_of,
    check_version,
    driver_error,
    new_session_plan,
    stale_import_problem,
)
from .pg_handle_async import AsyncPostgresSession
from .pg_io_async import Conn, _fork_source, _mutation_error, write_plan_rows_async
from .pg_transfers_async import AsyncSessionTransfers
from .repository import SessionListing, SessionProblem, check_session_id


class AsyncPostgresSessionRepository(AsyncSessionTransfers):
    """Sessions in the `session_*` tables of an open store's schema.

    `lease_seconds` / `renew_interval` set the writer lease of the handles it
    opens (30 s / 15 s): the store's keeper, the one `hold()` uses, renews it
    every `renew_interval` (see `pg_lease`); `renew_interval=None` disables
    background renewal (only `handle.renew()` extends it). `clock` (a
    `pglease.clock.Clock`, the system clock by default) decides trust windows
    and renewal times, and picks the keeper (one per store and clock).
    `now_ms`, when given, replaces the database clock for timestamps (tests);
    lease expiry is always judged by the database clock. `on_lost` is called
    when a handle finds its lease lost. Imports commit `import_chunk_entries`
    entries per transaction, hidden until the last; a hidden partial with no
    progress for `import_stale_after` seconds counts as abandoned.
    """

    async def open(self, session_id: str, *, wait: float | None = None) -> AsyncPostgresSession:
        """Open an existing session and claim its writer lease.

        Another live holder -> `SessionAlreadyClaimedError` naming it, or with
        `wait` seconds, once it has not let go within them (the wait wakes when
        the holder releases the lease or it expires).
        """
        check_session_id(session_id)
        wait = check_timeout(wait, "wait")
        rows = await self._fetch(self._q.session_exists, (session_id,))
        if not rows:
            raise SessionNotFoundError(f"session {session_id} does not exist")
        check_version(session_id, int(rows[0][0]))
        rid = resource_id(RESOURCE_TYPE, session_id)
        claim, started = await self._claim(session_id, rid, wait)
        try:
            found = await self._fetch(self._q.session_row, (session_id,))
            if not found:
                raise SessionNotFoundError(f"session {session_id} was deleted")
        except BaseException:
            await self._release_quietly(claim)
            raise
        return self._handle(session_id, claim, started, claim.revision, int(found[0][5]))

    async def _create_from_plan(
        self, session_id: str, plan: ForkPlan, event: str
    ) -> AsyncPostgresSession:
        rid = await self.store.ensure_resource(RESOURCE_TYPE, session_id)
        if await self.exists(session_id):
            raise SessionExistsError(f"session {session_id} already exists")
        claim, started = await self._claim(session_id, rid, None)
        created_at = None if self.now_ms is None else self.now_ms()
        payload = {
            "session": session_id,
            "parent_session_id": plan.parent_session_id,
            "entries": len(plan.entries),
            "next_seq": plan.next_seq,
        }

        async def apply(conn: Conn) -> None:
            await write_plan_rows_async(conn, self._q, session_id, plan, created_at)

        try:
            result = await self.store.mutate(
                Permit(rid, claim.revision, claim), event, apply, payload
            )
        except psycopg.Error as exc:
            await self._release_quietly(claim)
            error = _mutation_error(self.store, exc)
            raise error from cause_of(error, exc)
        except BaseException:
            await self._release_quietly(claim)
            raise
        return self._handle(session_id, claim, started, result.revision, plan.next_seq)

    async def create(
        self, id: str | None = None, parent_session_id: str | None = None
    ) -> AsyncPostgresSession:
        """Create a new empty session (lane.leaf/main = null at seq 1,
        lane.state/main idle at seq 2, next_seq 3) and claim its lease."""
        session_id = check_session_id(id) if id is not None else uuid7()
        if parent_session_id is not None and not isinstance(parent_session_id, str):
            raise InvalidSessionWriteError("parent_session_id must be a string or None")
        return await self._create_from_plan(
            session_id, new_session_plan(parent_session_id), "session.created"
        )

    async def create_from_plan(self, plan: ForkPlan, id: str | None = None) -> AsyncPostgresSession:
        """Write a fork plan (from any backend's snapshot) as a new session and open it."""
        session_id = check_session_id(id) if id is not None else uuid7()
        return await self._create_from_plan(session_id, plan, "session.forked")

    async def fork(
        self,
        source_id: str,
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> AsyncPostgresSession:
        """Copy (part of) a session into a new PostgreSQL session and open it. The
        source is read in one snapshot without touching its lease.

        Streamed like `import_file` when the pool has two connections (the
        source's read-only snapshot on one, the new session's chunks on the
        other); with a one-connection pool, one snapshot and one transaction."""
        source_id = check_session_id(source_id)
        new_id = check_session_id(id) if id is not None else uuid7()
        if self.store.limits.max_size < 2:
            plan = plan_fork(await self.snapshot(source_id), source_id, scope, entry_id, position)
            return await self.create_from_plan(plan, new_id)
        q = self._q
        handle: AsyncPostgresSession | None = None
        try:
            async with self.store.connection() as conn, conn.transaction():
                await conn.execute(q.read_only)
                async with _fork_source(conn, q, source_id, scope, entry_id, position) as stream:
                    handle = await self._write_stream(
                        new_id, stream, self.import_chunk_entries, None
                    )
        except psycopg.Error as exc:
            if handle is not None:  # the fork is complete; ending the source's snapshot failed
                return handle
            error = driver_error(self.store, exc)
            raise error from cause_of(error, exc)
        assert handle is not None
        return handle

    async def _infos(self, session_id: str | None) -> SessionListing:
        rows = await self._fetch(self._q.list_sessions, (session_id, session_id))
        listing = SessionListing()
        for r in rows:
            sid = r[0]
            location = f"{self.store.schema}.sessions/{sid}"
            try:
                check_version(sid, int(r[3]))
                usage = json.loads(r[5])
            except (SessionError, ValueError) as exc:
                error = (
                    exc
                    if isinstance(exc, SessionError)
                    else SessionCorruptError(f"session {sid} has invalid usage_payload")
                )
                listing.problems.append(SessionProblem(sid, location, error))
                continue
            lease = None if r[7] is None else LeaseInfo(r[7], int(r[8]), int(r[9]))
            listing.sessions.append(
                SessionInfo(
                    id=sid,
                    path=location,
                    created_at=int(r[1]),
                    parent_session_id=r[2],
                    storage_version=int(r[3]),
                    message_count=int(r[4]),
                    usage=usage,
                    next_seq=int(r[6]),
                    lease=lease,
                )
            )
        if session_id is None:
            stale = await self._fetch(self._q.stale_imports, (self.import_stale_after, None, None))
            for sid, age in stale:
                location = f"{self.store.schema}.sessions/{sid}"
                listing.problems.append(
                    SessionProblem(sid, location, stale_import_problem(sid, float(age)))
                )
        listing.sessions.sort(key=lambda s: (-s.created_at, s.id))
        return listing

    async def list(self) -> SessionListing:
        """Every session, newest `created_at` first; `lease` is the live writer
        lease, if any (owner id, generation, expiry in ms)."""
        return await self._infos(None)

    async def info(self, session_id: str) -> SessionInfo:
        """One session as `list()` reports it."""
        check_session_id(session_id)
        listing = await self._infos(session_id)
        if listing.problems:
            raise listing.problems[0].error
        if not listing.sessions:
            raise SessionNotFoundError(f"session {session_id} does not exist")
        return listing.sessions[0]
