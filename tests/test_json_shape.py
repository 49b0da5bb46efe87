"""The shape every door checks: what orjson and pydantic can write out again."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from laneway.json_shape import (
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    MAX_SCAN_STEPS,
    MAX_SCANNED_BYTES,
    json_problem,
    too_many_values,
    top_level_strings,
)


def _nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def test_a_body_is_costly_by_its_values_outside_strings_not_by_its_text() -> None:
    """What a body costs to decode is what it holds outside strings: a prompt of code full
    of brackets and commas, quotes and backslashes is cheap; 100,000 empty lists are not,
    and neither are as many empty strings."""
    code = 'def f(a, b):\n    return {\'x\': [a, b], "y": (a, b)}  # \\ "[\n' * 20_000
    assert not too_many_values(orjson.dumps({"model": "m", "prompt": code}))
    chat = {"model": "m", "messages": [{"role": "user", "content": "x, [y]"}] * 5_000}
    assert not too_many_values(orjson.dumps(chat))
    assert too_many_values(b'{"junk": [' + b",".join([b"[]"] * 100_000) + b"]}")
    assert too_many_values(b'{"junk": [' + b",".join([b'""'] * 100_000) + b"]}")
    assert too_many_values(b'{"junk": [' + b",".join([b'"\\\\"'] * 100_000) + b"]}")
    # Just at the limit and just past it: each mark outside strings counts one.
    at = b'{"junk": [' + b",".join([b"0"] * (MAX_JSON_VALUES - 1)) + b"]}"
    assert not too_many_values(at)
    assert too_many_values(at.replace(b"[0,", b"[0,0,"))


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


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(), _json, max_size=6), st.booleans())
def test_the_top_level_strings_of_any_object_are_read_as_a_parser_reads_them(
    value: dict[str, Any], indent: bool
) -> None:
    raw = orjson.dumps(value, option=orjson.OPT_INDENT_2 if indent else 0)
    expected = {k: v for k, v in value.items() if isinstance(v, str)}
    assert top_level_strings(raw) == expected


def test_the_top_level_strings_of_a_record_nested_past_any_parser_are_read() -> None:
    raw = b'{"job_id": "j-1", "body": ' + b"[" * 5000 + b"]" * 5000 + b', "line_id": "l\\u00e9"}'
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    assert top_level_strings(raw) == {"job_id": "j-1", "line_id": "lé"}


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[1]",
        b'"s"',
        b"{",
        b'{"a"}',
        b'{"a":}',
        b'{"a":"b",}',
        b'{"a":"b"]',
        b'{"a" "b"}',
        b'{"a":"b" "c":"d"}',
        b'{"a":"b"}x',
        b'{"a":"b"',
        b"{,}",
    ],
)
def test_what_is_not_an_object_at_its_top_level_has_no_top_level_strings(raw: bytes) -> None:
    assert top_level_strings(raw) is None


def test_a_repeated_member_is_read_as_a_parser_keeps_it_and_a_huge_record_not_at_all() -> None:
    assert top_level_strings(b'{"a": "x", "a": 1}') == {}  # orjson keeps the last: 1
    assert top_level_strings(b'{"a": 1, "a": "y"}') == {"a": "y"}
    huge = b'{"job_id": "j", "body": "' + b"x" * MAX_SCANNED_BYTES + b'"}'
    assert top_level_strings(huge) is None


def test_what_nests_below_the_top_level_is_passed_over_however_it_is_shaped() -> None:
    # Each of these is a megabyte or near it that no parser takes (a bad byte at its end).
    broken = b'"\xff"'
    deep = b"[" * 300_000 + b"]" * 300_000
    strings = b"[" + b'"a",' * 200_000 + broken + b"]"
    chat = b'{"messages": [' + b'{"role": "user", "content": "x"},' * 2_000 + broken + b"]}"
    for nested in (deep, strings, chat):
        raw = b'{"job_id": "j", "body": ' + nested + b', "line_id": "l", "x": ' + broken + b"}"
        assert top_level_strings(raw) == {"job_id": "j", "line_id": "l", "x": "\ufffd"}


def test_a_record_shaped_to_cost_more_than_the_scan_allows_is_not_read() -> None:
    # Nested lists of two levels in a row: a step for each bracket that a count cannot pass.
    costly = b"[" + b"[]," * (MAX_SCAN_STEPS // 2) + b'"\xff"]'
    assert top_level_strings(b'{"job_id": "j", "body": ' + costly + b"}") is None
    fits = b"[" + b"[]," * (MAX_SCAN_STEPS // 4) + b'"\xff"]'
    assert top_level_strings(b'{"job_id": "j", "body": ' + fits + b"}") == {"job_id": "j"}


def test_a_broken_string_is_read_only_as_far_as_an_id_could_reach() -> None:
    raw = b'{"line_id": "' + b"\xff" * 100_000 + b'"}'
    (line_id,) = top_level_strings(raw).values()  # type: ignore[union-attr]
    assert line_id == "\ufffd" * 4096
