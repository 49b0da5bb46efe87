"""What a decoded JSON value must be to pass through laneway: every door checks it.

A value laneway takes in is written out again (to Kafka, in an error message, in a result),
by orjson or pydantic, which refuse two things JSON itself allows: nesting deeper than 255
levels and integers beyond 64 bits. One such value in a body would fail where it is written,
far from the door (a batch worker that cannot hash its line, a batch that never leaves
``validating``): the door refuses it instead, naming where it is. No OpenAI request field
nests more than a few levels, so the limit here is low and the path short.
"""

from __future__ import annotations

__all__ = ["MAX_JSON_DEPTH", "json_problem"]

MAX_JSON_DEPTH = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson writes: i64 and u64


def json_problem(value: object) -> tuple[str, str] | None:
    """A place in ``value`` (decoded JSON) that laneway cannot carry, as (its dotted path,
    shortened past 80 characters; what is wrong), or None when there is none. Iterative: a
    value nested a thousand deep costs no recursion."""
    found = _first_problem(value)
    if found is None:
        return None
    path, problem = found
    return (path if len(path) <= 80 else path[:77] + "..."), problem


def _first_problem(value: object) -> tuple[str, str] | None:
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                return path, f"nested more than {MAX_JSON_DEPTH} levels deep"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, inner in pairs:
                inner_path = f"{path}.{key}" if path else str(key)
                stack.append((inner, inner_path, depth + 1))
        elif isinstance(item, int) and not _INT_MIN <= item <= _INT_MAX:
            return path, f"an integer of {item.bit_length()} bits, beyond 64"
    return None
