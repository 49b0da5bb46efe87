"""A chat's tool calls streamed in its reply text, framed, so they travel as its text does.

A worker sends a request's text to the ingress in messages that carry its offset
(``Reply.at``): an ingress passes on exactly what its client lacks, however a worker that
restarted cuts the re-run's text, and ends the answer with an error where the re-run differs
(``ingress.replies``). The calls of a chat with tools ride in that same text, framed, and get
the same guarantees: a client sees each call's arguments as the server makes them, once,
never spliced from two runs. Only a request with tools is framed (an ingress that sends none
never sees a frame), and the ingress reads the frames back into OpenAI's deltas.

In the framed text, ``MARK`` opens a frame:

- ``MARK MARK``: a ``MARK`` of the text itself (U+E000, of Unicode's private use: a model's
  text has it hardly ever, and it is doubled then);
- ``MARK "h" <index> ":" <name> MARK "."``: call ``index`` begins; its arguments follow;
- ``MARK "a" <index> ":"``: call ``index``'s arguments go on (after another call's);
- ``MARK "t"``: the text goes on (after a call).

A call's id is no part of the text: servers make ids at random (vLLM does), and a re-run's
would differ from the one its client has. It travels beside the text (``Reply.call_ids``); the
client keeps the first it got for a call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from laneway.errors import EngineError

__all__ = ["CallFrames", "CallReader", "ToolPart", "calls_of"]

MARK = "\ue000"
_ESCAPED = MARK + MARK


def _escape(text: str) -> str:
    return text.replace(MARK, _ESCAPED) if MARK in text else text


@dataclass(frozen=True, slots=True)
class ToolPart:
    """A part of a tool call as a server streams it: ``index`` names the call; the first
    part of a call has its ``id`` and ``name``, the others pieces of ``arguments``."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    begun: bool = False  # its head is in the text


@dataclass(slots=True)
class CallFrames:
    """The worker's side: a request's text and tool parts, as framed text."""

    request_id: str
    ids: dict[str, str] = field(default_factory=dict)  # call index (a JSON key) → id
    _calls: dict[int, _Call] = field(default_factory=dict)
    _args_of: int | None = None  # whose arguments the text is in; None: the text's own

    def text(self, text: str, parts: tuple[ToolPart, ...] = ()) -> str:
        """The framed form of a delta's ``text`` and then its tool ``parts``."""
        out: list[str] = []
        if text:
            if self._args_of is not None:
                out.append(MARK + "t")
                self._args_of = None
            out.append(_escape(text))
        for part in parts:
            call = self._calls.get(part.index)
            if call is None:
                call = self._calls[part.index] = _Call(part.id, part.name)
            else:
                # A server that sends a name in pieces has them all before the arguments;
                # a call's head waits for its first argument (or the end) to have it whole.
                call.id = call.id or part.id
                # A server that repeats the whole name in every part (some do) is not
                # taken for one that sends it in pieces.
                if not call.begun and part.name != call.name:
                    call.name += part.name
            if part.arguments:
                out.append(self._args(part.index, call))
                out.append(_escape(part.arguments))
        return "".join(out)

    def end(self) -> str:
        """The heads of calls that had no argument, at the end."""
        return "".join(self._args(i, c) for i, c in self._calls.items() if not c.begun)

    def _args(self, index: int, call: _Call) -> str:
        """The frame that puts the text in ``index``'s arguments ('' if it is there)."""
        if self._args_of == index:
            return ""
        self._args_of = index
        if call.begun:
            return f"{MARK}a{index}:"
        if not call.name:
            # A call the client could neither run nor send back (a name is required).
            raise EngineError(f"the upstream made tool call {index} with no function name")
        call.begun = True
        self.ids[str(index)] = call.id or f"call_{self.request_id}_{index}"
        return f"{MARK}h{index}:{_escape(call.name)}{MARK}."


class CallReader:
    """The ingress's side: framed text read back into text and tool-call deltas, as it
    comes (a frame cut between two messages is kept until its end arrives)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.ids: dict[str, str] = {}  # the first id seen of each call
        self._held = ""  # the start of a frame not yet whole
        self._args_of: int | None = None

    def read(
        self, framed: str, ids: Mapping[str, str] | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """The text and OpenAI's tool-call deltas (``index``, the first with ``id``,
        ``type`` and ``function.name``) in ``framed``; ``ids``: those beside it."""
        for index, call_id in (ids or {}).items():
            self.ids.setdefault(index, call_id)
        framed, self._held = self._held + framed, ""
        text: list[str] = []
        deltas: list[dict[str, Any]] = []
        at = 0
        while at < len(framed):
            mark = framed.find(MARK, at)
            plain = framed[at:] if mark < 0 else framed[at:mark]
            if plain:
                self._put(plain, text, deltas)
            if mark < 0:
                break
            end = self._frame(framed, mark, text, deltas)
            if end is None:  # cut short: the rest comes with the next message
                self._held = framed[mark:]
                break
            at = end
        return "".join(text), deltas

    def _put(self, plain: str, text: list[str], deltas: list[dict[str, Any]]) -> None:
        if self._args_of is None:
            text.append(plain)
            return
        last = deltas[-1] if deltas else None
        if last is not None and last["index"] == self._args_of:
            last["function"]["arguments"] += plain
        else:
            deltas.append({"index": self._args_of, "function": {"arguments": plain}})

    def _frame(
        self, framed: str, mark: int, text: list[str], deltas: list[dict[str, Any]]
    ) -> int | None:
        """Read the frame at ``mark``; where the text goes on after it (None: cut short)."""
        kind = framed[mark + 1 : mark + 2]
        if kind in ("", MARK, "t"):
            if kind == MARK:
                self._put(MARK, text, deltas)
            elif kind == "t":
                self._args_of = None
            return mark + 2 if kind else None
        colon = framed.find(":", mark + 2)
        if colon < 0:
            return None
        self._args_of = int(framed[mark + 2 : colon])  # a frame is the worker's: an index
        if kind == "a":
            return colon + 1
        name, end = _name(framed, colon + 1)
        if end is not None:
            call_id = f"call_{self.request_id}_{self._args_of}"
            deltas.append(
                {
                    "index": self._args_of,
                    "id": self.ids.setdefault(str(self._args_of), call_id),
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
        return end


def _name(framed: str, at: int) -> tuple[str, int | None]:
    """A head's name from ``at`` (its ``MARK``s doubled) and where its frame ends."""
    name: list[str] = []
    while True:
        mark = framed.find(MARK, at)
        if mark < 0 or mark + 1 >= len(framed):
            return "", None
        name.append(framed[at:mark])
        if framed[mark + 1] == ".":
            return "".join(name), mark + 2
        name.append(MARK)  # doubled
        at = mark + 2


def calls_of(
    framed: str, ids: Mapping[str, str] | None, request_id: str
) -> tuple[str, list[dict[str, Any]] | None]:
    """A whole framed answer as its text and OpenAI's tool calls (None: it made none)."""
    text, deltas = CallReader(request_id).read(framed, ids)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta["index"])
        if call is None:
            calls[delta["index"]] = {
                "id": delta.get("id", ""),
                "type": "function",
                "function": dict(delta["function"]),
            }
        else:
            call["function"]["arguments"] += delta["function"]["arguments"]
    return text, [calls[i] for i in sorted(calls)] or None
