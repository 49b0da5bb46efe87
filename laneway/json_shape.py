"""What a decoded JSON value must be to pass through laneway: every door checks it.

A value laneway takes in is written out again (to Kafka, in an error message, in a result),
by orjson or pydantic, which refuse two things JSON itself allows: nesting deeper than 255
levels and integers beyond 64 bits. One such value in a body would fail where it is written,
far from the door (a batch worker that cannot hash its line, a batch that never leaves
``validating``): the door refuses it instead, naming where it is. No OpenAI request field
nests more than a few levels, so the limit here is low and the path short.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "json_problem"]

MAX_JSON_DEPTH = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson writes: i64 and u64


def json_problem(value: object) -> tuple[str, str] | None:
    """A place in ``value`` (decoded JSON) that laneway cannot carry, as (its dotted path,
    shortened past 80 characters; what is wrong), or None when there is none. Depth first
    with one iterator a level: memory follows the depth (at most the limit), time the size,
    and a value nested a thousand deep costs no recursion."""
    if _carried(value):
        return None
    found = _first_problem(value)
    if found is None:
        return None
    keys, problem = found
    path = ".".join(str(key) for key in keys)
    return (path if len(path) <= 80 else path[:77] + "..."), problem


def _carried(value: Any) -> bool:
    """The check alone, without keys: what every request pays (a few microseconds)."""
    levels: list[Iterator[Any]] = [iter((value,))]  # the top, as the one item of a level
    while levels:
        for inner in levels[-1]:
            kind = type(inner)
            if kind is dict or kind is list:
                if len(levels) > MAX_JSON_DEPTH:
                    return False
                levels.append(iter(inner.values() if kind is dict else inner))
                break
            if kind is int and not _INT_MIN <= inner <= _INT_MAX:
                return False
        else:
            levels.pop()
    return True


def _first_problem(value: Any) -> tuple[list[Any], str] | None:
    """The same walk, keeping the keys that lead to where it stops (run once a problem is
    known to be there)."""
    keys: list[Any] = []  # the key of each level entered below the top
    levels: list[Iterator[tuple[Any, Any]]] = [iter(((None, value),))]
    while levels:
        for key, inner in levels[-1]:
            kind = type(inner)
            path = keys if key is None and len(levels) == 1 else [*keys, key]
            if kind is dict or kind is list:
                if len(levels) > MAX_JSON_DEPTH:
                    return path, f"nested more than {MAX_JSON_DEPTH} levels deep"
                keys = path
                levels.append(iter(inner.items()) if kind is dict else enumerate(inner))
                break
            if kind is int and not _INT_MIN <= inner <= _INT_MAX:
                return path, _too_big(inner)
        else:
            levels.pop()
            keys = keys[:-1]
    return None


def _too_big(number: int) -> str:
    # Not the number itself: one of thousands of digits is more than str() will write.
    sign = "below" if number < 0 else "above"
    return f"an integer {sign} the 64-bit range ({number.bit_length()} bits)"
