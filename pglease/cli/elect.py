"""`pglease elect`, `pglease leader` and `pglease resign`: leader election from a shell.

``elect NAME --owner T:ID --ttl D`` campaigns for the leadership of NAME (the
lease on ``election/NAME``; its generation is the term). Without a command it
prints a line when elected (``--json``: ``{"event": "elected", "name", "leader",
"generation"}``) and stays leader until SIGINT/SIGTERM, then resigns (releases
the lease, so the next candidate is elected at once) and exits 0. When the
leadership is lost (revoked, or the trust window closed) it prints a
``deposed`` line and exits 75.

``elect NAME ... -- CMD ARGS`` runs CMD while leader, with `pglease hold`'s
runner and guarantee: the command, with every process it started in its
process group, is dead before anyone else can be elected (SIGTERM
``--kill-after`` before the trust window closes, SIGKILL when it closes; at
once when the term was resigned or taken), and ``PGLEASE_FENCE`` holds the
term. Exit codes as for `hold`: the command's own, 75 when leadership was
lost, 127 not found, 126 cannot run (both checked before campaigning), 3 when
``--timeout`` ran out before being elected.

``leader NAME`` prints the current leader and term by the database clock; it
exits 3 when there is none (so ``pglease leader x && ...`` reads naturally).

``resign NAME`` is the operator's action, as the schema's owner: it revokes
the current term (`pglease.admin.revoke_lease` on ``election/NAME``), so the
leader is fenced at once; whoever campaigns next is elected once the revoked
term's last expiry has passed (by then the old leader's runner has stopped its
command). A leader resigns itself by getting SIGTERM: it releases, so the
next is elected at once; resigning needs no token on the command line that
way.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ..durations import duration_arg
from ..errors import UnknownResourceError
from ..ids import resource_id
from ..runtime._timing import Timing
from ..runtime.election import ELECTION_TYPE, Election
from ..runtime.lease import HeldLease
from ..validation import check_ttl
from . import hold as hold_cli
from .support import (
    EXIT_HELD,
    EXIT_OK,
    bounded_write,
    connect_direct,
    dsn_source,
    fail,
    note_embedded,
    open_store,
    owner_arg,
    print_json,
)

#: `leader` when nobody leads; also `elect --timeout` running out (as `hold`).
EXIT_NO_LEADER = 3
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def register(subparsers: Any) -> None:
    """Add `elect`, `leader` and `resign` to the `pglease` parser."""
    p = subparsers.add_parser(
        "elect",
        help="campaign for leadership of NAME; optionally run a command while leader",
        usage="pglease elect NAME --owner T:ID --ttl DURATION [options] [-- CMD ARGS...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="election name, e.g. scheduler")
    p.add_argument("--owner", type=owner_arg, required=True, help="OWNER_TYPE:OWNER_ID")
    p.add_argument(
        "--ttl",
        type=duration_arg("ttl", check_ttl),
        required=True,
        metavar="DURATION",
        help="lease length of a term: 10 (seconds), 10s, 1m",
    )
    p.add_argument(
        "--timeout",
        type=duration_arg("--timeout"),
        metavar="DURATION",
        help="give up when not elected within DURATION (exit 3)",
    )
    p.add_argument("--fair", action="store_true", help="elect candidates in arrival order")
    p.add_argument(
        "--interval", type=duration_arg("--interval"), metavar="DURATION", help="renew interval"
    )
    p.add_argument(
        "--margin", type=duration_arg("--margin"), metavar="DURATION", help="local safety margin"
    )
    p.add_argument(
        "--kill-after",
        type=duration_arg("--kill-after"),
        metavar="DURATION",
        help="with a command: SIGTERM this long before the trust window closes (as `hold`)",
    )
    command = p.add_argument(
        "command", nargs="+", metavar="-- CMD", help="-- COMMAND ARGS... to run while leader"
    )
    # Optional, yet "+", not "*": a "*" positional matches nothing right after
    # NAME (before the options) and leaves the words after -- unrecognised.
    command.required = False
    p.set_defaults(func=cmd_elect)

    p = subparsers.add_parser(
        "leader", help="the current leader of NAME and its term (exit 3 when none)"
    )
    p.add_argument("name")
    p.set_defaults(func=cmd_leader)

    p = subparsers.add_parser(
        "resign",
        help="(owner) end the current term of NAME: the leader is fenced, the next is elected",
    )
    p.add_argument("name")
    p.set_defaults(func=cmd_resign)


def _announce(args: argparse.Namespace, event: str, lease: HeldLease) -> None:
    if args.json:
        print_json(
            {
                "event": event,
                "name": args.name,
                "leader": str(lease.owner),
                "generation": lease.generation,
            }
        )
    else:
        print(
            f"{event}: {args.name} leader {lease.owner}, generation {lease.generation}",
            flush=True,
        )


def _loss_reason(lease: HeldLease) -> str:
    """Why the lease was lost, without the lease's own description (the line
    that reports it names the election and the generation already)."""
    error = lease.lost_error
    if error is None:
        return "lost"
    text = " ".join(str(error).split())
    return text.partition(" is lost: ")[2] or text


def cmd_elect(args: argparse.Namespace) -> int:
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    resource_id(ELECTION_TYPE, args.name)  # a bad name is exit 2 before anything runs
    if command:
        # The runner of `hold`, on the election's lease: one stop schedule to trust.
        held = argparse.Namespace(**vars(args))
        held.type, held.key, held.command = ELECTION_TYPE, args.name, command
        code: int = hold_cli.cmd_hold(held)
        return code
    return _campaign(args)


def _campaign(args: argparse.Namespace) -> int:
    """Lead until a signal (resign, 0) or a loss (75); 3 when --timeout runs out."""
    timing = Timing.of(args.ttl, args.interval, args.margin)  # bad settings: exit 2
    done = threading.Event()
    # Set when elected or stopped: what the --timeout wait waits for.
    settled = threading.Event()
    deposed: list[HeldLease] = []
    stopped: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopped.append(signum)
        done.set()
        settled.set()

    def on_elected(lease: HeldLease) -> None:
        _announce(args, "elected", lease)
        settled.set()

    def on_deposed(lease: HeldLease) -> None:
        if not stopped:  # a loss, not our own resignation
            deposed.append(lease)
            # Called on the election thread: stopping here keeps it from
            # campaigning again before this process exits 75.
            election.stop(resign=False)
            done.set()

    previous = {s: signal.signal(s, on_signal) for s in _SIGNALS}
    try:
        with hold_cli.quiet_loss_log(), open_store(args) as store:
            election = Election(
                store, args.name, args.owner, ttl=timing.ttl, interval=timing.interval,
                margin=timing.margin, fair=args.fair,
                on_elected=on_elected,
                on_deposed=on_deposed,
            ).start()  # fmt: skip
            try:
                # The timeout only bounds the wait for the first election.
                timed_out = args.timeout is not None and not settled.wait(args.timeout)
                if timed_out and not stopped:
                    election.stop(resign=True)
                    return fail(
                        f"not elected leader of {args.name} within {args.timeout:g}s", EXIT_HELD
                    )
                done.wait()
                lease = election.lease
            finally:
                # Resign on a signal; after a loss there is nothing left to release.
                election.stop(resign=not deposed)
            if deposed:
                _announce(args, "deposed", deposed[0])
                print(
                    f"pglease: lost the leadership of {args.name} (generation"
                    f" {deposed[0].generation}): {_loss_reason(deposed[0])}",
                    file=sys.stderr,
                    flush=True,
                )
                return hold_cli.EXIT_LEASE_LOST
            if lease is not None:
                _announce(args, "resigned", lease)
            return EXIT_OK
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def cmd_leader(args: argparse.Namespace) -> int:
    rid = resource_id(ELECTION_TYPE, args.name)
    with open_store(args, read_only=True) as store:
        try:
            state = store.get(rid)
        except UnknownResourceError:
            state = None
        with store.connection() as conn:
            row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    now = row[0]
    lease = state.lease if state is not None else None
    held = lease is not None and lease.held and lease.owner is not None
    view: dict[str, object] = {
        "name": args.name,
        "leader": str(lease.owner) if held and lease is not None else None,
        "generation": lease.generation if lease is not None else 0,
        "expires_at": lease.expires_at.isoformat()
        if held and lease is not None and lease.expires_at
        else None,
        "seconds_left": round((lease.expires_at - now).total_seconds(), 3)
        if held and lease is not None and lease.expires_at
        else None,
    }
    if args.json:
        print_json(view)
    elif held:
        print(
            f"{args.name}: leader {view['leader']}, generation {view['generation']},"
            f" term expires {view['expires_at']} ({view['seconds_left']}s left unless renewed)"
        )
    else:
        print(f"{args.name}: no leader (last generation {view['generation']})")
    return EXIT_OK if held else EXIT_NO_LEADER


def cmd_resign(args: argparse.Namespace) -> int:
    from ..admin import revoke_lease
    from ..migrations import migration_state

    rid = resource_id(ELECTION_TYPE, args.name)
    note_embedded(args)
    # A direct connection: revoke_lease is the schema owner's, outside any store.
    with connect_direct(args) as conn:
        state = migration_state(conn, args.schema)
        if not state.up_to_date:
            raise state.not_migrated_error("resign never migrates")
        try:
            with bounded_write(conn, "resign", rid):
                done = revoke_lease(conn, args.schema, rid)
        except UnknownResourceError:
            raise UnknownResourceError(
                f"unknown election {args.name} (nobody ever campaigned there)"
            ) from None
    if args.json:
        print_json(
            {
                "name": args.name,
                "resigned": done.revoked,
                "fenced": str(done.holder) if done.revoked and done.holder else None,
                "generation": done.generation,
                "electable_at": done.claimable_at.isoformat() if done.claimable_at else None,
                "dsn_source": dsn_source(args),
            }
        )
    elif done.revoked:
        print(
            f"{args.name}: {done.holder} is no longer leader (generation"
            f" {done.generation - 1} ended, fenced); the next candidate is elected"
            + (
                f" from {done.claimable_at.isoformat()} (the ended term's last expiry)"
                if done.claimable_at is not None
                else ""
            )
        )
    else:
        print(f"{args.name}: no leader; nothing to resign (generation {done.generation})")
    return EXIT_OK
