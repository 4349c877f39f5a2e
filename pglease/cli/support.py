"""Pieces every CLI command uses: opening the store, JSON output, exit codes."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg

from ..dsn import resolve_dsn_source
from ..errors import (
    CommitOutcomeUnknownError,
    ConfigurationError,
    InvalidTokenError,
    LeaseLostError,
    LockTimeoutError,
    PgleaseError,
    SchemaNotMigratedError,
    StaleResourceError,
    StatementTimeoutError,
    UnknownResourceError,
    ValidationError,
)
from ..postgres import PostgresStore
from ..postgres._core import CLIENT_GRACE, pooler_mode, unavailable
from ..postgres._stall import arm
from ..types import Owner
from ..validation import check_schema_name, check_token

ENV_TOKEN = "PGLEASE_TOKEN"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_HELD = 3
EXIT_NOT_CURRENT = 4


def resolve_connection(args: argparse.Namespace) -> None:
    """Settle ``args.dsn`` once (libpq order) and record ``args.dsn_source``.

    Only when nothing names a server (no --dsn, $PGLEASE_DSN or libpq
    environment) is it the embedded one, and then the command says so in one
    line on stderr, so nobody mistakes it for their own server.
    """
    args.dsn, args.dsn_source = resolve_dsn_source(args.dsn, quiet=True)
    if args.dsn_source == "embedded":
        from ..embedded import default_data_dir

        print(
            "pglease: no --dsn, PGLEASE_DSN or PGHOST/PGSERVICE set: using the embedded"
            f" PostgreSQL in {default_data_dir().resolve()} (`pglease embedded stop` stops it)",
            file=sys.stderr,
            flush=True,
        )


def dsn_source(args: argparse.Namespace) -> str:
    """Where the DSN came from: argument, PGLEASE_DSN, libpq-env or embedded."""
    source: str = getattr(args, "dsn_source", None) or "argument"
    return source


def note_embedded(args: argparse.Namespace) -> None:
    """Settle the connection if main() did not (which says so for the embedded server)."""
    if getattr(args, "dsn_source", None) is None:
        resolve_connection(args)


#: Whether the schema exists, and whether `pglease migrate` ever set it up.
_SCHEMA_STATE = (
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(s)s),"
    " EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
    "  ON n.oid = c.relnamespace WHERE n.nspname = %(s)s AND c.relname = 'schema_migrations')"
)


def require_schema(conn: psycopg.Connection[Any], schema: str, *, embedded: bool = False) -> None:
    """Refuse (`ConfigurationError`) a schema `pglease migrate` never set up.

    Only ``migrate`` creates a schema: a command that writes to a typo'd
    --schema would otherwise start a second, empty lease table and grant
    generation 1 to whoever asks, excluding nobody. `embedded`: the
    connection is the embedded server's, which the message says too (a
    host that lost its PGLEASE_DSN must not be told to migrate a private copy).
    """
    row = conn.execute(_SCHEMA_STATE, {"s": check_schema_name(schema)}).fetchone()
    exists, migrated = (bool(v) for v in row) if row is not None else (False, False)
    if migrated:
        return
    what = "holds no pglease tables" if exists else "does not exist"
    where = " on the embedded PostgreSQL (set PGLEASE_DSN for your server)" if embedded else ""
    raise ConfigurationError(
        f"schema {schema!r} {what}{where}; run `pglease --schema {schema} migrate` to set it"
        " up (only migrate creates a schema)"
    )


def open_store(args: argparse.Namespace, *, read_only: bool = False) -> PostgresStore:
    """The store named by the global --dsn/--schema options.

    A read-only command never migrates (a typo'd --schema must not create a
    schema), nor does any command under --no-migrate. A writing command first
    checks that the schema exists (`require_schema`); it then applies pending
    migrations to it, unless --no-migrate.
    """
    if getattr(args, "dsn_source", None) is None:
        resolve_connection(args)
    if not read_only:
        with connect_direct(args) as conn:
            require_schema(conn, args.schema, embedded=args.dsn_source == "embedded")
    migrate = not read_only and not getattr(args, "no_migrate", False)
    # Without migrating, the store checks the migration state itself and
    # raises MigrationError (naming the command to run) for a schema that
    # is missing or behind.
    return PostgresStore(
        args.dsn,
        schema=args.schema,
        min_size=1,
        max_size=2,
        auto_migrate=migrate,
        pooler=getattr(args, "pooler", False),
    )


@contextlib.contextmanager
def connect_direct(args: argparse.Namespace) -> Iterator[psycopg.Connection[Any]]:
    """One autocommit connection outside any store (migrate, grants)."""
    if getattr(args, "dsn_source", None) is None:
        resolve_connection(args)
    try:
        # In pooler mode psycopg must prepare nothing: see `_core.connect_kwargs`.
        pooler = pooler_mode(bool(getattr(args, "pooler", False)))
        conn = psycopg.connect(
            args.dsn,
            autocommit=True,
            connect_timeout=10,
            **({"prepare_threshold": None} if pooler else {}),
        )
    except psycopg.OperationalError as exc:
        raise unavailable(exc) from exc
    with conn:
        yield conn


#: An owner's one-shot write (revoke, resign) waits at most this long for the
#: lease row's lock: a fenced mutation in flight holds it until it commits,
#: which the server bounds by that lease's expiry, possibly hours away.
ADMIN_LOCK_TIMEOUT = 10.0
#: ... and at most this long for the server's answer; the client gives up
#: CLIENT_GRACE later on a path that went silent (a network stall, a hung server).
ADMIN_STATEMENT_TIMEOUT = 30.0


@contextlib.contextmanager
def bounded_write(
    conn: psycopg.Connection[Any], operation: str, resource_id: str
) -> Iterator[None]:
    """Run an owner's write on the autocommit `conn` in one transaction bounded on
    both sides: by the server (lock_timeout, statement_timeout, transaction-local,
    so a pooler's shared connection keeps its own) and by the client (the
    connection's socket is shut down when no answer came within
    ADMIN_STATEMENT_TIMEOUT + CLIENT_GRACE). Errors name `operation` and `resource_id`."""
    what = f"{operation} {resource_id}"
    deadline = arm(conn, ADMIN_STATEMENT_TIMEOUT + CLIENT_GRACE)
    try:
        with conn.transaction():
            conn.execute(
                f"SET LOCAL lock_timeout = '{ADMIN_LOCK_TIMEOUT:g}s';"
                f" SET LOCAL statement_timeout = '{ADMIN_STATEMENT_TIMEOUT:g}s'"
            )
            yield
    except (psycopg.Error, PgleaseError) as exc:
        if deadline is not None and deadline.fired:
            raise CommitOutcomeUnknownError(
                f"{what}: no answer from the server within"
                f" {deadline.seconds:g} s; the connection was closed, and whether the"
                " write committed is unknown (check with `pglease get` or `events`)",
                operation=operation,
                resource_id=resource_id,
            ) from exc
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            raise LockTimeoutError(
                f"{what}: the lease row stayed locked for {ADMIN_LOCK_TIMEOUT:g} s (a write"
                " in flight holds it until it commits); nothing changed: try again"
            ) from exc
        if isinstance(exc, psycopg.errors.QueryCanceled):
            raise StatementTimeoutError(
                f"{what}: cancelled after {ADMIN_STATEMENT_TIMEOUT:g} s; nothing changed"
            ) from exc
        if isinstance(exc, psycopg.OperationalError):
            raise unavailable(exc) from exc
        raise
    finally:
        if deadline is not None:
            deadline.cancel()


def read_token(token: str | None, token_file: str | None) -> str:
    """The lease token: ``--token``, else ``--token-file`` (``-`` = stdin), else $PGLEASE_TOKEN.

    The file and environment forms exist because argv is public (``ps``,
    /proc/PID/cmdline); the token is the lease's only proof of ownership.
    """
    if token is not None and token_file is not None:
        raise InvalidTokenError("give the token once: --token or --token-file, not both")
    if token is None and token_file is not None:
        try:
            text = sys.stdin.read() if token_file == "-" else Path(token_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            where = "stdin" if token_file == "-" else token_file
            raise InvalidTokenError(f"cannot read the token from {where}: {exc}") from None
        token = text.removesuffix("\n").removesuffix("\r")
        if not token:
            raise InvalidTokenError(f"--token-file {token_file} is empty")
    if token is None:
        token = os.environ.get(ENV_TOKEN) or None
    if token is None:
        raise InvalidTokenError(
            f"a lease token is required: --token TOK, --token-file FILE (- for stdin)"
            f" or ${ENV_TOKEN}"
        )
    return check_token(token)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt, so it ends a long-running
    command the way Ctrl-C does (printing its cursor or summary) instead of killing it."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def owner_arg(text: str) -> Owner:
    """argparse type for ``--owner TYPE:ID``."""
    try:
        return Owner.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def to_jsonable(value: Any) -> Any:
    if isinstance(value, Owner):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value


def print_json(value: Any) -> None:
    print(json.dumps(to_jsonable(value), sort_keys=True), flush=True)


def error_code(exc: PgleaseError) -> int:
    """The exit code of the one table (README "CLI") for a library error."""
    if isinstance(exc, LeaseLostError | StaleResourceError):
        return EXIT_NOT_CURRENT
    if isinstance(exc, ValidationError | UnknownResourceError):
        return EXIT_USAGE
    if isinstance(exc, SchemaNotMigratedError):
        # No pglease tables at all is a configuration problem (most often a typo'd
        # --schema), as a write to it is; a schema that is only behind needs its owner.
        return EXIT_ERROR if exc.has_tables else EXIT_USAGE
    # Naming something that does not exist (a session, an entry) is bad input, the
    # code of an unknown resource: every such class is a LookupError.
    return EXIT_USAGE if isinstance(exc, LookupError) else EXIT_ERROR


def fail(message: str, code: int = EXIT_ERROR) -> int:
    """Print one error line (passwords masked) to stderr and return `code`."""
    from ..dsn import redact_text

    one_line = " ".join(message.split())
    print(f"pglease: error: {redact_text(one_line)}", file=sys.stderr, flush=True)
    return code
