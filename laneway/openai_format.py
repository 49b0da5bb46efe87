"""OpenAI response bodies, shared by the HTTP ingress and the batch results."""

from __future__ import annotations

from typing import Any

from laneway.schema import Reply, RequestEnvelope
from laneway.tool_frames import calls_of

__all__ = [
    "MAX_ERROR_CHARS",
    "MAX_PARAM_CHARS",
    "clipped",
    "error_body",
    "final_body",
    "usage_body",
]

# An error names what was sent, and what was sent may be a megabyte (a model name, a field's
# name): an error body stays small, whichever door it leaves by (a batch result that grew
# past Kafka's largest record could never be written, and held its partition's commits).
MAX_ERROR_CHARS = 2000
MAX_PARAM_CHARS = 200


def clipped(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with a note of how many more it had."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def error_body(
    message: str, *, type_: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": clipped(message, MAX_ERROR_CHARS),
            "type": type_,
            "param": None if param is None else clipped(param, MAX_PARAM_CHARS),
            "code": code,
        }
    }


def usage_body(reply: Reply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def final_body(env: RequestEnvelope, text: str, reply: Reply) -> dict[str, Any]:
    created = int(env.accepted_ts)
    if env.kind == "completion":
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": reply.finish_reason,
        }
        obj = "text_completion"
    else:
        calls = None
        if env.tools:  # its text frames its calls
            text, calls = calls_of(text, reply.call_ids, env.id)
        # OpenAI's description requires refusal (null unless the model refused).
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if calls:
            # As OpenAI answers a call: its content null when the model wrote no text.
            message["content"] = text or None
            message["tool_calls"] = calls
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": reply.finish_reason,
        }
        obj = "chat.completion"
    return {
        "id": env.id,
        "object": obj,
        "created": created,
        "model": env.model,
        "choices": [choice],
        "usage": usage_body(reply),
        "system_fingerprint": reply.route or env.route,
    }
