"""The ``doctor`` subcommand (the checks are `pglease.doctor`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import psycopg

from ..doctor import EXIT_ERROR, doctor
from ..doctor import __doc__ as DOCTOR_HELP
from ..errors import PgleaseError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``doctor`` subcommand to the ``pglease`` parser."""
    # "resolve": the main parser adds its own --json to every subcommand.
    p = subparsers.add_parser(
        "doctor",
        conflict_handler="resolve",
        help="check the server and schema against what pglease assumes (exit 0/1/2)",
        description=DOCTOR_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="one JSON object")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..postgres._core import pooler_mode
    from .support import connect_direct, fail, print_json

    try:
        with connect_direct(args) as conn:
            report = doctor(conn, args.schema, pooler=pooler_mode(getattr(args, "pooler", False)))
    except (PgleaseError, psycopg.Error) as exc:
        # Not reaching the server is an error, not the "warnings" exit 1.
        return fail(f"doctor: {exc}", EXIT_ERROR)
    if getattr(args, "json", False):
        print_json(report.as_dict())
    else:
        for check in report.checks:
            print(f"{check.verdict:<8} {check.name}: {check.detail}")
            if check.advice and check.verdict != "ok":
                print(f"{'':<8} -> {check.advice}")
        sys.stdout.flush()
    return report.exit_code


def main_args(argv: Sequence[str]) -> int:
    """Run ``[--dsn DSN] [--schema S] [--json] doctor [--json]`` without `pglease.cli`."""
    parser = argparse.ArgumentParser(prog="pglease")
    parser.add_argument("--dsn")
    parser.add_argument("--schema", default="pglease")
    parser.add_argument("--json", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(list(argv))
    code: int = args.func(args)
    return code
