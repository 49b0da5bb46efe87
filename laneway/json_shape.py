"""What a decoded JSON value must be to pass through laneway: every door checks it.

A value laneway takes in is written out again (to Kafka, in an error message, in a result),
by orjson or pydantic, which refuse two things JSON itself allows: nesting deeper than 255
levels and integers beyond 64 bits. One such value in a body would fail where it is written,
far from the door (a batch worker that cannot hash its line, a batch that never leaves
``validating``): the door refuses it instead, naming where it is. No OpenAI request field
nests more than a few levels, so the limit here is low and the path short.

``top_level_strings`` reads what a record nested past any parser still says at its top level
(a batch line's job and line id), so that it can be answered with its error.

``too_many_values`` bounds what a body costs to decode before it is decoded: 2 MB of ``[],``
is 690,000 lists, which take the decoder, the garbage collector and the checks a quarter of
a CPU-second to build and refuse, on the event loop every other request of every team waits
for. Counted in C, outside strings (the text of a prompt may hold any number of brackets).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_JSON_VALUES",
    "MAX_SCANNED_BYTES",
    "MAX_SCAN_STEPS",
    "json_problem",
    "too_many_values",
    "top_level_strings",
]

MAX_JSON_DEPTH = 64
# Arrays, objects and their items outside strings in one body. A chat message is about
# three (its object, the comma between its fields, the one after it) and costs four tokens
# of framing at least, so a chat at the 32,768-token prompt limit holds about 25,000; one
# of 16,000 messages is still read, and refused for its length, naming the limit.
MAX_JSON_VALUES = 50_000
# ``top_level_strings`` reads no more: Kafka's default largest record is 1 MiB.
MAX_SCANNED_BYTES = 1 << 20
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what orjson writes: i64 and u64


def too_many_values(raw: bytes, limit: int = MAX_JSON_VALUES) -> bool:
    """Whether the JSON text ``raw`` holds more than about ``limit`` arrays, objects and items
    (each ``[``, ``{`` and ``,`` outside strings counts one), found in C in a few
    milliseconds for 2 MB: the marks counted, and only when there are more than ``limit``,
    counted again with the strings taken out (escapes first, so that each ``"`` left opens
    or closes one). More strings than that many values could hold is too many as well."""
    marks = (b"[", b"{", b",")
    if sum(raw.count(mark) for mark in marks) <= limit:
        return False
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    if unescaped.count(b'"') > 4 * limit:
        return True
    outside = b"".join(unescaped.split(b'"')[::2])
    return sum(outside.count(mark) for mark in marks) > limit


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


# One JSON token after optional whitespace: a string, a run of opening or of closing brackets,
# a colon or comma, or a run of anything else (a number, true, false, null; checked only by
# what follows it). A string is matched without alternation inside it, so a long one (or one
# of bytes that are not UTF-8) is read at the speed of C.
_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_TOKEN = re.compile(rb"\s*(" + _STRING + rb'|[{\[]+|[}\]]+|[:,]|[^\s{}\[\]:,"]+)', re.DOTALL)
# Inside a nested value: its strings and anything but a bracket; then a run of brackets.
_NESTED = re.compile(rb"(?:" + _STRING + rb'|[^"{}\[\]]+)*', re.DOTALL)
_BRACKETS = re.compile(rb"[{}\[\]]+")
# Steps (a token, or a stretch of a nested value up to its next brackets) that
# ``top_level_strings`` takes at most: tens of milliseconds. A line has a few members at its
# top level, and a nested value costs a step or two per bracket (a chat of a thousand
# messages: about four thousand); a record that takes more is shaped to be costly, and is
# not read (it cannot be answered: it is skipped). One worker reads every team's lines.
MAX_SCAN_STEPS = 20_000


def top_level_strings(raw: bytes) -> dict[str, str] | None:
    """The string members of the JSON object ``raw`` at its top level, however deep its
    other members nest: for a record no parser takes (orjson stops at 1024 levels) that
    still says whose it is. None when ``raw`` is not an object as far as its top level
    shows (what nests below it is skipped, its brackets only counted), or when reading it
    takes more than ``MAX_SCAN_STEPS``. No recursion; time follows the size, and is bounded."""
    if len(raw) > MAX_SCANNED_BYTES:
        return None
    tokens = _top_level(raw)
    try:
        return _members(tokens)
    except _TooCostly:
        return None


def _members(tokens: Iterator[bytes]) -> dict[str, str] | None:
    if next(tokens, None) != b"{":
        return None
    members: dict[str, str] = {}
    key = next(tokens, None)
    while key != b"}":  # a member: "key" : value, then , or }
        colon, value, end = (next(tokens, None) for _ in range(3))
        if key is None or key[:1] != b'"' or colon != b":" or value in _NOT_VALUES:
            return None
        if value is not None and value[:1] == b'"':
            members[_string(key)] = _string(value)
        else:  # a later member of the same name is the one a parser keeps
            members.pop(_string(key), None)
        if end not in (b",", b"}"):
            return None
        key = next(tokens, None) if end == b"," else end
        if end == b"," and key == b"}":
            return None  # a trailing comma
    return members if next(tokens, None) is None else None


_NOT_VALUES = (None, b":", b",", b"}", b"]")


class _TooCostly(Exception):
    """More than ``MAX_SCAN_STEPS`` steps."""


def _top_level(raw: bytes) -> Iterator[bytes]:
    """The tokens of ``raw``'s top level: an array or object nested in it is one ``[``.

    Inside a nested value only its brackets count: its strings and everything else between
    two brackets are passed over in one match, and a run of brackets that cannot bring it
    back to the top level is counted (``bytes.count``), not read one by one. A record nested
    ten thousand deep, or a nested list of thousands of strings, is a few steps."""
    depth, pos, steps = 0, 0, 0
    while True:
        steps += 1
        if steps > MAX_SCAN_STEPS:
            raise _TooCostly
        if depth >= 2:
            pos = _NESTED.match(raw, pos).end()  # type: ignore[union-attr] # it matches ""
            brackets = _BRACKETS.match(raw, pos)
            if brackets is None:
                return  # the record ends inside a nested value (or in an open string)
            run = brackets.group()
            closing = run.count(b"]") + run.count(b"}")
            if depth - closing >= 2:
                depth += len(run) - 2 * closing
                pos = brackets.end()
                continue
        match = _TOKEN.match(raw, pos)
        if match is None:
            return
        token, pos = match.group(1), match.end()
        first = token[:1]
        if first in (b"{", b"["):
            # Only the brackets that open the top level or a member's value are seen.
            for opened in range(depth + 1, min(depth + len(token), 2) + 1):
                yield token[opened - depth - 1 : opened - depth] if opened == 1 else b"["
            depth += len(token)
        elif first in (b"}", b"]"):
            # Those that close to the top level or below it are seen, one by one.
            for char in range(max(0, depth - 1), len(token)):
                yield token[char : char + 1]
            depth -= len(token)
        elif depth <= 1:
            yield token


def _string(token: bytes) -> str:
    """A string token's text; a bad escape or invalid UTF-8 in it (rare: a record that is
    broken as well as deep) is replaced, never raised, and such a string is read only as far
    as ``_BROKEN_STRING_BYTES`` (each bad byte replaced costs a call)."""
    try:
        text = orjson.loads(token)
    except orjson.JSONDecodeError:
        return token[1 : min(len(token) - 1, 1 + _BROKEN_STRING_BYTES)].decode(errors="replace")
    return text if isinstance(text, str) else ""


# Far more than any id a line names (``MAX_CUSTOM_ID_CHARS``).
_BROKEN_STRING_BYTES = 4096
