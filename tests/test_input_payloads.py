"""No poison events: writers may not nest payloads beyond MAX_PAYLOAD_DEPTH."""

from __future__ import annotations

from typing import Any

import pytest

from pglease import InvalidPayloadError, Permit
from pglease.payloads import (
    MAX_PAYLOAD_DEPTH,
    canonical_payload,
    check_payload_depth,
)

from .backends import Backend


def nest_lists(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def nest_dicts(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


# --- the write-side limit ------------------------------------------------------------


@pytest.mark.parametrize("nest", [nest_lists, nest_dicts])
def test_depth_limit_is_exact(nest: Any) -> None:
    canonical_payload(nest(MAX_PAYLOAD_DEPTH))
    with pytest.raises(InvalidPayloadError, match=f"more than {MAX_PAYLOAD_DEPTH} levels"):
        canonical_payload(nest(MAX_PAYLOAD_DEPTH + 1))


def test_scalars_and_flat_values_have_no_depth() -> None:
    for value in [None, 1, "x", 1.5, True, [1, 2, 3], {"a": 1}, (1, 2)]:
        check_payload_depth(value)


def test_mixed_nesting_counts_arrays_and_objects() -> None:
    value: Any = 1
    for i in range(MAX_PAYLOAD_DEPTH):
        value = [value] if i % 2 else {"k": value}
    canonical_payload(value)
    with pytest.raises(InvalidPayloadError):
        canonical_payload([value])


def test_one_deep_branch_among_wide_ones_is_found() -> None:
    wide = {f"k{i}": list(range(50)) for i in range(200)}
    wide["deep"] = nest_lists(MAX_PAYLOAD_DEPTH + 1)
    with pytest.raises(InvalidPayloadError):
        canonical_payload(wide)


def test_a_100000_deep_list_is_refused_without_recursion() -> None:
    with pytest.raises(InvalidPayloadError):
        canonical_payload(nest_lists(100_000))
    deep_tuple: Any = ()
    for _ in range(100_000):
        deep_tuple = (deep_tuple,)
    with pytest.raises(InvalidPayloadError):
        canonical_payload(deep_tuple)


def test_cycles_are_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidPayloadError):
        canonical_payload(loop)
    d: dict[str, Any] = {}
    d["self"] = d
    with pytest.raises(InvalidPayloadError):
        canonical_payload({"a": d})


def test_store_refuses_too_deep_payloads_and_keeps_the_limit(backend: Backend) -> None:
    s = backend.store
    rid = s.ensure_resource("run", "depth")
    for payload in (nest_lists(MAX_PAYLOAD_DEPTH + 1), nest_lists(100_000)):
        with pytest.raises(InvalidPayloadError):
            s.mutate(Permit(rid, 0), "run.deep", payload=payload)
    assert s.get(rid).revision == 0 and s.events(rid) == []
    assert backend.payload_count() == 0  # type: ignore[attr-defined]
    deepest = nest_dicts(MAX_PAYLOAD_DEPTH)
    s.mutate(Permit(rid, 0), "run.deep", payload=deepest)
    assert s.events(rid)[0].payload == deepest
    assert s.events_after()[0].payload == deepest
