"""A full disk (issue 31 item 8): writes fail with SQLSTATE 53100 while every
read still works; `pglease doctor` and `pglease status` say so, and a store's
write raises `DiskFullError`.

The disk is really full: the schema's tables live in a tablespace on a small
tmpfs that the test fills to the last byte (the data directory and its WAL
stay elsewhere, so the server stays up). Mounting needs root and a machine
that allows it; elsewhere the test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pglease import DatabaseError, DiskFullError, Owner, PostgresStore
from pglease.cli import main
from pglease.doctor import doctor
from pglease.doctor.writes import PROBE_TYPE
from pglease.migrations import grant

from . import _pgserver
from ._pgcluster import SERVER_USER


def _counts(conn: psycopg.Connection[Any], schema: str) -> tuple[int, ...]:
    row = conn.execute(
        f'SELECT (SELECT count(*) FROM "{schema}".resources),'
        f' (SELECT count(*) FROM "{schema}".leases),'
        f' (SELECT count(*) FROM "{schema}".events),'
        f""" (SELECT count(*) FROM "{schema}".resources WHERE type = '{PROBE_TYPE}')"""
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_the_write_check_passes_and_leaves_nothing_behind(
    pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with PostgresStore(pg_dsn, schema=schema) as store:
        store.claim(store.ensure_resource("job", "a"), Owner("host", "a"), ttl=30)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        before = _counts(conn, schema)
        assert doctor(conn, schema).by_name("writes").verdict == "ok"
        assert main(["--dsn", pg_dsn, "--schema", schema, "status"]) == 0
        assert "writes:       ok" in capsys.readouterr().out
        assert _counts(conn, schema) == before  # rolled back: no resource, lease or event


@pytest.mark.parametrize(("kind", "verdict"), [("client", "ok"), ("reader", "unknown")])
def test_the_write_check_runs_as_a_client_and_is_not_tried_for_a_reader(
    pg_dsn: str, schema: str, kind: str, verdict: str
) -> None:
    PostgresStore(pg_dsn, schema=schema).close()  # migrated
    name = f"wr_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}"')
        try:
            grant(conn, schema, name, kind)  # type: ignore[arg-type]
            conn.execute(f'SET ROLE "{name}"')
            check = doctor(conn, schema).by_name("writes")
            conn.execute("RESET ROLE")
            assert check.verdict == verdict, check
            if kind == "reader":
                assert "may not claim" in check.detail
            assert _counts(conn, schema)[3] == 0
        finally:
            conn.execute("RESET ROLE")
            conn.execute(f'DROP OWNED BY "{name}"')
            conn.execute(f'DROP ROLE "{name}"')


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs at `where`; None, or why it cannot be done here."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit {done.returncode}"
        return f"cannot mount a tmpfs here (a container without CAP_SYS_ADMIN?): {why}"
    return None


@pytest.fixture
def full_tablespace() -> Iterator[tuple[_pgserver.Server, Path]]:
    """A throwaway server whose default tablespace is a 1 MB tmpfs (not yet full)."""
    if (why := _pgserver.skip_reason()) is not None:
        pytest.skip(why)
    with _pgserver.server() as srv:
        small = srv.base / "small"
        small.mkdir()
        if (why := _mount_tmpfs(small, "1m")) is not None:
            pytest.skip(why)
        try:
            if os.geteuid() == 0:
                shutil.chown(small, SERVER_USER)
            with srv.connect() as conn:
                conn.execute(f"CREATE TABLESPACE small LOCATION '{small}'")
                conn.execute("ALTER DATABASE postgres SET default_tablespace = small")
            yield srv, small
        finally:
            srv.stop("immediate")  # before the unmount: the server has files open there
            subprocess.run(["umount", "-l", str(small)], capture_output=True)


def _fill(where: Path) -> Path:
    """Write a file until the filesystem has no byte left."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(fd, b"\0" * 65536)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0")
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_named_by_doctor_status_and_the_store(
    full_tablespace: tuple[_pgserver.Server, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    srv, small = full_tablespace
    args = ["--dsn", srv.dsn, "--schema", "pglease"]
    with PostgresStore(srv.dsn, schema="pglease") as store:
        rid = store.ensure_resource("job", "a")
        store.claim(rid, Owner("host", "a"), ttl=0.001)
        filler = _fill(small)
        # Claims go on while their pages have room; then every one fails.
        for n in range(5000):
            try:
                store.claim(rid, Owner("host", f"h{n}"), ttl=0.001)
            except DiskFullError as exc:
                error = exc
                break
        else:
            pytest.fail("5000 claims went through on a full disk")
        assert isinstance(error, DatabaseError) and error.sqlstate == "53100"
        message = str(error)
        assert message.startswith("the server's disk is full (SQLSTATE 53100): could not extend")
        assert "No space left on device" in message and "nothing was committed" in message
        assert "\n" not in message and "CONTEXT" not in message
        assert store.get(rid).id == rid  # reads still work

        assert main([*args, "doctor"]) == 2
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if " writes: " in x)
        assert line.startswith("error    writes: writes fail: SQLSTATE 53100 (disk full)"), out
        assert "No space left on device" in line

        assert main([*args, "status"]) == 1
        captured = capsys.readouterr()
        assert "writes:       failing: 53100 disk full: could not extend file" in captured.out
        assert "free space" in captured.err
        assert main([*args, "--json", "status"]) == 1
        writes = json.loads(capsys.readouterr().out)["writes"]
        assert (writes["ok"], writes["sqlstate"], writes["condition"]) == (
            False,
            "53100",
            "disk full",
        )

        filler.unlink()  # space again: the same checks pass
        assert main([*args, "status"]) == 0
        assert "writes:       ok" in capsys.readouterr().out
        with psycopg.connect(srv.dsn, autocommit=True) as conn:
            assert doctor(conn, "pglease").by_name("writes").verdict == "ok"
        store.claim(rid, Owner("host", "after"), ttl=30)
