"""What an upstream's error says: a refusal of the request for what it asks, or a failure.

A refusal is the client's doing (a prompt over the server's context, a parameter it does not
take): it goes back to the client with the upstream's reason and counts against no route's
breaker. Anything else is an engine error. Servers say which in their own ways, in an error
status or in an error event of a 200 stream.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from laneway.errors import EngineError, EngineRejected, EngineUnsupported, PromptTooLarge

__all__ = [
    "REQUEST_REFUSED",
    "OverContext",
    "context_room",
    "error_reason",
    "refusal",
    "stream_error",
]

# Statuses by which OpenAI-compatible servers (vLLM, SGLang, llama.cpp, TGI) refuse a request
# for what it asks: bad request, too large, unprocessable.
REQUEST_REFUSED = frozenset({400, 413, 422})


def error_reason(detail: str) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message"}}`` or vLLM's
    ``{"message"}``), else the body's first 200 characters."""
    try:
        body = orjson.loads(detail)
    except orjson.JSONDecodeError:
        return detail[:200]
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if message is None and isinstance(body, dict):
        message = body.get("message")
    return str(message)[:200] if message else detail[:200]


class OverContext(EngineRejected):
    """A refusal of a prompt that fits the server's context with fewer completion tokens:
    ``room`` of them."""

    def __init__(self, message: str, room: int) -> None:
        super().__init__(message)
        self.room = room


def context_room(detail: str) -> int | None:
    """The completion tokens a server's context leaves a prompt, from its refusal of the
    prompt with more (``detail``: its error body); None when it does not say both its
    context and the prompt's tokens in one of the servers' words below, or leaves none."""
    for pattern, slack in _OVER_CONTEXT:
        if (found := pattern.search(detail)) is not None:
            room = int(found.group("limit")) - int(found.group("prompt")) - slack
            return room if room > 0 else None
    return None


# Prompt and completion over the context, in the words of each server that says both numbers
# (searched in its error body whole: its message is longer than the reason kept), and the
# tokens to leave unasked besides: SGLang refuses a prompt and completion that reach its
# context (>=), where vLLM and TGI take one that fills it.
_OVER_CONTEXT = tuple(
    (re.compile(pattern, re.IGNORECASE | re.DOTALL), slack)
    for pattern, slack in (
        # OpenAI's, and vLLM serve's before 0.10
        (
            r"maximum context length is (?P<limit>\d+) tokens\. However, you requested \d+ "
            r"tokens \((?P<prompt>\d+) in the messages, \d+ in the completion\)",
            0,
        ),
        # vLLM serve since: "'max_tokens' or 'max_completion_tokens' is too large: 4096. This
        # model's maximum context length is 8192 tokens and your request has 5003 input
        # tokens (4096 > 8192 - 5003)."
        (
            r"maximum context length is (?P<limit>\d+) tokens and your request has "
            r"(?P<prompt>\d+) input tokens",
            0,
        ),
        # vLLM serve's renderer: "... However, you requested 4096 output tokens and your prompt
        # contains 5003 input tokens, for a total of 9099 tokens."
        (
            r"maximum context length is (?P<limit>\d+) tokens\. However, you requested \d+ "
            r"output tokens and your prompt contains (?P<prompt>\d+) input tokens",
            0,
        ),
        # SGLang (and servers that took its words): "Requested token count exceeds the
        # model's maximum context length of 8192 tokens. You requested a total of 9099
        # tokens: 5003 tokens from the input messages and 4096 tokens for the completion."
        (
            r"maximum context length of (?P<limit>\d+) tokens\. You requested a total of \d+ "
            r"tokens: (?P<prompt>\d+) tokens from the input messages",
            1,
        ),
        # TGI: "`inputs` tokens + `max_new_tokens` must be <= 8192. Given: 5003 `inputs`
        # tokens and 4096 `max_new_tokens`"
        (
            r"`inputs` tokens \+ `max_new_tokens` must be <= (?P<limit>\d+)\. Given: "
            r"(?P<prompt>\d+) `inputs` tokens",
            0,
        ),
    )
)


def refusal(reason: str) -> EngineRejected:
    """The upstream's refusal of a request for what it asks, with the upstream's reason: a
    parameter the server does not have at all (in its known words) is unsupported."""
    message = f"the engine refused the request: {reason}"
    return EngineUnsupported.from_engine(message) or EngineRejected(message)


def stream_error(chunk: dict[str, Any], *, text_sent: bool) -> EngineError:
    """An error event in a stream. Before any text, a refusal of the request for what it
    asks is a refusal (TGI, and older SGLang and llama.cpp, refuse in a 200 stream): its
    error type says validation, its status is one of ``REQUEST_REFUSED``, or it says the
    prompt is over the context in a known server's words. Anything else, or anything after
    text, is a failure midway (vLLM ends a request that failed while running so)."""
    error = chunk["error"]
    fields: dict[str, Any] = error if isinstance(error, dict) else {}
    said = str(fields.get("message", error) if fields else error)[:300]
    refused_status = fields.get("type") != _ANY_FAILURE_TYPE and any(
        _status(fields.get(name)) in REQUEST_REFUSED for name in _STATUS_FIELDS
    )
    if not text_sent and (
        "validation" in (chunk.get("error_type"), fields.get("error_type"))
        or refused_status
        or PromptTooLarge.from_engine(said, param=None) is not None
    ):
        return refusal(said)
    return EngineError(f"the upstream failed midway: {said}")


# Where servers put an HTTP status in a stream's error event: llama.cpp's and SGLang's
# ``code``, older SGLang's ``http_status_code``, others' ``status``.
_STATUS_FIELDS = ("code", "http_status_code", "status")
# vLLM serve's stream generators answer any exception with this type and code 400, a dead
# engine's included (newer versions say 500 for those): its status tells no refusal apart.
_ANY_FAILURE_TYPE = "BadRequestError"


def _status(value: object) -> int | None:
    """An HTTP status given as a number or a string of digits (not a code like "invalid")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
