"""OpenAI wire format: response bodies, SSE chunks and error bodies."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from laneway.openai_format import error_body, final_body, usage_body
from laneway.schema import RequestEnvelope

__all__ = [
    "DONE",
    "JSONResponse",
    "error_body",
    "final_body",
    "sse",
    "stream_chunk",
    "usage_body",
]

DONE = b"data: [DONE]\n\n"


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def stream_chunk(
    env: RequestEnvelope,
    *,
    text: str | None = None,
    finish_reason: str | None = None,
    role: bool = False,
    usage: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> bytes:
    choices: list[dict[str, Any]]
    if usage is not None:
        choices = []
    elif env.kind == "completion":
        choices = [
            {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        ]
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    chunk: dict[str, Any] = {
        "id": env.id,
        "object": "text_completion" if env.kind == "completion" else "chat.completion.chunk",
        "created": int(env.accepted_ts),
        "model": env.model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return sse(chunk)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
