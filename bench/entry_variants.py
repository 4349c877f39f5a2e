"""Build the entry variants of issue 24 item 1 as sql/ trees, for
`bench/server_cost.py --variant NAME=DIR` (measurement only, never migrated).

    .venv/bin/python bench/entry_variants.py /tmp/entry   # writes /tmp/entry/<name>/
    .venv/bin/python bench/server_cost.py --floor --cpu 3000 --rounds 6 \\
        --variant v_sqlent=/tmp/entry/v_sqlent --variant v_nosp=/tmp/entry/v_nosp ...

Each is a copy of this tree's sql/ with claim and release changed:
  v_nosp    claim/release without `SET search_path` (the price of the pin; NOT
            safe as written: its body calls unqualified functions/operators)
  v_nocoal  the hot statements bump `x.revision + 1` without the fallback to a
            row not moved by migration 0018 (the price of that compatibility)
  v_sqlent  claim/release as LANGUAGE sql SECURITY DEFINER: the hot statement,
            the refusal read and the cold function in one UNION ALL, the cold
            one gated by NOT EXISTS (the plpgsql entry's IF FOUND)
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

SQL = Path(__file__).resolve().parent.parent / "sql"
PIN = "SET search_path = pg_catalog, pg_temp AS $$"
COAL = re.compile(
    r"coalesce\(x\.revision, \(SELECT r\.revision FROM @schema@\.resources r\s+"
    r"WHERE r\.id = x\.resource_id\)\) \+ 1"
)
NOTIFY = """CASE WHEN NOT pg_try_advisory_xact_lock_shared(hashtext('pglease.skip'),
                                                 hashtext('@schema@'))
       THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
       WHEN pg_try_advisory_xact_lock(hashtext('pglease.notify'), hashtext('@schema@'))
       THEN pg_notify(left('pglease_@schema@', 63), '') IS NOT NULL
       ELSE true END"""


def _function(text: str, name: str) -> tuple[int, int]:
    start = text.index(f"CREATE OR REPLACE FUNCTION @schema@.{name}(")
    end = text.index("END $$;", start) + len("END $$;")
    return start, end


def _edit(text: str, name: str, edit: object) -> str:
    start, end = _function(text, name)
    assert callable(edit)
    return text[:start] + edit(text[start:end]) + text[end:]


def _hot(body: str) -> str:
    """The hot statement of a plpgsql entry (WITH ... up to its SELECT list)."""
    return body[body.index("WITH g AS (") :]


def sql_entries(core: str) -> str:
    """claim and release as LANGUAGE sql, built from the plpgsql entries' statements."""
    c0, c1 = _function(core, "claim")
    claim = core[c0:c1]
    head = claim[: claim.index("LANGUAGE plpgsql")]
    grant = claim[claim.index("WITH g AS (") : claim.index("        -- The wake-up election")]
    grant = grant.replace(
        "WHERE x.resource_id = p_resource\n",
        "WHERE x.resource_id = p_resource AND p_expected_revision IS NULL\n"
        "               AND pg_current_xact_id_if_assigned() IS NULL\n",
        1,
    )
    refusal = claim[
        claim.index("        SELECT false, l.generation,") : claim.index("          INTO claimed")
    ]
    claim_sql = (
        head
        + "LANGUAGE sql SECURITY DEFINER\n"
        + PIN
        + "\n"
        + grant.rstrip().rstrip(",")
        + ",\n"
        + "    h AS (SELECT true AS c, g.generation, g.expires_at, e.revision,\n"
        + "                 p_owner_type, p_owner_id\n"
        + "            FROM g, e WHERE "
        + NOTIFY
        + "),\n"
        + "    r AS ("
        + refusal.replace("l.owner_type, l.owner_id, false", "l.owner_type, l.owner_id")
        + "           AND p_expected_revision IS NULL)\n"
        + "SELECT * FROM h UNION ALL SELECT * FROM r\n"
        + "UNION ALL SELECT c.claimed, c.generation, c.expires_at, c.revision,\n"
        + "                 c.holder_type, c.holder_id\n"
        + "  FROM @schema@._claim_cold(p_resource, p_owner_type, p_owner_id, p_token_sha256,\n"
        + "                            p_ttl, p_expected_revision, p_now) c\n"
        + " WHERE NOT EXISTS (SELECT FROM h) AND NOT EXISTS (SELECT FROM r)\n$$;"
    )
    r0, r1 = _function(core, "release")
    release = core[r0:r1]
    head = release[: release.index("LANGUAGE plpgsql")]
    grant = release[release.index("WITH g AS (") : release.index("        SELECT e.revision,")]
    grant = grant.replace(
        "WHERE x.resource_id = p_resource\n",
        "WHERE x.resource_id = p_resource AND p_expected_revision IS NULL\n"
        "               AND pg_current_xact_id_if_assigned() IS NULL\n",
        1,
    )
    release_sql = (
        head
        + "LANGUAGE sql SECURITY DEFINER\n"
        + PIN
        + "\n"
        + grant.rstrip().rstrip(",")
        + ",\n"
        + "    h AS (SELECT e.revision FROM g, e WHERE "
        + NOTIFY
        + ")\n"
        + "SELECT h.revision FROM h\n"
        + "UNION ALL SELECT @schema@._release_cold(p_resource, p_owner_type, p_owner_id,\n"
        + "    p_generation, p_token_sha256, p_expected_revision, p_now)\n"
        + " WHERE NOT EXISTS (SELECT FROM h)\n$$;"
    )
    # Replaced by CREATE OR REPLACE of the same signature (this file is
    # applied after 10_core.sql); dropped first all the same, for clarity.
    return (
        "DROP FUNCTION @schema@.claim(text, text, text, bytea, double precision, bigint,\n"
        "                             timestamptz);\n"
        + claim_sql + "\n"
        + "DROP FUNCTION @schema@.release(text, text, text, bigint, bytea, bigint, timestamptz);\n"
        + release_sql + "\n"
    )  # fmt: skip


PROBES = {
    "v_nopfk": "ALTER TABLE @schema@.events DROP CONSTRAINT events_payload_sha256_fkey;",
    "v_notrig": "DROP TRIGGER events_fence_at_commit ON @schema@.events;",
    "v_nopidx": "DROP INDEX @schema@.events_payload;",
    "v_nolfk": "ALTER TABLE @schema@.leases DROP CONSTRAINT leases_resource_id_fkey;",
}


def _no_refusal_branch(body: str) -> str:
    start = body.index("        UNION ALL\n        SELECT false, l.generation,")
    end = body.index("          INTO claimed, generation, expires_at, revision,", start)
    return body[:start] + body[end:]


def build(out: Path) -> None:
    core_path = "functions/10_core.sql"
    for name in ("v_nosp", "v_nocoal", "v_sqlent", "v_norefuse", *PROBES):
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(SQL, target)
        core = (target / core_path).read_text()
        if name == "v_nosp":
            for fn in ("claim", "release"):
                core = _edit(core, fn, lambda b: b.replace(PIN, "AS $$"))
        elif name in PROBES:
            (target / "0099_probe.sql").write_text(PROBES[name] + "\n")
        elif name == "v_norefuse":
            core = _edit(core, "claim", _no_refusal_branch)
        elif name == "v_nocoal":
            for fn in ("claim", "release"):
                core = _edit(core, fn, lambda b: COAL.sub("x.revision + 1", b))
        else:
            (target / "functions/99_variant.sql").write_text(sql_entries(core))
        (target / core_path).write_text(core)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
