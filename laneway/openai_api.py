"""The OpenAI request bodies the ingress accepts, validated with errors that name the field."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from laneway.errors import BadRequest
from laneway.schema import ChatMessage

__all__ = ["ChatRequest", "CompletionRequest", "parse_body", "validate_body"]


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI clients send options we do not act on.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list, max_length=4)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    n: Literal[1] = 1

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    prompt: str
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: object) -> object:
        if isinstance(value, list):
            if len(value) != 1 or not isinstance(value[0], str):
                raise ValueError("only one text prompt per request is supported")
            return value[0]
        return value


class _ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def flat(self) -> ChatMessage:
        if isinstance(self.content, list):
            text = "".join(
                str(part.get("text", "")) for part in self.content if part.get("type") == "text"
            )
        else:
            text = self.content or ""
        return ChatMessage(role=self.role, content=text)


class ChatRequest(_Body):
    messages: list[_ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def flat_messages(self) -> list[ChatMessage]:
        return [m.flat() for m in self.messages]


B = TypeVar("B", bound=BaseModel)


def parse_body(model: type[B], raw: bytes) -> B:
    """Decode and validate a JSON body; ``BadRequest`` names the field at fault."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    return validate_body(model, data)


def validate_body(model: type[B], data: object, *, prefix: str = "") -> B:
    """Validate decoded JSON; ``BadRequest`` names the field (under ``prefix``)."""
    if not isinstance(data, dict):
        raise BadRequest(f"{prefix or 'request body'} must be a JSON object", param=prefix or None)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = prefix + ".".join(str(p) for p in err["loc"])
        raise BadRequest(f"{field}: {err['msg']}", param=field) from None
