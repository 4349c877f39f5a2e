"""Where to connect, following libpq, and how to show a DSN without its secrets.

Order: an explicit DSN, else ``PGLEASE_DSN``, else the standard libpq
environment (``PGHOST``, ``PGPORT``, ``PGSERVICE``, ...; libpq reads it itself,
so the DSN is ""), else the embedded server. Before the environment decides,
every ``PGLEASE_*`` variable set must be one pglease knows (`check_environment`):
a misspelt ``PGLEASE_DSN`` is an error, never a quiet fall-back to the
embedded server.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Literal
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .errors import ConfigurationError, InvalidDsnError

ENV_DSN = "PGLEASE_DSN"

#: The ``PGLEASE_*`` environment variables pglease reads or sets.
USER_ENV: Mapping[str, str] = {
    "PGLEASE_DSN": "the server to connect to",
    "PGLEASE_SCHEMA": "the CLI's default --schema",
    "PGLEASE_POOLER": "transaction: pooler mode",
    "PGLEASE_TOKEN": "the CLI's lease token",
    "PGLEASE_EMBEDDED_DIR": "the embedded server's data directory",
    # Set by `pglease hold` and `pglease elect` for the command they run,
    # which may run pglease itself.
    "PGLEASE_FENCE": "set for a held command: the generation",
    "PGLEASE_RESOURCE_ID": "set for a held command",
    "PGLEASE_OWNER": "set for a held command",
    "PGLEASE_TTL": "set for a held command",
}
#: The test suite's and the benchmarks' own (tests run the CLI with them set).
DEV_ENV: Mapping[str, str] = {
    "PGLEASE_TEST_DSN": "tests: an existing server",
    "PGLEASE_TEST_POSTGRES": "tests: docker for a testcontainers server",
    "PGLEASE_PG15_BIN": "tests: PostgreSQL 15 binaries",
    "PGLEASE_BENCH_CODE": "benchmarks: the code under test",
}
#: Every ``PGLEASE_*`` name `check_environment` accepts; a new variable goes
#: in one of the two maps above (tests/test_cli_config.py finds any left out).
KNOWN_ENV = frozenset(USER_ENV) | frozenset(DEV_ENV)

_ENV_PREFIX = "PGLEASE_"

#: libpq variables that name a server; any of them set means "libpq decides".
LIBPQ_ENV = (
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGDATABASE",
    "PGSERVICE",
    "PGSERVICEFILE",
)

DsnSource = Literal["argument", "PGLEASE_DSN", "libpq-env", "embedded"]

#: Connection options whose values are secrets.
_SECRET_KEYS = frozenset({"password", "sslpassword"})
_MASK = "***"
_URI_PREFIX = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)
#: Replaces whatever could not be parsed: it may be (part of) a password.
_REST = "..."

#: (start, end, replacement) of one secret in a DSN.
Span = tuple[int, int, str]


def _uri_secret_spans(dsn: str, well_formed: bool) -> list[Span]:
    """Character ranges of `dsn` (a URI) that hold secrets."""
    start = _URI_PREFIX.match(dsn)
    assert start is not None
    begin = start.end()
    spans: list[Span] = []
    # libpq ends the user info at the first "@" before any "/" ("u:p?ss@h" has
    # password "p?ss"), but a password may also hold a raw "@" or "/"
    # ("u:p/ss@h"): mask up to the last "@" before the query instead. In a DSN
    # libpq refuses, a "?" may be part of the password too.
    libpq_at = -1
    for i in range(begin, len(dsn)):
        if dsn[i] in "@/":
            libpq_at = i if dsn[i] == "@" else -1
            break
    query_start = dsn.find("?", max(libpq_at, begin)) if well_formed else -1
    at = dsn.rfind("@", begin, len(dsn) if query_start < 0 else query_start)
    if at >= 0:
        colon = dsn.find(":", begin, at)
        if colon >= 0:
            spans.append((colon + 1, at, _MASK))
    query = dsn.find("?", max(at, begin))
    if query >= 0:
        pos = query + 1
        while pos <= len(dsn):
            amp = dsn.find("&", pos)
            stop = len(dsn) if amp < 0 else amp
            key, eq, _ = dsn[pos:stop].partition("=")
            if eq and key.strip().lower() in _SECRET_KEYS:
                spans.append((pos + len(key) + 1, stop, _MASK))
            pos = stop + 1
    return spans


def _kv_secret_spans(dsn: str) -> list[Span]:
    """Secret ranges of a ``key=value`` DSN, tokenised as libpq does."""
    spans: list[Span] = []
    i, n = 0, len(dsn)
    while True:
        while i < n and dsn[i].isspace():
            i += 1
        if i >= n:
            return spans
        key_start = i
        while i < n and dsn[i] != "=" and not dsn[i].isspace():
            i += 1
        key = dsn[key_start:i]
        while i < n and dsn[i].isspace():
            i += 1
        if i >= n or dsn[i] != "=" or not key:
            # Not "key=value": libpq refuses it; it may be a stray piece of a
            # password with a space in it, so nothing from here on is shown.
            spans.append((key_start, n, _REST))
            return spans
        i += 1
        while i < n and dsn[i].isspace():
            i += 1
        value_start = i
        if i < n and dsn[i] == "'":
            i += 1
            while i < n and dsn[i] != "'":
                i += 2 if dsn[i] == "\\" else 1
            i = min(i + 1, n)  # an unterminated quote runs to the end
        else:
            while i < n and not dsn[i].isspace():
                i += 2 if dsn[i] == "\\" else 1
            i = min(i, n)
        if key.lower() in _SECRET_KEYS:
            spans.append((value_start, i, _MASK))


def _parse(dsn: str) -> dict[str, object] | None:
    try:
        return dict(conninfo_to_dict(dsn))
    except psycopg.Error:
        return None


def _secret_spans(dsn: str) -> list[Span]:
    if _URI_PREFIX.match(dsn):
        return _uri_secret_spans(dsn, _parse(dsn) is not None)
    return _kv_secret_spans(dsn)


def _covered(dsn: str, spans: list[Span], params: dict[str, object]) -> bool:
    """Whether every secret libpq parses out of `dsn` lies inside a masked span."""
    masked = [unquote(dsn[start:end]).replace("\\", "") for start, end, _ in spans]
    for key in _SECRET_KEYS:
        value = str(params.get(key) or "").replace("\\", "")
        if value and not any(value in text for text in masked):
            return False
    return True


def _mask(dsn: str, spans: list[Span], lo: int = 0, hi: int | None = None) -> str:
    """`dsn[lo:hi]` with every secret span replaced by a mask."""
    hi = len(dsn) if hi is None else hi
    out: list[str] = []
    pos = lo
    for start, end, replacement in sorted(spans):
        if end <= lo or start >= hi:
            continue
        out.append(dsn[pos : max(start, lo)])
        out.append(replacement)
        pos = min(end, hi)
    out.append(dsn[pos:hi])
    return "".join(out)


def redact_dsn(dsn: str) -> str:
    """`dsn` with its passwords replaced by ``***``; never raises.

    ``postgresql://u:secret@h/db`` -> ``postgresql://u:***@h/db``;
    ``host=h password='s e'`` -> ``host=h password=***``. Parts of a malformed
    DSN that cannot be parsed are shown as ``...``, never echoed.
    """
    try:
        spans = _secret_spans(dsn)
        params = _parse(dsn)
        if params is None or _covered(dsn, spans, params):
            return _mask(dsn, spans)
        # Our reading of the DSN missed a secret libpq found: show libpq's reading.
        return " ".join(
            f"{key}={_MASK if key in _SECRET_KEYS else value}" for key, value in params.items()
        )
    except Exception:  # a redactor must never be the thing that fails
        return "<DSN not shown>"


_TEXT_PATTERNS = (
    # user:password@ in any URI-looking text
    (re.compile(r"(postgres(?:ql)?://[^\s:/@'\"]*:)[^\s@'\"]*@", re.IGNORECASE), r"\1***@"),
    # ?password=... / &sslpassword=... query parameters
    (re.compile(r"([?&](?:ssl)?password=)[^&\s'\"]*", re.IGNORECASE), r"\1***"),
    # password=... / password = '...' keyword pairs
    (
        re.compile(r"(\b(?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|[^\s'\"]+)", re.IGNORECASE),
        r"\1***",
    ),
)


def redact_text(text: str, dsn: str | None = None) -> str:
    """A message (say a psycopg error) with any password in it masked.

    With `dsn`, also hides that DSN's secrets wherever the message quotes the
    DSN or a piece of it (libpq quotes both in its parse errors).
    """
    if dsn:
        spans = _secret_spans_safe(dsn)
        if spans:
            text = _hide_quoted_pieces(text, dsn, spans)
            for start, end, _ in spans:
                secret = dsn[start:end].strip("'")
                # Short values would also match innocent words of the message.
                if len(secret) >= 4:
                    text = text.replace(secret, _MASK)
    for pattern, replacement in _TEXT_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def _secret_spans_safe(dsn: str) -> list[Span]:
    try:
        return _secret_spans(dsn)
    except Exception:
        return [(0, len(dsn), _REST)]


def _hide_quoted_pieces(text: str, dsn: str, spans: list[Span]) -> str:
    if dsn in text:
        text = text.replace(dsn, _mask(dsn, spans))

    def hide(match: re.Match[str]) -> str:
        piece = match.group(1)
        at = dsn.find(piece) if piece else -1
        while at >= 0:
            if any(start < at + len(piece) and at < end for start, end, _ in spans):
                return f'"{_mask(dsn, spans, at, at + len(piece))}"'
            at = dsn.find(piece, at + 1)
        return match.group(0)

    return re.sub(r'"([^"]*)"', hide, text)


def check_dsn(dsn: str) -> str:
    """Return `dsn` if libpq can parse it; else raise `InvalidDsnError` (redacted)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        detail = redact_text(" ".join(str(exc).split()), dsn)
        raise InvalidDsnError(f"invalid PostgreSQL DSN {redact_dsn(dsn)}: {detail}") from None
    port = params.get("port")
    # psycopg resolves host names before libpq checks the port, so "h:bad" would
    # otherwise fail as an unresolvable host, naming neither the port nor the DSN.
    if port is not None and not all(p.strip().isdigit() for p in str(port).split(",") if p):
        raise InvalidDsnError(
            f"invalid PostgreSQL DSN {redact_dsn(dsn)}: port {port!r} is not a number"
        )
    return dsn


def libpq_env_set() -> bool:
    """Whether the environment names a server the libpq way (PGHOST, PGSERVICE, ...)."""
    return any(os.environ.get(name) for name in LIBPQ_ENV)


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``PGLEASE_*`` variables set in `environ` (default: the process's
    environment) that pglease does not know, sorted."""
    names = os.environ if environ is None else environ
    return sorted(n for n in names if n.upper().startswith(_ENV_PREFIX) and n not in KNOWN_ENV)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise `ConfigurationError` naming every unknown ``PGLEASE_*`` variable
    (with the known name it is closest to); never shows a value."""
    unknown = unknown_environment(environ)
    if not unknown:
        return
    # Compared without the shared prefix, which would make every name look close.
    suffixes = {n.removeprefix(_ENV_PREFIX): n for n in sorted(KNOWN_ENV)}
    named = []
    for name in unknown:
        suffix = name.upper().removeprefix(_ENV_PREFIX)
        close = difflib.get_close_matches(suffix, list(suffixes), n=1, cutoff=0.6)
        named.append(f"{name} (did you mean {suffixes[close[0]]}?)" if close else name)
    plural = "s" if len(named) > 1 else ""
    guessed = all("did you mean" in n for n in named)
    known = "" if guessed else f"; pglease reads {', '.join(USER_ENV)}"
    raise ConfigurationError(f"unknown environment variable{plural} {', '.join(named)}{known}")


def resolve_dsn_source(dsn: str | None = None, *, quiet: bool = False) -> tuple[str, DsnSource]:
    """The DSN to connect with and where it came from.

    Without `dsn` the environment decides, after `check_environment`: an
    unknown ``PGLEASE_*`` variable raises `ConfigurationError`. `quiet`: the
    embedded server's start is not announced on stderr (the caller says so).
    """
    if dsn:
        return check_dsn(dsn), "argument"
    check_environment()
    from_env = os.environ.get(ENV_DSN)
    if from_env:
        return check_dsn(from_env), "PGLEASE_DSN"
    if libpq_env_set():
        # An empty conninfo makes libpq apply PGHOST, PGSERVICE, ... itself.
        return "", "libpq-env"
    from .embedded import embedded_dsn

    return embedded_dsn(quiet=quiet), "embedded"


def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN to connect with (see `resolve_dsn_source`)."""
    return resolve_dsn_source(dsn)[0]
