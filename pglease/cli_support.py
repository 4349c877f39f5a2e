"""Pieces every CLI command uses: opening the store, JSON output, exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import datetime
from typing import Any

from .postgres import PostgresStore
from .types import Owner

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_HELD = 3
EXIT_NOT_CURRENT = 4


def open_store(args: argparse.Namespace) -> PostgresStore:
    """The store named by the global --dsn/--schema options (migrated)."""
    return PostgresStore(args.dsn, schema=args.schema, min_size=1, max_size=2)


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
    print(f"pglease: error: {message}", file=sys.stderr)
    return code
