"""The OpenAI request bodies the ingress accepts, validated with errors that name the field.

Each field OpenAI defines is honoured, accepted as inert (it steers OpenAI's bookkeeping, not
the text generated), or refused with a 400 naming it: none is silently dropped. README's
"OpenAI compatibility" says which is which.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from laneway.errors import BadRequest
from laneway.json_shape import MAX_JSON_VALUES, json_problem, too_many_values
from laneway.schema import ChatMessage

__all__ = [
    "BODY_NO_OPS",
    "MESSAGE_INERT",
    "MESSAGE_NO_OPS",
    "ChatRequest",
    "CompletionRequest",
    "parse_body",
    "validate_body",
]

MAX_STOP_STRINGS = 32

# Fields laneway does not act on, accepted only at a value that asks for nothing laneway does
# not do anyway (null always does); any other value is refused, so no client believes it got
# the logprobs, function calls or extra choices it asked for. Other unknown fields are refused too.
BODY_NO_OPS: Mapping[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),  # chat: a flag; completions: a count, where even 0 asks for some
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),  # a chat's are honoured (``ChatRequest``); a completion's: none
    "tool_choice": ("none",),
    "functions": (),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "moderation": (),
    "store": (False,),  # nothing is stored for retrieval
    "service_tier": ("auto", "default"),  # priority comes from the team's tier
    # vLLM's own sampling fields, at the values that change nothing (some clients send them
    # whatever the server): -1 and 0 are no top-k, as vLLM reads them.
    "top_k": (-1, 0),
    "min_p": (0,),
    "repetition_penalty": (1,),
}
# What an assistant message carries when a client sends laneway's own answer back as history.
MESSAGE_NO_OPS: Mapping[str, tuple[object, ...]] = {
    "refusal": (),
    "annotations": ([],),
    "function_call": (),
    "audio": (),
}
# What clients put on every message that changes no prompt, taken whatever its value: caching
# hints (Copilot's BYOK `copilot_cache_control`, `cache_control`), a reasoning model's thinking
# sent back as history (Continue and Zed send `reasoning_content`; workers send each message's
# role and content only), a client's own message id (Twinny).
MESSAGE_INERT = frozenset(
    {
        "cache_control",
        "copilot_cache_control",
        "reasoning_content",
        "reasoning",
        "id",
        # Copilot BYOK's ids of a thinking model's chain of thought, sent back as history.
        "cot_id",
        "cot_summary",
        # openai-python's parse() output sent back as history: its parsed object.
        "parsed",
    }
)


def _is_no_op(value: object, allowed: Sequence[object]) -> bool:
    # bool is an int to Python: `n: true` must not pass for 1, nor `echo: 0` for false.
    return value is None or any(
        value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed
    )


class _Strict(BaseModel):
    # Strict types, as OpenAI's are: `"stream": 1` or `"max_tokens": true` is an error, not
    # a guess (pydantic's lax mode would stream, or ask for one token).
    model_config = ConfigDict(extra="forbid", strict=True)
    no_ops: ClassVar[Mapping[str, tuple[object, ...]]] = {}
    inert: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_and_no_ops(cls, data: object) -> object:
        # Null reads as absent (OpenAI's description makes most fields nullable), and a field
        # of `no_ops` at a no-op value is left out; whatever else is not a field is refused.
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None
            and key not in cls.inert
            and not (key in cls.no_ops and _is_no_op(value, cls.no_ops[key]))
        }


class _StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # inert: laneway never pads its chunks


# OpenAI's bound on a request's tools.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 256


class _Function(_Strict):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Strict):
    # A function tool. OpenAI's `custom` tools (free text in and out) are its own: refused.
    # `cache_control` is the caching hint some clients put on their last tool: inert.
    inert = frozenset({"cache_control"})

    type: Literal["function"]
    function: _Function


class _Named(_Strict):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)


class _NamedChoice(_Strict):
    type: Literal["function"]
    function: _Named


class _CalledFunction(_Strict):
    inert = frozenset({"parsed_arguments"})  # openai-python's parse() of a tool's arguments

    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    arguments: str


class _ToolCall(_Strict):
    """A tool call of an assistant message sent back as history. Its ``index`` (openai-
    python's stream helper keeps a streamed call's in the message it gives back) is inert."""

    inert = frozenset({"index"})

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: _CalledFunction


class _JsonSchema(_Strict):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = None
    # "schema" would shadow pydantic's own attribute: read and written by its JSON name.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class _ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> _ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only with it")
        return self


class _Body(_Strict):
    no_ops = BODY_NO_OPS

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    # Honoured where the engine samples by them (vLLM, and upstreams that pass them on; the
    # sim engine writes the same text whatever they say). Tabby's chat sends 0.5 always.
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # OpenAI takes 4; IDE plugins send a self-hosted server their FIM template's whole list
    # (Continue: 9 and more for Qwen's), which vLLM takes. A bound all the same: each is
    # looked for in every token's text.
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    # Honoured where the engine samples by seed (vLLM, and upstreams that pass it on; the sim
    # engine is deterministic anyway). Without one, each request gets a seed of its own.
    # -1 is llama.cpp's "a random one" (its clients send it): no seed. Other negatives are
    # refused: TGI takes none, and vLLM would read -1 as a fixed seed.
    seed: int | None = Field(None, ge=-1, lt=2**63)
    # Inert: they steer OpenAI's bookkeeping (abuse tracking, its cache, stored metadata), not
    # the text; laneway's prefix cache needs no key (a session already lands on one worker).
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # without tools there is nothing to run in parallel

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        # An empty stop string stops nowhere (accepted with no effect, as it was on laneway's
        # own engine); vLLM refuses a request that carries one, so it is never passed on.
        return [stop for stop in value if stop]

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, value: int | None) -> int | None:
        return None if value == -1 else value

    @field_validator("stream_options", mode="before")
    @classmethod
    def _options_of_a_stream(cls, value: object, info: ValidationInfo) -> object:
        # As OpenAI and vLLM answer (vLLM lets an empty one pass): taken silently, they
        # would promise a usage chunk that a JSON answer never sends.
        if value and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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


# `cache_control` is a prompt-caching hint (Anthropic's, which some clients send to every
# server): inert, as laneway's prefix cache needs none.
_TEXT_PART_FIELDS = frozenset({"type", "text", "cache_control"})


class _ChatMessageIn(_Strict):
    no_ops = MESSAGE_NO_OPS
    inert = MESSAGE_INERT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    # The calls an assistant made, and in a tool message the id of the call it answers.
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    # The participant's name (AutoGen names every message, LangGraph its agents): passed on
    # with the message; a chat template that knows names uses it.
    name: str | None = Field(None, max_length=MAX_TOOL_NAME_CHARS)

    @model_validator(mode="after")
    def _calls_where_they_belong(self) -> _ChatMessageIn:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message has tool_calls: only an assistant's has")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"a {self.role} message has tool_call_id: only a tool message has")
        return self

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: object) -> object:
        for i, part in enumerate(value if isinstance(value, list) else []):
            if part.get("type") != "text":
                raise ValueError(f"part {i} is {part.get('type')!r}: only text parts are served")
            if not isinstance(part.get("text"), str):  # pydantic reports a ValueError only
                said = (
                    "has no 'text'" if "text" not in part else "has a 'text' that is not a string"
                )
                raise ValueError(f"text part {i} {said}")  # noqa: TRY004
            if unknown := sorted(set(part) - _TEXT_PART_FIELDS):
                # Refused as an unknown field of the body is: none is dropped unsaid.
                raise ValueError(
                    f"text part {i} has {', '.join(map(repr, unknown))}, which laneway does not "
                    "know (a text part takes 'type', 'text' and an inert 'cache_control')"
                )
        return value

    def flat(self) -> ChatMessage:
        if isinstance(self.content, list):
            # One line each, as vLLM and other servers join a message's text parts: joined
            # with nothing, the words either side of a boundary would run together.
            text = "\n".join(part["text"] for part in self.content)
        else:
            text = self.content or ""
        # `developer` is OpenAI's newer name for `system`; chat templates know `system`, and
        # many leave out a role they do not know, instructions and all.
        role = "system" if self.role == "developer" else self.role
        calls = [c.model_dump(exclude_none=True) for c in self.tool_calls or ()] or None
        return ChatMessage(
            role=role,
            content=text,
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
        )


class ChatRequest(_Body):
    # `tools: []` asks for none; `tool_choice: "none"` is honoured (with tools, it forbids
    # calling them); `response_format` is honoured (text: as if absent).
    no_ops = {k: v for k, v in BODY_NO_OPS.items() if k not in ("tool_choice", "response_format")}

    messages: list[_ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Passed on to an upstream server, which calls them (the sim and vllm engines call none:
    # a 400 naming `tools`); its calls come back whole, at the end of a stream.
    tools: list[_Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    # Checked here (one message whatever was sent, not one per shape it might have been).
    tool_choice: Any = None
    # JSON out (an agent's structured output): passed on to an upstream server, which
    # constrains its text to it; the sim and vllm engines refuse it (a 400 naming it).
    response_format: _ResponseFormat | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: object, info: ValidationInfo) -> object:
        if value is None or value == "none":
            return value
        choice: str | _NamedChoice
        if value in ("auto", "required"):
            choice = str(value)
        else:
            try:
                choice = _NamedChoice.model_validate(value)
            except ValidationError:
                raise ValueError(
                    'must be "none", "auto", "required" or {"type": "function", '
                    '"function": {"name": <one of the tools>}}'
                ) from None
        tools: list[_Tool] | None = info.data.get("tools")
        if not tools:
            raise ValueError("only allowed when tools are given")
        names = {tool.function.name for tool in tools}
        if isinstance(choice, _NamedChoice) and choice.function.name not in names:
            raise ValueError(f"names {choice.function.name!r}, which is none of the tools")
        return choice

    def tool_fields(self) -> dict[str, Any]:
        """What the envelope carries of the tools and the response format: nothing without."""
        fields: dict[str, Any] = {}
        if self.response_format is not None and self.response_format.type != "text":
            fields["response_format"] = self.response_format.model_dump(
                exclude_none=True, by_alias=True
            )
        if self.tools is None:
            return fields
        fields["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            fields["tool_choice"] = (
                choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
            )
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        return fields

    def flat_messages(self) -> list[ChatMessage]:
        return [m.flat() for m in self.messages]


B = TypeVar("B", bound=BaseModel)


def parse_body(model: type[B], raw: bytes) -> B:
    """Decode and validate a JSON body; ``BadRequest`` names the field at fault."""
    if too_many_values(raw):
        # Refused before it is decoded: decoding is what it costs (``laneway.json_shape``).
        raise BadRequest(
            f"request body holds more than {MAX_JSON_VALUES:,} JSON values (arrays, objects "
            "and their items); no request needs that many"
        )
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        lone = any(m in str(exc) for m in _LONE_SURROGATE_ERRORS)
        data = _with_lone_surrogates(raw) if lone else None
        if data is None:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
    return validate_body(model, data)


def _with_lone_surrogates(raw: bytes) -> object | None:
    """JSON whose only fault is a lone UTF-16 surrogate escape (``"\\ud83d"``), read with
    each such half as U+FFFD; None if it has another fault. An editor plugin in JavaScript
    that cuts a prompt in the middle of an emoji sends one (``JSON.stringify`` escapes it),
    and refusing it would fail every keystroke until the cut moved on."""
    try:
        # UTF-8 only, as orjson reads it (the standard library would guess UTF-16 from a
        # body's first bytes, and take encoded surrogates), and finite numbers only.
        text = raw.decode("utf-8")
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
        return _replace_surrogates(data)
    except (ValueError, RecursionError):
        return None


# What orjson says of an escaped surrogate with no partner (and only of that: its message
# for a body that is no UTF-8 names surrogates too).
_LONE_SURROGATE_ERRORS = (
    "no low surrogate in string",
    "invalid low surrogate in string",
    "invalid high surrogate in string",
)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is beyond a double")
    return value


def _replace_surrogates(value: object) -> object:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_replace_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def validate_body(model: type[B], data: object, *, prefix: str = "") -> B:
    """Validate decoded JSON; ``BadRequest`` names the field (under ``prefix``)."""
    if not isinstance(data, dict):
        raise BadRequest(f"{prefix or 'request body'} must be a JSON object", param=prefix or None)
    if (problem := json_problem(data)) is not None:
        path, what = problem
        raise BadRequest(f"{prefix}{path}: {what}", param=prefix + path.split(".", 1)[0])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = prefix + ".".join(str(p) for p in err["loc"])
        raise BadRequest(f"{field}: {_reason(err)}", param=field) from None


def _reason(err: ErrorDetails) -> str:
    if err["type"] in ("int_type", "int_parsing_size") and isinstance(err["input"], float):
        # JSON integers beyond 64 bits arrive as floats: say what was sent, not "a string".
        return f"expected an integer, got {err['input']:g}"
    if err["type"] != "extra_forbidden":
        return err["msg"].removeprefix("Value error, ")
    loc = err["loc"]
    allowed: tuple[object, ...] | None = None
    if len(loc) == 1:
        allowed = BODY_NO_OPS.get(str(loc[0]))
    elif len(loc) == 3 and loc[0] == "messages":
        allowed = MESSAGE_NO_OPS.get(str(loc[2]))
    if allowed is None:
        return "laneway does not know this field (README: OpenAI compatibility)"
    asked = orjson.dumps(err["input"]).decode()
    if len(asked) > 60:  # a whole tools list would bury the point
        asked = asked[:57] + "..."
    fine = " or ".join(orjson.dumps(v).decode() for v in (None, *allowed))
    return f"{asked} is not supported by laneway; send {fine} or leave the field out"
