"""Durations on the command line: ``30``, ``1.5s``, ``250ms``, ``5m``, ``1h``, ``2d``, ``1h30m``.

One parser for every flag that takes a time, so ``--ttl 90s`` and
``prune --older-than 90s`` read the same way, and junk is refused with one
clear message instead of becoming a surprising number.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

__all__ = ["MAX_SECONDS", "UNITS", "DurationError", "duration_arg", "parse_duration"]

#: Seconds per unit. ``w`` stays because ``prune --older-than 2w`` worked before.
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
#: Beyond this (about 317 years) a duration is a typo, not a plan; it is also
#: the bound `prune --older-than` always had.
MAX_SECONDS = 1e10

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_BARE = re.compile(rf"\+?{_NUMBER}(?:e[+-]?\d+)?")
_PART = re.compile(rf"({_NUMBER})(ms|s|m|h|d|w)")
_EXAMPLES = "30, 30s, 1.5s, 250ms, 5m, 1h, 2d or 1h30m"


class DurationError(ValueError):
    """A duration that cannot be used; the message says why."""


def parse_duration(text: str, *, what: str = "duration") -> float:
    """Seconds in `text`; `what` names the value in error messages (``ttl``, ``--within``).

    Zero is accepted (``prune --older-than 0`` means everything committed);
    callers that need a positive value check it themselves.
    """
    raw = text
    text = text.strip().lower()
    if text.startswith("-"):
        raise DurationError(f"{what} must be zero or more, got {raw!r}")
    if text.lstrip("+") in ("nan", "inf", "infinity"):
        raise DurationError(f"{what} must be finite, got {raw!r}")
    if _BARE.fullmatch(text):
        seconds = float(text)
    else:
        seconds, pos = 0.0, 0
        for match in _PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match[1]) * UNITS[match[2]]
            pos = match.end()
        if not text or pos != len(text):
            raise DurationError(f"{what} {raw!r} is not a duration like {_EXAMPLES}")
    if not math.isfinite(seconds) or seconds >= MAX_SECONDS:
        raise DurationError(f"{what} {raw!r} is too large (the limit is {MAX_SECONDS:.0f} s)")
    return seconds


def duration_arg(
    what: str, check: Callable[[float], float] | None = None
) -> Callable[[str], float]:
    """An argparse ``type=``: parse, then `check` (which may raise ValueError);
    any refusal becomes argparse's own usage error (exit 2)."""

    def convert(text: str) -> float:
        try:
            seconds = parse_duration(text, what=what)
            return check(seconds) if check is not None else seconds
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = "duration"  # argparse names the type in "invalid duration value"
    return convert
