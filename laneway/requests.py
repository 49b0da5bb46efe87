"""What every door checks before a request may enter a lane: model, size limits, shape.

The ingress (HTTP) and the batch workers (Kafka) apply the same rules, so a line of a batch
job fails exactly where the same body would fail over HTTP.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import orjson

from laneway.constants import RequestClass
from laneway.errors import ModelNotFound, PromptTooLarge
from laneway.openai_api import ChatRequest, CompletionRequest
from laneway.openai_format import clipped
from laneway.schema import ApiKind, ChatMessage, RequestEnvelope
from laneway.settings import CommonSettings
from laneway.tokens import estimate_tokens

__all__ = ["RequestShape", "check_served", "shape_request"]

# What a chat template adds to the prompt (OpenAI's rule of thumb for its own models).
_MESSAGE_TOKENS = 3  # per message: its role and separators
_REPLY_TOKENS = 3  # once: the start of the assistant's reply
# Sampling fields with a default of laneway's that an upstream server is not sent unless the
# client set them (it has defaults of its own: vLLM its model's generation config).
_SAMPLING_DEFAULTS = ("temperature", "top_p")


@dataclass(frozen=True, slots=True)
class RequestShape:
    kind: ApiKind
    prompt: str  # the text prompt (chat: the messages' text, for size and affinity)
    messages: list[ChatMessage] | None
    suffix: str | None
    max_tokens: int
    prompt_tokens: int
    body: CompletionRequest | ChatRequest
    max_tokens_default: bool = False  # the client set none, or the cap or more: it is the cap
    # A chat's tools, tool choice and response format, as the envelope carries them.
    tool_fields: dict[str, Any] = field(default_factory=dict)

    def envelope(self, **fields: Any) -> RequestEnvelope:
        """The envelope of this request; ``fields`` add who, where and when."""
        body = self.body
        return RequestEnvelope(
            kind=self.kind,
            model=body.model,
            route=body.model,
            prompt=self.prompt if self.messages is None else "",
            suffix=self.suffix,
            messages=self.messages,
            max_tokens=self.max_tokens,
            max_tokens_default=self.max_tokens_default,
            temperature=body.temperature,
            top_p=body.top_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            stop=body.stop,
            seed=body.seed,
            prompt_tokens=self.prompt_tokens,
            unset=[name for name in _SAMPLING_DEFAULTS if name not in body.model_fields_set],
            **self.tool_fields,
            **fields,
        )


def check_served(model: str, models: Collection[str], *, param: str = "model") -> None:
    """``ModelNotFound`` naming the served models unless ``model`` is one of them."""
    if model not in models:
        raise ModelNotFound(
            f"model {clipped(repr(model), 100)} is not served here; "
            f"available: {sorted(models)} (LANEWAY_MODELS)",
            param=param,
        )


def shape_request(
    settings: CommonSettings,
    body: CompletionRequest | ChatRequest,
    cls: RequestClass,
    *,
    where: str = "",
) -> RequestShape:
    """Validate ``body`` against the served models and the limits of ``cls``. ``where``:
    what an error's ``param`` is prefixed with (``body.`` for a batch line's body)."""
    check_served(body.model, settings.models, param=f"{where}model")
    if isinstance(body, CompletionRequest):
        kind: ApiKind = "completion"
        prompt, messages, suffix = body.prompt, None, body.suffix
        tool_fields = {}
        max_tokens = body.max_tokens
        cap = settings.completion_max_tokens
    else:
        kind = "chat"
        messages, suffix = body.flat_messages(), None
        tool_fields = body.tool_fields()
        prompt = "".join(m.content for m in messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        cap = settings.chat_max_tokens
    if cls == "batch":  # a batch line may be as long as a chat
        cap = max(cap, settings.chat_max_tokens)
    # An upper bound, not a length: more than the class's cap gets the cap (finish_reason
    # `length` says where it ended). IDE plugins send far more than a completion's cap
    # (Continue: 4,096 unless configured), and a 400 failed every keystroke of theirs. One
    # that asks the cap or more leaves the length to laneway, which may cut it to fit a
    # server's context (Continue's chat asks 4,096, the chat's cap).
    max_tokens_default = max_tokens is None or max_tokens >= cap
    max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    prompt_tokens = estimate_tokens(prompt) + estimate_tokens(suffix or "")
    if messages is not None:
        # A chat template frames every message (its role, separators): OpenAI's count is
        # 3 tokens a message and 3 more that prime the reply. Without them 30,000 one-letter
        # messages would pass as 30,000 tokens and be billed about that, however many the
        # engine reads.
        prompt_tokens += _MESSAGE_TOKENS * len(messages) + _REPLY_TOKENS
        # The tools' descriptions and the calls in the history reach the model as text too
        # (an agent's tools are often thousands of tokens).
        prompt_tokens += _tool_tokens(tool_fields, messages)
    if prompt_tokens > settings.max_prompt_tokens:
        what = "messages" if messages is not None else "prompt"
        raise PromptTooLarge(
            settings.max_prompt_tokens,
            f"However, your {what} came to about {prompt_tokens} tokens by laneway's estimate "
            "(punctuation counts two characters a token: a model's own count is lower for code). "
            f"Please reduce the length of the {what}.",
            param=f"{where}{what}",
            setting="LANEWAY_MAX_PROMPT_TOKENS",
        )
    return RequestShape(
        kind,
        prompt,
        messages,
        suffix,
        max_tokens,
        prompt_tokens,
        body,
        max_tokens_default,
        tool_fields,
    )


def _tool_tokens(tool_fields: dict[str, Any], messages: list[ChatMessage]) -> int:
    """Estimated tokens of a chat's tools and of the tool calls in its history."""
    # A call's arguments are JSON text already: counted as they are, not escaped again.
    calls = "".join(
        call["function"]["name"] + call["function"]["arguments"]
        for message in messages
        for call in message.tool_calls or ()
    )
    # A response format constrains the decoding, not the prompt (vLLM's, SGLang's).
    tools = {k: v for k, v in tool_fields.items() if k != "response_format"}
    return estimate_tokens(calls) + (estimate_tokens(orjson.dumps(tools).decode()) if tools else 0)
