"""`ls` in keyset pages: the same rows, in the same order, whatever the page size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pglease import Owner, PostgresStore
from pglease.cli import main
from pglease.listing import iter_resources

A = Owner("host", "a")
B = Owner("host", "b")

#: Keys chosen to trip a keyset scan: shared prefixes, a space, a slash,
#: letter case and a non-ASCII letter, whose order the database's collation decides.
KEYS = ["a", "a b", "a/b", "ab", "B", "b", "é", "k1", "k10", "k2"]


@pytest.fixture
def fleet(pg_store: PostgresStore) -> PostgresStore:
    """10 resources of type run, 3 of type job; some held by A or B, one expired, some free."""
    for key in KEYS:
        pg_store.ensure_resource("run", key)
    for key in ("x", "y", "z"):
        pg_store.ensure_resource("job", key)
    for key, owner, ttl in (("a", A, 600), ("ab", B, 600), ("é", A, 5), ("k2", B, 5)):
        assert pg_store.claim(pg_store.ensure_resource("run", key), owner, ttl) is not None
    assert pg_store.claim(pg_store.ensure_resource("job", "y"), A, 600) is not None
    # Expired an hour ago (the test clock places the claim): recorded, not held.
    past = pg_store.get(pg_store.ensure_resource("run", "k1")).updated_at - timedelta(hours=1)
    assert pg_store.claim(pg_store.ensure_resource("run", "k1"), A, 1, now=past) is not None
    return pg_store


def ids(items: Iterator[Any]) -> list[str]:
    return [i.state.id for i in items]


def test_pages_match_a_single_ordered_query(fleet: PostgresStore) -> None:
    expected = [s.id for s in fleet.list_resources()]  # one ORDER BY r.type, r.key
    assert len(expected) == 13
    for page_size in (1, 3, 5, 13, 1000):
        assert ids(iter_resources(fleet, fleet.schema, page_size=page_size)) == expected
    typed = [s.id for s in fleet.list_resources("run")]
    assert ids(iter_resources(fleet, fleet.schema, resource_type="run", page_size=3)) == typed


def test_filters_across_pages(fleet: PostgresStore) -> None:
    states = {s.id: s for s in fleet.list_resources()}
    everything = [s.id for s in fleet.list_resources()]

    def listed(**filters: Any) -> list[str]:
        return ids(iter_resources(fleet, fleet.schema, page_size=3, **filters))

    held = [i for i in everything if states[i].lease.held]
    assert len(held) == 5
    assert listed(held=True) == held
    assert listed(held=False) == [i for i in everything if not states[i].lease.held]
    owned = [i for i in held if states[i].lease.owner == A]
    assert listed(owner=A) == owned and len(owned) == 3  # not k1: its lease expired
    soon = [i for i in held if states[i].type == "run" and states[i].key in ("é", "k2")]
    assert listed(expiring_within=60) == soon
    assert listed(owner=B, expiring_within=60) == [i for i in soon if states[i].lease.owner == B]
    assert listed(resource_type="job", held=True) == [i for i in held if states[i].type == "job"]
    assert listed(limit=7) == everything[:7]
    assert listed(limit=3) == everything[:3]
    assert listed(held=True, limit=4) == held[:4]


def test_pages_are_read_lazily_one_connection_each(fleet: PostgresStore) -> None:
    borrowed = 0

    @contextmanager
    def counting() -> Iterator[psycopg.Connection[Any]]:
        nonlocal borrowed
        borrowed += 1
        with fleet.connection() as conn:
            yield conn

    walk = iter_resources(counting, fleet.schema, page_size=3)
    first = next(walk)
    assert borrowed == 1 and first.now is not None
    rest = list(walk)
    assert len(rest) == 12
    # 13 rows in pages of 3: 5 pages, the last one short.
    assert borrowed == 5


def test_bad_page_size_and_limit(fleet: PostgresStore) -> None:
    with pytest.raises(ValueError, match="page_size"):
        list(iter_resources(fleet, fleet.schema, page_size=0))
    with pytest.raises(ValueError, match="limit"):
        list(iter_resources(fleet, fleet.schema, limit=0))


def ls(pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code = main(["--dsn", pg_dsn, "--schema", schema, "--json", "ls", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_cli_ls_paged_json_is_one_array_in_the_same_order(
    fleet: PostgresStore, pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = ls(pg_dsn, schema, capsys)
    assert [r["id"] for r in whole] == [s.id for s in fleet.list_resources()]

    def timeless(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "time_left"} for r in rows]

    assert timeless(ls(pg_dsn, schema, capsys, "--page-size", "3")) == timeless(whole)
    # The order is the database's (its collation), so expectations come from it.
    order = [(s.type, s.key) for s in fleet.list_resources() if s.lease.held]
    held = ls(pg_dsn, schema, capsys, "--held", "--page-size", "3")
    assert [(r["type"], r["key"]) for r in held] == order
    assert sorted(r["key"] for r in held) == sorted(["y", "a", "ab", "é", "k2"])
    assert all(r["holder"] for r in held)
    free = ls(pg_dsn, schema, capsys, "--free", "--page-size", "2")
    assert len(free) == 8 and not any(r["holder"] for r in free)
    owned = [k for t, k in order if k in ("ab", "k2")]
    assert [r["key"] for r in ls(pg_dsn, schema, capsys, "--owner", "host:b")] == owned
    soon = ls(pg_dsn, schema, capsys, "--expiring-within", "1m", "--type", "run")
    assert [r["key"] for r in soon] == [k for t, k in order if k in ("é", "k2")]
    assert len(ls(pg_dsn, schema, capsys, "--limit", "4", "--page-size", "3")) == 4
    assert ls(pg_dsn, schema, capsys, "--type", "none") == []


def test_cli_ls_table_prints_every_page(
    fleet: PostgresStore, pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--dsn", pg_dsn, "--schema", schema, "ls", "--page-size", "3"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("TYPE") and len(lines) == 14
    assert [line.split()[0] for line in lines[1:]] == ["job"] * 3 + ["run"] * 10


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--held", "--free"], "not allowed with argument"),
        (["--free", "--owner", "host:a"], "--free cannot be combined"),
        (["--expiring-within", "soon"], "is not a duration"),
        (["--expiring-within=-5s"], "must be zero or more"),
        (["--limit", "0"], "must be at least 1"),
        (["--owner", "nocolon"], "owner"),
    ],
)
def test_cli_ls_bad_flags_exit_2(
    fleet: PostgresStore,
    pg_dsn: str,
    schema: str,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    try:
        code = main(["--dsn", pg_dsn, "--schema", schema, "ls", *args])
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    assert code == 2
    assert message in captured.err and captured.out == ""
