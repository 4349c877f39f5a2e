"""Where to connect: an explicit DSN, else PGLEASE_DSN, else the embedded server."""

from __future__ import annotations

import os

ENV_DSN = "PGLEASE_DSN"


def resolve_dsn(dsn: str | None = None) -> str:
    if dsn:
        return dsn
    from_env = os.environ.get(ENV_DSN)
    if from_env:
        return from_env
    from .embedded import embedded_dsn

    return embedded_dsn()
