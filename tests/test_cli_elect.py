"""`pglease elect`, `leader` and `resign` as real OS processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import IO

from .test_cli import ROOT, migrate_schema

PGLEASE = [sys.executable, "-m", "pglease"]
DEADLINE = 60.0


def pglease_run(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PGLEASE, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def _elect(dsn: str, schema: str, owner: str, *command: str) -> subprocess.Popen[str]:
    migrate_schema(dsn, schema)
    return subprocess.Popen(
        [*PGLEASE, "--dsn", dsn, "--schema", schema, "--json", "elect", "sched",
         "--owner", owner, "--ttl", "6", *command],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _line(stream: IO[str] | None) -> str:
    assert stream is not None
    return stream.readline()  # bounded by the communicate() timeouts after it


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_elect_prints_leadership_and_resigns_on_sigterm(pg_dsn: str, schema: str) -> None:
    first = _elect(pg_dsn, schema, "host:a")
    second: subprocess.Popen[str] | None = None
    try:
        elected = json.loads(_line(first.stdout))
        assert elected == {"event": "elected", "name": "sched", "leader": "host:a", "generation": 1}
        shown = pglease_run("--dsn", pg_dsn, "--schema", schema, "--json", "leader", "sched")
        assert shown.returncode == 0, shown.stderr
        view = json.loads(shown.stdout)
        assert (view["leader"], view["generation"]) == ("host:a", 1)
        text = pglease_run("--dsn", pg_dsn, "--schema", schema, "leader", "sched").stdout
        assert "leader host:a, generation 1" in text

        second = _elect(pg_dsn, schema, "host:b")
        # The second candidate waits: host:a stays leader while it campaigns.
        time.sleep(1)
        assert second.poll() is None
        again = pglease_run("--dsn", pg_dsn, "--schema", schema, "--json", "leader", "sched")
        assert json.loads(again.stdout)["leader"] == "host:a"

        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=DEADLINE)
        assert first.returncode == 0, err
        assert json.loads(out.splitlines()[-1])["event"] == "resigned"
        # Resigning released the lease: host:b is elected without waiting for the ttl.
        took = json.loads(_line(second.stdout))
        assert (took["leader"], took["generation"]) == ("host:b", 2)
        second.send_signal(signal.SIGINT)
        second.communicate(timeout=DEADLINE)
        assert second.returncode == 0
    finally:
        _stop(first)
        if second is not None:
            _stop(second)
    none = pglease_run("--dsn", pg_dsn, "--schema", schema, "leader", "sched")
    assert none.returncode == 3
    assert "no leader" in none.stdout


def test_elect_runs_command_and_stops_it_when_resigned(pg_dsn: str, schema: str) -> None:
    script = (
        "import os, time; print('up', os.environ['PGLEASE_FENCE'], flush=True); time.sleep(120)"
    )
    proc = _elect(pg_dsn, schema, "host:a", "--", sys.executable, "-c", script)
    try:
        assert _line(proc.stdout).split() == ["up", "1"]
        resigned = pglease_run("--dsn", pg_dsn, "--schema", schema, "--json", "resign", "sched")
        assert resigned.returncode == 0, resigned.stderr
        assert json.loads(resigned.stdout)["fenced"] == "host:a"
        _, err = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 75, err
        assert "lost" in err
    finally:
        _stop(proc)
    nothing = pglease_run("--dsn", pg_dsn, "--schema", schema, "resign", "sched")
    assert nothing.returncode == 0 and "nothing to resign" in nothing.stdout


def test_elect_command_exit_codes(pg_dsn: str, schema: str) -> None:
    migrate_schema(pg_dsn, schema)
    base = ["--dsn", pg_dsn, "--schema", schema, "elect", "sched", "--owner", "host:a"]
    done = pglease_run(*base, "--ttl", "5s", "--", sys.executable, "-c", "raise SystemExit(7)")
    assert done.returncode == 7, done.stderr
    missing = pglease_run(*base, "--ttl", "5", "--", "/nonexistent/command")
    assert missing.returncode == 127 and "not found" in missing.stderr
    bad = pglease_run(*base, "--ttl", "-1")
    assert bad.returncode == 2
    unknown = pglease_run("--dsn", pg_dsn, "--schema", schema, "leader", "nobody")
    assert unknown.returncode == 3


def test_deposed_leader_tells_the_loss_once_on_one_line(pg_dsn: str, schema: str) -> None:
    proc = _elect(pg_dsn, schema, "host:a")
    try:
        assert json.loads(_line(proc.stdout))["event"] == "elected"
        resigned = pglease_run("--dsn", pg_dsn, "--schema", schema, "--json", "resign", "sched")
        assert resigned.returncode == 0, resigned.stderr
        # The ended term's last expiry: nobody is elected before it.
        assert json.loads(resigned.stdout)["electable_at"] is not None
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        _stop(proc)
    assert proc.returncode == 75, err
    assert json.loads(out.splitlines()[-1])["event"] == "deposed"
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pglease: lost the leadership of sched (generation 1): ")
    assert "is lost" not in lines[0]  # not the lease's own message nested inside
