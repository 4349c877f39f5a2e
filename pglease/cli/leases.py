"""CLI commands that change leases: ``migrate``, ``claim``, ``renew``, ``release``, ``revoke``."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime

from ..errors import (
    UnknownResourceError,
)
from ..ids import resource_id
from ..postgres import PostgresStore
from ..types import Claim, ResourceState
from ..validation import check_optional_revision, check_ttl
from .support import (
    EXIT_HELD,
    EXIT_OK,
    bounded_write,
    connect_direct,
    dsn_source,
    note_embedded,
    open_store,
    print_json,
    require_schema,
)


def _db_now(store: PostgresStore) -> datetime:
    with store.connection() as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def _claim_view(claim: Claim) -> dict[str, object]:
    return {
        "resource_id": claim.resource_id,
        "owner": str(claim.owner),
        "token": claim.token,
        "generation": claim.generation,
        "revision": claim.revision,
        "expires_at": claim.expires_at.isoformat(),
    }


def _print_claim(args: argparse.Namespace, claim: Claim) -> None:
    if args.json:
        print_json({**_claim_view(claim), "dsn_source": dsn_source(args)})
    else:
        for key, value in _claim_view(claim).items():
            print(f"{key}: {value}")


def existing_resource(store: PostgresStore, args: argparse.Namespace) -> ResourceState:
    """The resource named on the command line; never created (reading must not write)."""
    try:
        return store.get(resource_id(args.type, args.key))
    except UnknownResourceError:
        raise UnknownResourceError(
            f"unknown resource {args.type}/{args.key} (nothing was ever claimed there)"
        ) from None


def _current_claim(store: PostgresStore, args: argparse.Namespace) -> Claim:
    """Rebuild a claim from the command line; the token is what proves ownership."""
    state = existing_resource(store, args)
    rid = state.id
    generation = args.generation if args.generation is not None else state.lease.generation
    expires = state.lease.expires_at or state.updated_at
    return Claim(rid, args.owner, args.token, generation, expires, state.revision)


def cmd_migrate(args: argparse.Namespace) -> int:
    # migrate is the explicit form of auto-migration: --no-migrate does not apply.
    note_embedded(args)
    from ..migrations import grant, migrate, move_revisions, revoke
    from ..roles import RoleKind

    # A direct connection: a store refuses to open a schema with pending work.
    with connect_direct(args) as conn:
        applied = [m.label for m in migrate(conn, args.schema)]
        if not applied:
            # Finish a chunked data move an earlier run left unfinished (it
            # is interrupted safely; a no-op when done or for a non-owner).
            move_revisions(conn, args.schema)
        grants: list[tuple[str, RoleKind]] = [(r, "client") for r in args.grant_client or []]
        grants += [(r, "reader") for r in args.grant_reader or []]
        for role, kind in grants:
            grant(conn, args.schema, role, kind)
        for role in args.revoke or []:
            revoke(conn, args.schema, role)
    if args.json:
        print_json(
            {
                "schema": args.schema,
                "applied": applied,
                "granted": [{"role": r, "kind": k} for r, k in grants],
                "revoked": args.revoke or [],
                "dsn_source": dsn_source(args),
            }
        )
    else:
        print(
            f"schema {args.schema}: "
            + (f"applied {', '.join(applied)}" if applied else "up to date")
        )
        for role, kind in grants:
            print(f"granted {kind} to {role}")
        for role in args.revoke or []:
            print(f"revoked every pglease privilege from {role}")
    return EXIT_OK


def cmd_claim(args: argparse.Namespace) -> int:
    # Everything that can refuse the claim is checked before ensure_resource,
    # so a refused claim leaves no resource row behind.
    resource_id(args.type, args.key)
    check_ttl(args.ttl)
    check_optional_revision(args.expected_revision)
    with open_store(args) as store:
        rid = store.ensure_resource(args.type, args.key)
        claim = store.claim(rid, args.owner, args.ttl, args.expected_revision)
        if claim is None:
            state = store.get(rid)
            holder = state.lease
            if args.json:
                print_json(
                    {
                        "claimed": False,
                        "resource_id": rid,
                        "holder": holder.owner,
                        "generation": holder.generation,
                        "expires_at": holder.expires_at,
                        "dsn_source": dsn_source(args),
                    }
                )
            if holder.owner is None:
                # Refused with no holder: revoked, and the revoked holder's last
                # expiry is still ahead (see `pglease revoke`).
                print(
                    f"pglease: {args.type}/{args.key} was revoked (generation"
                    f" {holder.generation}); it cannot be claimed before the revoked"
                    " holder's last expiry",
                    file=sys.stderr,
                )
            else:
                until = "-" if holder.expires_at is None else holder.expires_at.isoformat()
                print(
                    f"pglease: {args.type}/{args.key} is held by {holder.owner} (generation "
                    f"{holder.generation}) until {until}",
                    file=sys.stderr,
                )
            return EXIT_HELD
        _print_claim(args, claim)
    return EXIT_OK


def cmd_renew(args: argparse.Namespace) -> int:
    check_ttl(args.ttl)
    with open_store(args) as store:
        claim = store.renew(_current_claim(store, args), args.ttl, args.expected_revision)
        _print_claim(args, claim)
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        revision = store.release(_current_claim(store, args), args.expected_revision)
    if args.json:
        print_json({"released": True, "revision": revision, "dsn_source": dsn_source(args)})
    else:
        print(f"released; revision {revision}")
    return EXIT_OK


def _claimable(at: datetime | None) -> str:
    """When a revoked lease can be claimed again, as the tail of a line."""
    if at is None:
        return ""
    return f"; claimable again at {at.isoformat()} (the revoked holder's last expiry)"


def cmd_revoke(args: argparse.Namespace) -> int:
    from ..admin import revoke_lease
    from ..migrations import migration_state

    rid = resource_id(args.type, args.key)
    note_embedded(args)
    # A direct connection: revoke_lease is the owner's, outside any store.
    with connect_direct(args) as conn:
        require_schema(conn, args.schema, embedded=dsn_source(args) == "embedded")
        state = migration_state(conn, args.schema)
        if not state.up_to_date:
            raise state.not_migrated_error("revoke never migrates")
        try:
            with bounded_write(conn, "revoke", rid):
                done = revoke_lease(conn, args.schema, rid)
        except UnknownResourceError:
            raise UnknownResourceError(
                f"unknown resource {args.type}/{args.key} (nothing was ever claimed there)"
            ) from None
    if args.json:
        print_json(
            {
                "resource_id": rid,
                "type": args.type,
                "key": args.key,
                "revoked": done.revoked,
                "fenced": str(done.holder) if done.revoked and done.holder else None,
                "generation": done.generation,
                "revision": done.revision,
                "claimable_at": done.claimable_at.isoformat() if done.claimable_at else None,
                "dsn_source": dsn_source(args),
            }
        )
    elif done.revoked:
        print(
            f"revoked {args.type}/{args.key}: {done.holder} is fenced (generation"
            f" {done.generation - 1} ended); generation now {done.generation},"
            f" revision {done.revision}{_claimable(done.claimable_at)}"
        )
    else:
        print(
            f"{args.type}/{args.key} is not held: nothing revoked (generation"
            f" {done.generation}, revision {done.revision})"
        )
    return EXIT_OK
