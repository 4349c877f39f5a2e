"""Moving sessions in and out of PostgreSQL in short transactions, asyncio
source of `pg_transfers`: forks to files and exports, imports of files (and
streamed forks) in chunks behind an import token, purges of partial imports,
and chunked deletes.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

from .._compat_async import to_thread
from ..errors import PgleaseError, ResourceLeasedError, StaleResourceError
from ..ids import resource_id
from ..types import Permit
from .errors import (
    InvalidSessionWriteError,
    SessionBusyError,
    SessionExistsError,
    SessionNotFoundError,
)
from .fork import ForkPosition, ForkScope, ForkStream, checked_seq_order, resolve_fork
from .ids import uuid7
from .pg_base_async import AsyncRepositoryBase
from .pg_core import (
    IMPORT_CLAIM_WAIT,
    PURGE_CHUNK,
    RESOURCE_TYPE,
    ChunkSizer,
    cause_of,
    check_chunk_size,
    check_stale_after,
    chunks,
    delete_interrupted,
    driver_error,
    import_gone,
    import_refusal,
    pooler_limits,
    sized_chunks,
    translate_unique,
)
from .pg_handle_async import AsyncPostgresSession
from .pg_io_async import (
    Conn,
    T,
    _fork_source,
    _mutation_error,
    _read_consistent,
    _write_chunk,
    _write_registers,
    log,
)
from .repository import SUFFIX, SessionRepository, check_session_id
from .schema import EMPTY_USAGE_JSON, STORAGE_VERSION
from .sqlite_file import file_fork_source


class AsyncSessionTransfers(AsyncRepositoryBase):
    """Forks to files, imports, their cleanup, and deletes (chunked)."""

    async def fork_to_file(
        self,
        source_id: str,
        directory: str | os.PathLike[str],
        scope: ForkScope = "branch",
        entry_id: str | None = None,
        position: ForkPosition = "at",
        id: str | None = None,
    ) -> Path:
        """Fork a PostgreSQL session into a new `<directory>/<id>.sqlite` file in
        the session file format (closed, no writer lease); return its path.

        Streamed: entries go from a server-side cursor into the file as they
        are read (memory does not grow with the session), all in one
        read-only snapshot of the source; a branch fork reads only the branch."""
        source_id = check_session_id(source_id)
        new_id = check_session_id(id) if id is not None else uuid7()
        target = Path(directory) / (new_id + SUFFIX)
        if target.exists():
            raise SessionExistsError(f"session {new_id} already exists ({target})")
        q = self._q

        async def run(conn: Conn) -> Path:
            async with _fork_source(conn, q, source_id, scope, entry_id, position) as stream:
                # Only now, with the source read and the fork valid: a missing
                # directory is created on demand; a refused fork leaves none.
                files = await to_thread(SessionRepository, directory, renew_interval=None)
                return await to_thread(files.write_stream, stream, new_id)

        return await _read_consistent(self.store, q, run)

    async def export_to_file(
        self, source_id: str, directory: str | os.PathLike[str], id: str | None = None
    ) -> Path:
        """A tree fork into a file: every entry and lane."""
        return await self.fork_to_file(source_id, directory, "tree", id=id)

    async def import_file(
        self,
        path: str | os.PathLike[str],
        id: str | None = None,
        *,
        chunk_entries: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> AsyncPostgresSession:
        """Import a session file as a new PostgreSQL session whose parent is the
        file's session (a tree fork: entries and lanes kept, usage not copied).

        Streamed and chunked: `chunk_entries` entries per transaction (default
        `import_chunk_entries`), the session hidden from listings, opens and
        reads until the last, short, transaction shows it (with its
        `session.forked` event). `on_progress(entries_written)` runs after each
        chunk. A failed import removes what it wrote; one killed midway leaves a
        hidden partial that `list()` reports and that the next import of the
        same id or `cleanup_imports()` removes once it is stale."""
        file_path = Path(path)
        if file_path.suffix != ".sqlite":
            raise InvalidSessionWriteError(f"{file_path} is not a .sqlite session file")
        file_id = check_session_id(file_path.name[: -len(".sqlite")])
        session_id = check_session_id(id) if id is not None else uuid7()
        size = check_chunk_size(
            self.import_chunk_entries if chunk_entries is None else chunk_entries
        )
        if not file_path.is_file():
            raise SessionNotFoundError(f"session file {file_path} does not exist")
        # The file is read where blocking is fine (`to_thread`), a chunk at a time.
        opened = file_fork_source(file_path)
        source = await to_thread(opened.__enter__)
        try:
            shape = await to_thread(resolve_fork, source.registers, source.lookup, "tree")
            stream = ForkStream(
                checked_seq_order(source.entries()),
                shape.lanes,
                source.registers,
                file_id,
                shape.scope,
            )
            try:
                return await self._write_stream(session_id, stream, size, on_progress)
            finally:
                await to_thread(stream.close)
        finally:
            await to_thread(opened.__exit__, None, None, None)

    async def _in_transaction(
        self, fn: Callable[[Conn], Awaitable[T]], transaction: bool = True
    ) -> T:
        """One short write transaction of an import or a purge (`transaction=False`:
        `fn` on the autocommit connection, each statement its own transaction)."""
        conn: Conn | None = None
        try:
            async with self.store.connection() as conn:
                if not transaction:
                    return await fn(conn)
                async with conn.transaction():
                    if (limits := pooler_limits(self.store)) is not None:
                        await conn.execute(limits)  # no session SET bounds it behind a pooler
                    return await fn(conn)
        except psycopg.Error as exc:
            error = import_refusal(exc) or (
                translate_unique(exc)
                if isinstance(exc, psycopg.errors.UniqueViolation)
                else driver_error(self.store, exc, conn is not None and conn.broken)
            )
            raise error from cause_of(error, exc)

    async def _begin_import(
        self, session_id: str, rid: str, token: str, parent: str | None
    ) -> None:
        """Insert the hidden session row; an existing visible one is
        `SessionExistsError`, a live import `SessionBusyError`, a stale partial
        is removed first."""
        params = (session_id, rid, parent, STORAGE_VERSION, EMPTY_USAGE_JSON, token)

        async def insert(conn: Conn) -> int:
            return (await conn.execute(self._q.begin_import, params)).rowcount

        for _ in range(3):
            if await self._in_transaction(insert):
                return
            rows = await self._fetch(self._q.import_state, (session_id,))
            if not rows:
                continue  # deleted meanwhile: try again
            hidden, age = rows[0]
            if not hidden:
                raise SessionExistsError(f"session {session_id} already exists")
            if await self._take_and_purge(session_id, self.import_stale_after):
                log.warning(
                    "session %s: removed the hidden partial of an interrupted import", session_id
                )
                continue
            raise SessionBusyError(
                f"session {session_id}: another import of this id is in progress (last chunk"
                f" {float(age):.1f} s ago; a partial counts as abandoned after"
                f" {self.import_stale_after:g} s)"
            )
        raise SessionExistsError(f"session {session_id} already exists")

    async def _purge_import(
        self,
        session_id: str,
        token: str,
        size: int = PURGE_CHUNK,
        on_progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Delete a hidden import's (or deleted session's) rows in short
        transactions of up to `size` rows (fewer while they run past
        `CHUNK_TARGET`), each checking the token (a purge never
        touches a session that became visible); `on_progress(rows_removed)`
        after each. False when another cleanup took the partial over."""

        async def purge_some(conn: Conn) -> int:
            touched = await conn.execute(self._q.touch_import, (session_id, token))
            if not await touched.fetchall():
                return -1
            for query in self._q.purge_rows:
                deleted = (await conn.execute(query, (session_id, sizer.size))).rowcount
                if deleted:
                    return deleted
            await conn.execute(self._q.drop_import, (session_id, token))  # the row is locked: ours
            return 0

        removed = 0
        sizer = ChunkSizer(size)
        while True:
            began = time.monotonic()
            done = await self._in_transaction(purge_some)
            sizer.record(time.monotonic() - began)
            if done <= 0:
                return done == 0
            removed += done
            if on_progress is not None:
                on_progress(removed)

    async def _take_and_purge(self, session_id: str, stale_after: float) -> bool:
        """Take over a stale partial import (a new token) and remove it."""
        token = uuid7()

        async def take(conn: Conn) -> list[tuple[Any, ...]]:
            cur = await conn.execute(self._q.take_import, (token, session_id, stale_after))
            return await cur.fetchall()

        return bool(await self._in_transaction(take)) and await self._purge_import(
            session_id, token
        )

    async def _discard_import(self, session_id: str, token: str) -> None:
        try:
            await self._purge_import(session_id, token)
        except PgleaseError as exc:  # the partial stays hidden; it goes once stale
            log.warning("session %s: removing a failed import failed: %s", session_id, exc)

    async def cleanup_imports(self, stale_after: float | None = None) -> list[str]:
        """Remove hidden partial imports with no progress for `stale_after`
        seconds (default `import_stale_after`), in short transactions; return
        their ids."""
        limit = self.import_stale_after if stale_after is None else check_stale_after(stale_after)
        removed = []
        for sid, _age in await self._fetch(self._q.stale_imports, (limit, None, None)):
            if await self._take_and_purge(sid, limit):
                removed.append(sid)
        return removed

    async def _copied_ids(self, session_id: str, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(ids), 1000):
            part = list(ids[start : start + 1000])
            rows = await self._fetch(self._q.known_entries, (session_id, part))
            found.update(r[0] for r in rows)
        return found

    async def _write_stream(
        self,
        session_id: str,
        stream: ForkStream,
        size: int,
        on_progress: Callable[[int], None] | None,
    ) -> AsyncPostgresSession:
        """A streamed fork as a new session: hidden row, entry chunks, register
        chunks, then one fenced mutation that shows it and claims its lease."""
        q = self._q
        rid = await self.store.ensure_resource(RESOURCE_TYPE, session_id)
        token = uuid7()
        await self._begin_import(session_id, rid, token, stream.parent_session_id)
        try:
            written = messages = last_seq = 0
            limits = pooler_limits(self.store)
            sizer = ChunkSizer(size)
            parts = sized_chunks(stream.entries, sizer)
            # The entries may come from a blocking reader (a file, `_fork_source`).
            while (part := await to_thread(next, parts, None)) is not None:
                seconds = await self._in_transaction(
                    functools.partial(
                        _write_chunk,
                        q=q,
                        session_id=session_id,
                        token=token,
                        entries=part,
                        limits=limits,
                    ),
                    transaction=False,
                )
                sizer.record(seconds)
                written += len(part)
                messages += sum(1 for e in part if e.type == "message")
                last_seq = max(last_seq, part[-1].seq)
                if on_progress is not None:
                    on_progress(written)
            copied = await self._copied_ids(session_id, stream.label_keys())
            registers, next_seq = stream.registers(last_seq, copied)
            for regs in chunks(registers, size):
                await self._in_transaction(
                    functools.partial(
                        _write_registers,
                        q=q,
                        session_id=session_id,
                        token=token,
                        registers=regs,
                        limits=limits,
                    ),
                    transaction=False,
                )
            # A create() of this id racing the import claims and releases the lease
            # in one breath: wait for it rather than throw the import away.
            claim, started = await self._claim(session_id, rid, IMPORT_CLAIM_WAIT)
            created_at = None if self.now_ms is None else self.now_ms()
            payload = {
                "session": session_id,
                "parent_session_id": stream.parent_session_id,
                "entries": written,
                "next_seq": next_seq,
            }

            async def apply(conn: Conn) -> None:
                finish = (created_at, messages, next_seq, session_id, token)
                if (await conn.execute(q.finish_import, finish)).rowcount != 1:
                    raise import_gone(session_id)

            try:
                result = await self.store.mutate(
                    Permit(rid, claim.revision, claim), "session.forked", apply, payload
                )
            except psycopg.Error as exc:
                await self._release_quietly(claim)
                error = _mutation_error(self.store, exc)
                raise error from cause_of(error, exc)
            except BaseException:
                await self._release_quietly(claim)
                raise
        except BaseException:
            await self._discard_import(session_id, token)
            raise
        return self._handle(session_id, claim, started, result.revision, next_seq)

    async def delete(
        self,
        session_id: str,
        *,
        chunk_rows: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        """Delete a session and all its rows. Refused while a writer lease is live
        (checked in the fenced transaction that hides the session).

        Chunked, so no transaction grows with the session: that transaction
        (with the `session.deleted` event) hides the session at once, as an
        import's token does; its rows then go in transactions of at most
        `chunk_rows` rows (default 5,000; fewer while a chunk runs past
        `CHUNK_TARGET`). `on_progress(rows_removed)` runs after each. A
        delete that stops midway (killed, connection lost) leaves a hidden
        remainder, reported by `list()` once stale and removed by
        `cleanup_imports()` or the next import of the id."""
        check_session_id(session_id)
        size = check_chunk_size(PURGE_CHUNK if chunk_rows is None else chunk_rows, "chunk_rows")
        if not await self.exists(session_id):
            raise SessionNotFoundError(f"session {session_id} does not exist")
        rid = resource_id(RESOURCE_TYPE, session_id)
        token = uuid7()

        async def hide(conn: Conn) -> None:
            cur = await conn.execute(self._q.hide_session, (token, session_id))
            if not await cur.fetchall():
                raise SessionNotFoundError(f"session {session_id} does not exist")

        for attempt in (1, 2, 3):
            revision = (await self.store.get(rid)).revision
            try:
                await self.store.mutate(
                    Permit(rid, revision), "session.deleted", hide, {"session": session_id}
                )
                break
            except ResourceLeasedError as exc:
                raise SessionBusyError(f"session {session_id} is leased: {exc}") from None
            except StaleResourceError:
                if attempt == 3:
                    raise
            except psycopg.Error as exc:
                error = _mutation_error(self.store, exc)
                raise error from cause_of(error, exc)
        try:
            await self._purge_import(session_id, token, size, on_progress)
        except PgleaseError as exc:
            raise delete_interrupted(session_id, exc) from exc
