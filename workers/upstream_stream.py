"""An upstream's event stream read into deltas, and its finish_reason as OpenAI's.

Every line of every streamed answer passes through here (the CPU per completion): a line
is parsed once and folded into the totals, and only an error event costs more.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from laneway.errors import EngineError
from laneway.schema import MAX_USAGE_TOKENS
from laneway.tool_frames import ToolPart
from workers.types import EngineDelta
from workers.upstream_refusals import stream_error

__all__ = ["FinishReasons", "StreamReading", "TokensPerChunk"]

log = logging.getLogger(__name__)

# What servers end a stream with, as OpenAI's finish_reason. TGI tells the model's own end
# of text (eos_token) from a stop string (stop_sequence); OpenAI calls both ``stop``. A chat
# may end in tool calls; a completion cannot.
_FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "content_filter": "content_filter",
    "eos_token": "stop",
    "stop_sequence": "stop",
}
_CHAT_FINISH_REASONS = {**_FINISH_REASONS, "tool_calls": "tool_calls"}
# A server sending a new value with every request would otherwise fill the log (and memory).
_ODD_FINISHES_LOGGED = 32


class FinishReasons:
    """One upstream's finish_reason values as OpenAI's; each value it should not send is
    logged once."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self._odd: set[str] = set()  # finish reasons not OpenAI's, logged once each

    def openai(self, reason: object, *, chat: bool) -> str:
        """The upstream's finish_reason as OpenAI's (clients and their SDKs check the value).
        An abort of the upstream's own (SGLang's ``abort``: the text is not a whole answer)
        or a value OpenAI does not have fails the request; the value is logged once."""
        if reason is None:
            return "stop"  # ended by [DONE] alone
        openai = _CHAT_FINISH_REASONS if chat else _FINISH_REASONS
        if isinstance(reason, str) and reason in openai:
            return openai[reason]
        said = repr(reason)[:60]
        if said not in self._odd and len(self._odd) < _ODD_FINISHES_LOGGED:
            self._odd.add(said)
            log.warning(
                "upstream %s ended a %s request with finish_reason %s, which is not one of "
                "OpenAI's: such requests fail as engine errors (logged once for this value)",
                self.upstream,
                "chat" if chat else "completion",
                said,
            )
        if reason == "abort":
            raise EngineError(f"the upstream aborted the request itself (finish_reason {said})")
        raise EngineError(f"the upstream ended the request with finish_reason {said}, not OpenAI's")


def _count(usage: dict[str, Any], field: str, kept: int) -> int:
    """The upstream's ``usage[field]`` if it is a token count, else ``kept`` (laneway's own
    estimate, or its count of the chunks): a null, negative, fractional or absurd count
    would fail the request's usage event after its client had its answer, and a batch
    line would be passed over with no result (logged, up to a few times)."""
    value = usage.get(field, kept)
    if type(value) is int and 0 <= value <= MAX_USAGE_TOKENS:
        return value
    global _odd_counts_logged  # noqa: PLW0603 - a bound on the log, for the process
    if _odd_counts_logged < _ODD_FINISHES_LOGGED:
        _odd_counts_logged += 1
        log.warning(
            "the upstream reported %s %s, which is no token count: laneway's own count %d "
            "is used instead",
            field,
            repr(value)[:60],
            kept,
        )
    return kept


_odd_counts_logged = 0


class StreamReading:
    """Totals of one streamed response, folded in chunk by chunk."""

    __slots__ = (
        "_call_ids",
        "cached",
        "called",
        "chunks",
        "completion_tokens",
        "counted",
        "done",
        "finish",
        "max_tokens",
        "over",
        "per_chunk",
        "prompt_tokens",
        "started",
        "text_sent",
        "usage_after_finish",
    )

    def __init__(self, prompt_tokens: int, max_tokens: int = 0, per_chunk: float = 1.0) -> None:
        self.done = False  # [DONE] was read
        self.max_tokens = max_tokens  # 0: no limit of laneway's own
        self.over = False  # text came past max_tokens: the upstream ignores it
        self.usage_after_finish = False  # its usage came in a chunk after its finish_reason
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0  # the server's own count, one a text chunk after it
        self.counted = False  # the server's usage came: its count stands
        self.chunks = 0  # text chunks read
        # Tokens a text chunk holds on this server (``TokensPerChunk``): what a stream that
        # ends before its usage (a cancel, a cut) is billed per chunk.
        self.per_chunk = per_chunk
        self.cached = 0
        self.finish: object = None  # the server's own value, until FinishReasons reads it
        self.started: float | None = None  # perf_counter at the first byte
        self.text_sent = False  # some text came (and went on to the client)
        self.called = False  # some part of a tool call came
        self._call_ids: dict[int, str] = {}  # each tool call's id, by index

    def ms(self) -> float:
        return 0.0 if self.started is None else (time.perf_counter() - self.started) * 1000

    def line(self, line: bytes) -> EngineDelta | None:
        """One line of the event stream: the delta it brings, if any."""
        if not line.startswith(b"data:"):
            return None
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return None
        try:
            chunk = orjson.loads(data)
            if isinstance(chunk, dict) and chunk.get("error"):
                # vLLM and others end a stream that failed midway with an error event (and
                # then [DONE]): the answer so far is not a whole one. TGI refuses a request
                # so too, before any text.
                raise stream_error(chunk, text_sent=self.text_sent)
            return self.chunk(chunk)
        except (ValueError, TypeError, AttributeError) as exc:
            # Not the OpenAI chunk it must be: the request fails with an engine error (its
            # client answered, its quota settled, the route's breaker told), never silently.
            raise EngineError(
                f"the upstream sent an event that is not an OpenAI chunk: {bytes(data[:120])!r}"
            ) from exc

    def chunk(self, chunk: dict[str, Any]) -> EngineDelta | None:
        usage = chunk.get("usage")
        if usage:
            self.usage_after_finish = self.usage_after_finish or self.finish is not None
            self.prompt_tokens = _count(usage, "prompt_tokens", self.prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            cached = _count(details, "cached_tokens", 0) if "cached_tokens" in details else 0
            self.cached = min(cached, self.prompt_tokens)
            self.completion_tokens = _count(usage, "completion_tokens", self.completion_tokens)
            self.counted = True
        text = ""
        finish = self.finish
        parts: list[ToolPart] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text += (delta.get("content") if delta else choice.get("text")) or ""
            finish = choice.get("finish_reason") or finish
            if delta and (calls := delta.get("tool_calls")):
                # TGI before 3.1 sends one call as an object, not a list of one.
                parts += self._tool_parts([calls] if isinstance(calls, dict) else calls)
        output = bool(text or parts)  # a tool call's part is a token or more too
        if output and not usage and 0 < self.max_tokens <= self.completion_tokens:
            # More text than max_tokens chunks: the upstream ignores max_tokens (a chunk holds
            # one token at least, so one that honours it never gets here). No more goes on to
            # the client, and the request ends there, by its length.
            self.over = True
            self.finish = "length"
            return None
        self.finish = finish
        if output:
            self.chunks += 1
            if not usage:
                self.completion_tokens += 1
        self.text_sent = self.text_sent or output
        self.called = self.called or bool(parts)
        if not (output or usage):
            return None
        return EngineDelta(
            text=text,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached,
            completion_tokens=self.billed(),
            engine_ms=self.ms(),
            tool_parts=tuple(parts),
        )

    def _tool_parts(self, calls: list[dict[str, Any]]) -> list[ToolPart]:
        """A delta's parts of tool calls (OpenAI's: ``index``; ``id`` and
        ``function.name`` in a call's first; ``function.arguments`` in pieces)."""
        parts = []
        for position, part in enumerate(calls):
            call_id = _text(part.get("id"))
            index = part.get("index")
            if index is None:
                # Servers that send no index (older Ollama) send each call whole in a chunk
                # of its own: one with an id of its own is the next call.
                index = position
                known = self._call_ids.get(index)
                if call_id and known is not None and known != call_id:
                    index = max(self._call_ids) + 1
            if type(index) is not int or not 0 <= index < _MOST_TOOL_CALLS:
                raise TypeError(f"a tool call's index {index!r} is none of 0..{_MOST_TOOL_CALLS}")
            if call_id:
                self._call_ids.setdefault(index, call_id)
            function = part.get("function") or {}
            parts.append(
                ToolPart(
                    index,
                    id=call_id,
                    name=_text(function.get("name")),
                    arguments=_text(function.get("arguments")),
                )
            )
        return parts

    def billed(self) -> int:
        """Completion tokens so far: the server's own count once its usage came, else one a
        chunk times what a chunk holds on this server (a chunk may hold several tokens:
        speculative decoding, vLLM's --stream-interval). A stream that ends before its
        usage (its client left, or cut at max_tokens) is billed so, never past max_tokens
        unless the server went past it (``over``: what its client got)."""
        if self.counted or self.per_chunk == 1.0:
            return self.completion_tokens
        tokens = max(self.completion_tokens, int(self.completion_tokens * self.per_chunk))
        return tokens if self.over or not self.max_tokens else min(tokens, self.max_tokens)

    def final(self, finish_reason: str) -> EngineDelta:
        """The end, with OpenAI's ``finish_reason``: raises when the stream stopped before
        saying it was done ([DONE], or a finish_reason), as a connection the upstream dropped
        or a body cut short does; the text so far is not a whole answer then."""
        if not self.done and self.finish is None and not self.over:
            raise EngineError(
                "the upstream's stream ended before its end (no finish_reason, no [DONE])"
            )
        return EngineDelta(
            text="",
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached,
            completion_tokens=self.billed(),
            engine_ms=self.ms(),
            finish_reason=finish_reason,
        )


class TokensPerChunk:
    """How many tokens a text chunk holds on one server, learned from the streams that
    ended with its usage: the server's count, less the last token (often one with no text:
    an end-of-sequence), over the text chunks. 1 on a server that sends a token a chunk (the
    default of vLLM, SGLang, llama.cpp and TGI), more with speculative decoding or vLLM's
    --stream-interval; one that never reports usage stays at 1."""

    __slots__ = ("learned", "value")

    def __init__(self) -> None:
        self.value = 1.0
        self.learned = 0  # streams learned from

    def learn(self, reading: StreamReading) -> None:
        # Not from a stream with tool calls: a server's tool parser sends no chunk for the
        # tokens that frame a call, and text streams would be billed for them.
        if not reading.counted or reading.chunks < _CHUNKS_TO_LEARN or reading.called:
            return
        # An answer cut at its length has no end-of-sequence token (one with no text).
        last = 0 if reading.finish == "length" else 1
        seen = min(_MOST_PER_CHUNK, max(1.0, (reading.completion_tokens - last) / reading.chunks))
        self.learned += 1
        # The mean of the first few, then a moving average that follows a server changed.
        self.value += max(_LEARN_WEIGHT, 1 / self.learned) * (seen - self.value)
        if self.value < _ONE_TOKEN_BELOW:
            self.value = 1.0  # a token a chunk: billed exactly, as the chunks count


# More calls than any model makes in one answer.
_MOST_TOOL_CALLS = 1024


def _text(value: object) -> str:
    """A string field of a tool call's part ('' when absent or null)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"a tool call's field is {value!r}, not a string")
    return value


_CHUNKS_TO_LEARN = 4  # fewer text chunks say little of a server's chunking
_LEARN_WEIGHT = 0.2
_MOST_PER_CHUNK = 64.0
_ONE_TOKEN_BELOW = 1.05
