"""Deterministic resource ids and lease tokens."""

from __future__ import annotations

import hashlib
import secrets

from .validation import check_key, check_resource_type


def resource_id(resource_type: str, key: str) -> str:
    """`type-` + the first 40 hex digits of sha256(type NUL key)."""
    check_resource_type(resource_type)
    check_key(key)
    digest = hashlib.sha256(f"{resource_type}\x00{key}".encode()).hexdigest()
    return f"{resource_type}-{digest[:40]}"


def new_token() -> str:
    """A fresh 256-bit secret; only its sha256 ever reaches the database.

    Never starts with `-`: one token in 64 would, and a command line then
    reads `--token -abc...` as a flag rather than a value.
    """
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):
            return token


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()
