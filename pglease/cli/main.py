"""The `pglease` command line: scriptable (``--json``), with meaningful exit codes.

Exit codes (the same for every command; README "CLI"): 0 success, 1 error,
2 usage or bad input (also an unknown resource, session or entry, or a schema
with no pglease tables), 3 held by
another owner, 4 lease no longer current or revision stale, 5 watch cursor
cannot resume here, 75 lease lost while `hold`/`elect` ran the command.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import psycopg
import psycopg.errors

from .. import __version__
from ..dsn import check_environment, redact_text
from ..durations import duration_arg
from ..errors import (
    PgleaseError,
)
from ..validation import check_ttl
from . import doctor as doctor_cli
from . import elect as elect_cli
from . import embedded as embedded_cli
from . import hold as fleet_cli
from . import sessions as sessions_cli
from . import top as top_cli
from . import watch as watch_cli
from .leases import cmd_claim, cmd_migrate, cmd_release, cmd_renew, cmd_revoke
from .reads import LS_PAGE_SIZE, cmd_events, cmd_get, cmd_ls, cmd_status
from .support import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    error_code,
    fail,
    note_embedded,
    owner_arg,
    print_json,
    read_token,
    resolve_connection,
)

#: Namespace attribute naming the (sub)parser whose arguments were left unrecognized.
_LEFTOVER_PARSER = "_pglease_leftover_parser"


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors that suggest the close match.

    A usage error prints ``pglease: error: MESSAGE (try 'pglease CMD --help')``
    on stderr and exits 2, without argparse's multi-line usage block; a
    misspelt option or command names the one that was probably meant.
    ``--help`` is unchanged.
    """

    def error(self, message: str) -> NoReturn:
        """Print the error as one line and exit 2 (the usage error code)."""
        one_line = " ".join(message.split())
        self.exit(EXIT_USAGE, f"pglease: error: {one_line} (try '{self.prog} --help')\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        # A subcommand's leftovers reach the top parser, which no longer knows
        # whose options they missed: the innermost parser records itself first.
        if extras and not hasattr(parsed, _LEFTOVER_PARSER):
            setattr(parsed, _LEFTOVER_PARSER, self)
        return parsed, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        owner = getattr(parsed, _LEFTOVER_PARSER, self)
        if hasattr(parsed, _LEFTOVER_PARSER):
            delattr(parsed, _LEFTOVER_PARSER)
        if extras:
            owner.error(_unrecognized(owner, extras))
        return parsed

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is None or value in choices:
            return
        names = [str(c) for c in choices]
        close = difflib.get_close_matches(str(value), names, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        if isinstance(action, argparse._SubParsersAction):
            # The --help hint error() adds lists the commands.
            raise argparse.ArgumentError(None, f"unknown command {value!r}{guess}")
        if not guess:
            guess = " (choose from " + ", ".join(map(repr, names)) + ")"
        raise argparse.ArgumentError(action, f"invalid choice: {value!r}{guess}")


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """'unrecognized argument --ownr (did you mean --owner?)', for each leftover."""
    options = [s for a in parser._actions for s in a.option_strings if a.help != argparse.SUPPRESS]
    options += [s for a in parser._actions for s in a.option_strings if s not in options]
    guesses: dict[str, str] = {}
    for extra in extras:
        word = extra.partition("=")[0]
        if word.startswith("-") and (close := difflib.get_close_matches(word, options, n=1)):
            guesses[word] = close[0]
    noun = "argument" if len(extras) == 1 else "arguments"
    message = f"unrecognized {noun}: {' '.join(extras)}"
    if len(guesses) == 1:
        return f"{message} (did you mean {next(iter(guesses.values()))}?)"
    if guesses:
        pairs = ", ".join(f"{right} for {wrong}" for wrong, right in guesses.items())
        return f"{message} (did you mean {pairs}?)"
    return message


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.fleet import print_report, report_json, run_demo

    note_embedded(args)
    dsn = args.dsn
    out = sys.stderr if args.json else sys.stdout
    # The demo gets a schema of its own, recreated on every run.
    report = run_demo(
        dsn,
        schema=f"{args.schema}_demo",
        hosts=args.hosts,
        resources=args.resources,
        seconds=args.seconds,
        ttl=args.ttl,
        out=out,
    )
    if args.json:
        print_json(report_json(report))
    else:
        print_report(report)
    return EXIT_OK if report.ok else EXIT_ERROR


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell), end="")
    return EXIT_OK


def _register_completion(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "completion",
        help="print a shell completion script (bash or zsh)",
        description="Print the completion script for SHELL. bash: pglease completion bash >"
        " ~/.pglease-completion.bash, then source that file from ~/.bashrc; zsh: pglease"
        " completion zsh > ~/.zfunc/_pglease, with ~/.zfunc on $fpath before compinit.",
    )
    p.add_argument("shell", choices=["bash", "zsh"])
    # connects=False: printing a script must not resolve a DSN or start a server.
    p.set_defaults(func=cmd_completion, connects=False)


def _lease_args(parser: argparse.ArgumentParser, *, ttl: bool, token: bool) -> None:
    parser.add_argument("type", help="resource type, e.g. run")
    parser.add_argument("key", help="resource key")
    parser.add_argument("--owner", type=owner_arg, required=True, help="OWNER_TYPE:OWNER_ID")
    if ttl:
        parser.add_argument(
            "--ttl",
            type=duration_arg("ttl", check_ttl),
            required=True,
            metavar="DURATION",
            help="lease length: 30 (seconds), 1.5s, 250ms, 5m, 1h",
        )
    if token:
        # Not required here: the token may come from --token-file or $PGLEASE_TOKEN.
        source = parser.add_mutually_exclusive_group()
        source.add_argument(
            "--token",
            help="the token printed by claim (visible to `ps`: prefer --token-file);"
            " write --token=VALUE for an older token that starts with -",
        )
        source.add_argument(
            "--token-file",
            metavar="FILE",
            help="read the token from FILE ('-' for stdin); default $PGLEASE_TOKEN",
        )
        parser.add_argument(
            "--generation",
            type=int,
            help="the claim's generation (default: the current one; the token still has to match)",
        )
    parser.add_argument("--expected-revision", type=int, help="refuse unless at this revision")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 0 to 65535, got {value}")
    return value


def _metrics_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="N",
        help="serve Prometheus metrics at http://ADDR:N/metrics while it runs (0: a free"
        " port, printed on stderr; needs pip install 'pglease[metrics]')",
    )
    parser.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default 127.0.0.1)",
    )


def _call(args: argparse.Namespace) -> int:
    """Run the command, with a metrics endpoint around it when --metrics-port is given."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        code: int = args.func(args)
        return code
    # Imported only here: without the extra this raises MetricsUnavailableError.
    from .. import metrics

    with metrics.serve(port, args.metrics_addr) as server:
        print(f"pglease: metrics at {server.url}", file=sys.stderr, flush=True)
        code = args.func(args)
        return code


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pglease", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dsn",
        help="PostgreSQL DSN (default: $PGLEASE_DSN, else libpq's PGHOST, PGSERVICE, ...,"
        " else the embedded server)",
    )
    parser.add_argument(
        "--schema",
        default=os.environ.get("PGLEASE_SCHEMA", "pglease"),
        help="schema holding pglease's tables (default: pglease)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--version", action="version", version=f"pglease {__version__}")
    parser.add_argument(
        "--pooler",
        action="store_true",
        default=os.environ.get("PGLEASE_POOLER", "") == "transaction",
        help="the DSN goes through a transaction-pooling PgBouncer (no prepared statements,"
        " no session state, watchers poll); also $PGLEASE_POOLER=transaction",
    )
    parser.add_argument(
        "--no-migrate",
        action="store_true",
        help="never apply migrations implicitly (read-only commands never do)",
    )
    # Typed as plain ArgumentParser subparsers, which the command modules take;
    # the parsers it makes are still `Parser`s (argparse uses the parent's class).
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND"),
    )

    p = sub.add_parser(
        "migrate",
        help="apply pending schema migrations (as the schema's owner); grant pglease roles",
    )
    p.add_argument(
        "--grant-client",
        action="append",
        metavar="ROLE",
        help="let ROLE claim, renew, release, mutate and watch (repeatable)",
    )
    p.add_argument(
        "--grant-reader",
        action="append",
        metavar="ROLE",
        help="let ROLE read resources, events and sessions, and watch (repeatable)",
    )
    p.add_argument(
        "--revoke", action="append", metavar="ROLE", help="take every pglease privilege from ROLE"
    )
    p.set_defaults(func=cmd_migrate)
    p = sub.add_parser("claim", help="claim a lease (exit 3 when held by another owner)")
    _lease_args(p, ttl=True, token=False)
    p.set_defaults(func=cmd_claim)
    p = sub.add_parser("renew", help="renew a lease (exit 4 when no longer current)")
    _lease_args(p, ttl=True, token=True)
    p.set_defaults(func=cmd_renew)
    p = sub.add_parser("release", help="release a lease (exit 4 when no longer current)")
    _lease_args(p, ttl=False, token=True)
    p.set_defaults(func=cmd_release)
    p = sub.add_parser(
        "ls",
        help="list resources with revision, holder and time left",
        description="List resources in (type, key) order, read in pages, each printed as it"
        " arrives. Held and time left are judged by the database clock.",
    )
    p.add_argument("--type", help="only this resource type")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--held", action="store_true", help="only resources with a live lease")
    which.add_argument("--free", action="store_true", help="only free or expired resources")
    p.add_argument("--owner", type=owner_arg, metavar="T:ID", help="only the live leases of T:ID")
    p.add_argument(
        "--expiring-within",
        type=duration_arg("--expiring-within"),
        metavar="DURATION",
        help="only live leases ending within DURATION (30s, 5m)",
    )
    p.add_argument("--limit", type=_positive_int, metavar="N", help="at most N resources")
    p.add_argument("--page-size", type=_positive_int, default=LS_PAGE_SIZE, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser(
        "get", help="one resource: its lease, time left, revision and last event (exit 2: unknown)"
    )
    p.add_argument("type")
    p.add_argument("key")
    p.set_defaults(func=cmd_get)
    p = sub.add_parser(
        "status",
        help="server, migrations, whether writes go through (a claim, rolled back), counts, event"
        " log, test clock and watcher hubs (exit 1: writes fail)",
    )
    p.add_argument(
        "--within",
        type=duration_arg("--within"),
        default=30.0,
        metavar="DURATION",
        help="count leases expiring within DURATION (default 30s)",
    )
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "revoke",
        help="end a stuck lease as the schema's owner: its holder is fenced (generation + 1)",
    )
    p.add_argument("type")
    p.add_argument("key")
    p.set_defaults(func=cmd_revoke)
    p = sub.add_parser("events", help="a resource's event history")
    p.add_argument("type")
    p.add_argument("key")
    p.add_argument("--after-revision", type=int, default=0)
    p.set_defaults(func=cmd_events)
    p = sub.add_parser("demo", help="run a small fleet on the embedded PostgreSQL and check it")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--resources", type=int, default=3)
    p.add_argument("--seconds", type=duration_arg("--seconds"), default=12.0, metavar="DURATION")
    p.add_argument("--ttl", type=duration_arg("ttl", check_ttl), default=1.0, metavar="DURATION")
    p.set_defaults(func=cmd_demo)
    fleet_cli.register(sub)
    elect_cli.register(sub)
    embedded_cli.register(sub)
    watch_cli.register(sub)
    sessions_cli.register(sub)
    doctor_cli.register(sub)
    top_cli.register(sub)
    _register_completion(sub)
    for name in ("hold", "reap", "watch"):
        _metrics_args(sub.choices[name])
    for command in sub.choices.values():
        # Accept --json after the subcommand too: `pglease ls --json`.
        command.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


#: Exit code after a closed stdout (`pglease ls | head -1`): 128 + SIGPIPE, as
#: the shell reports a command killed by the signal.
EXIT_BROKEN_PIPE = 141

#: What a read-only command meets on a schema that was never migrated.
_UNMIGRATED = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.InvalidSchemaName,
)


def _run(args: argparse.Namespace) -> int:
    def failed(message: str, code: int) -> int:
        return fail(redact_text(message, args.dsn), code)

    try:
        check_environment()  # every command: a misspelt PGLEASE_* is never ignored
        if hasattr(args, "token_file"):
            args.token = read_token(args.token, args.token_file)
        if getattr(args, "connects", True):  # `embedded status` must not start a server
            resolve_connection(args)
        code = _call(args)
        sys.stdout.flush()  # inside the try: a closed pipe must fail here, not at exit
    except PgleaseError as exc:
        return failed(str(exc), error_code(exc))
    except _UNMIGRATED as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return failed(
            f"database error: {first} (is schema {args.schema} migrated? run `pglease migrate`)",
            EXIT_ERROR,
        )
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return failed(f"database error: {first}", EXIT_ERROR)
    except KeyboardInterrupt:
        return 130
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code. Never ends in a traceback for
    expected faults (bad input, database errors, a closed stdout, Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        # The reader went away (`| head`). Point stdout at /dev/null so the
        # interpreter's final flush cannot raise again (Python docs, "Note on SIGPIPE").
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
