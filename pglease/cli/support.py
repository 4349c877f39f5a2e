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

from ..dsn import redact_dsn, resolve_dsn_source
from ..errors import InvalidTokenError
from ..postgres import PostgresStore
from ..postgres._core import pooler_mode, unavailable
from ..types import Owner
from ..validation import check_token

ENV_TOKEN = "PGLEASE_TOKEN"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_HELD = 3
EXIT_NOT_CURRENT = 4


def resolve_connection(args: argparse.Namespace) -> None:
    """Settle ``args.dsn`` once (libpq order) and record ``args.dsn_source``."""
    args.dsn, args.dsn_source = resolve_dsn_source(args.dsn)


def dsn_source(args: argparse.Namespace) -> str:
    """Where the DSN came from: argument, PGLEASE_DSN, libpq-env or embedded."""
    source: str = getattr(args, "dsn_source", None) or "argument"
    return source


def note_embedded(args: argparse.Namespace) -> None:
    """Before a write: say so on stderr when it goes to the embedded server."""
    if getattr(args, "dsn_source", None) is None:
        resolve_connection(args)  # a caller that skipped main()
    if args.dsn_source == "embedded":
        print(
            f"pglease: using the embedded PostgreSQL at {redact_dsn(args.dsn)}"
            " (set PGLEASE_DSN or PGHOST to use your server)",
            file=sys.stderr,
            flush=True,
        )


def open_store(args: argparse.Namespace, *, read_only: bool = False) -> PostgresStore:
    """The store named by the global --dsn/--schema options.

    A read-only command never migrates (a typo'd --schema must not create a
    schema), nor does any command under --no-migrate. A writing command on the
    embedded server says so, so nobody mistakes it for their own server.
    """
    if not read_only:
        note_embedded(args)
    elif getattr(args, "dsn_source", None) is None:
        resolve_connection(args)
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


def fail(message: str, code: int = EXIT_ERROR) -> int:
    """Print one error line (passwords masked) to stderr and return `code`."""
    from ..dsn import redact_text

    one_line = " ".join(message.split())
    print(f"pglease: error: {redact_text(one_line)}", file=sys.stderr, flush=True)
    return code
