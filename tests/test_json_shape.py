"""The shape every door checks: what orjson and pydantic can write out again."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from laneway.json_shape import MAX_JSON_DEPTH, json_problem


def _nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def test_nesting_up_to_the_limit_passes_and_past_it_is_named() -> None:
    fine = {"tools": _nested(MAX_JSON_DEPTH - 1)}  # the body itself is a level
    assert json_problem(fine) is None
    orjson.dumps(fine)  # what passes can be written out again
    path, problem = json_problem({"model": "m", "tools": _nested(MAX_JSON_DEPTH)}) or ("", "")
    assert path.startswith("tools.0.0")
    assert path.endswith("...")
    assert problem == f"nested more than {MAX_JSON_DEPTH} levels deep"


@pytest.mark.parametrize(
    ("number", "carried"),
    [(2**64 - 1, True), (-(2**63), True), (2**64, False), (-(2**63) - 1, False), (True, True)],
)
def test_integers_pass_as_far_as_orjson_writes_them(number: int, carried: bool) -> None:
    body = {"metadata": {"runs": [1, {"n": number}]}}
    found = json_problem(body)
    assert (found is None) == carried
    if carried:
        orjson.dumps(body)
    else:
        sign = "below" if number < 0 else "above"
        assert found == (
            "metadata.runs.1.n",
            f"an integer {sign} the 64-bit range ({number.bit_length()} bits)",
        )


def test_a_wide_value_is_walked_once_with_its_keys_kept_short() -> None:
    """A long key over a long list (the quadratic case of a path built per item) and a
    problem at the very end of a flat list are found, and named by their path."""
    wide = {"k" * 50_000: [*range(20_000), 2**70]}
    path, problem = json_problem(wide) or ("", "")
    assert (len(path), problem) == (80, "an integer above the 64-bit range (71 bits)")
    assert json_problem({"k" * 50_000: list(range(20_000))}) is None
