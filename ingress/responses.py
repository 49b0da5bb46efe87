"""OpenAI wire format: response bodies, SSE chunks and error bodies."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from laneway.schema import Reply, RequestEnvelope

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


def error_body(
    message: str, *, type_: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


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
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
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
        "system_fingerprint": reply.route,
    }


def stream_chunk(
    env: RequestEnvelope,
    *,
    text: str | None = None,
    finish_reason: str | None = None,
    role: bool = False,
    usage: dict[str, Any] | None = None,
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
