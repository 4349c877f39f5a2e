"""What a doctor run finds (checks with verdicts, the report) and the reads the checks share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import sql

Verdict = Literal["ok", "unknown", "advice", "warn", "error"]
#: "advice" (a hardening step, nothing wrong) never fails the exit status.
_RANK: dict[str, int] = {"ok": 0, "unknown": 0, "advice": 0, "warn": 1, "error": 2}

EXIT_OK = 0
EXIT_WARN = 1
EXIT_ERROR = 2

#: A transaction holding an xid longer than this holds every watcher back.
HOLDBACK_WARN_SECONDS = 0.1

Conn = psycopg.Connection[Any]


@dataclass(frozen=True, slots=True)
class Check:
    """One finding: what was checked, the verdict, what was seen, what to do."""

    name: str
    verdict: Verdict
    detail: str
    advice: str = ""
    #: Machine-readable particulars (in --json only when there are any).
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Report:
    """Every check of one doctor run."""

    schema: str
    checks: list[Check] = field(default_factory=list)

    @property
    def worst(self) -> Verdict:
        """The most serious verdict that counts ("ok" when nothing is wrong;
        "unknown" and "advice" count as "ok")."""
        worst: Verdict = "ok"
        for check in self.checks:
            if _RANK[check.verdict] > _RANK[worst]:
                worst = check.verdict
        return worst

    @property
    def exit_code(self) -> int:
        """0 nothing wrong (advice only), 1 warnings, 2 errors."""
        return _RANK[self.worst]

    def by_name(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "worst": self.worst,
            "exit_code": self.exit_code,
            "checks": [
                {k: v for k, v in asdict(c).items() if k != "facts" or v} for c in self.checks
            ],
        }


def one_row(conn: Conn, query: str | sql.Composed, args: Sequence[Any] = ()) -> tuple[Any, ...]:
    row = conn.execute(query, args).fetchone()
    assert row is not None
    return tuple(row)


def show_setting(conn: Conn, setting: str) -> str:
    return str(one_row(conn, "SELECT current_setting(%s)", [setting])[0])


def can_see_all_sessions(conn: Conn) -> bool:
    # Other users' replication and activity columns are NULL without it.
    return bool(
        one_row(
            conn,
            "SELECT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)"
            " OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')",
        )[0]
    )
