"""No request field is silently dropped: each is honoured, inert, or refused naming the field."""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from laneway.errors import BadRequest
from laneway.openai_api import (
    BODY_NO_OPS,
    MESSAGE_NO_OPS,
    ChatRequest,
    CompletionRequest,
    validate_body,
)
from laneway.requests import shape_request
from laneway.settings import CommonSettings
from tests.stack import LiveStack
from workers.upstream_refusals import context_room

ROOT = Path(__file__).resolve().parent.parent
FIELDS = json.loads((ROOT / "tests" / "data" / "openai_schemas.json").read_text())["request_fields"]
CHAT = {"model": "laneway-chat", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "laneway-code", "prompt": "def f():"}
TOOL = {"type": "function", "function": {"name": "run", "parameters": {}}}


def _nested(model: type[BaseModel], field: str) -> type[BaseModel]:
    """The model of ``field``'s items (or of the field itself when optional)."""
    annotation = model.model_fields[field].annotation
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise LookupError(field)


MESSAGE = _nested(ChatRequest, "messages")
STREAM_OPTIONS = _nested(ChatRequest, "stream_options")


@pytest.mark.parametrize(
    ("schema", "model", "no_ops"),
    [
        ("CreateCompletionRequest", CompletionRequest, BODY_NO_OPS),
        ("CreateChatCompletionRequest", ChatRequest, BODY_NO_OPS),
        ("ChatCompletionRequestMessage", MESSAGE, MESSAGE_NO_OPS),
        ("ChatCompletionStreamOptions", STREAM_OPTIONS, {}),
    ],
)
def test_every_field_openai_defines_is_decided_and_documented(
    schema: str, model: type[BaseModel], no_ops: dict[str, Any]
) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## OpenAI compatibility", 1)[1].split("\n## ", 1)[0]
    for name in FIELDS[schema]:
        assert name in model.model_fields or name in no_ops, f"{schema}.{name}: undecided"
        assert re.search(rf"[`.]{name}[`.]", section), f"{schema}.{name}: not in README"


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    (COMPLETION, "n", 2),
    (COMPLETION, "best_of", 3),
    (COMPLETION, "echo", True),
    (COMPLETION, "logprobs", 0),  # a count for completions: even 0 asks for logprobs
    (COMPLETION, "logit_bias", {"50256": -100}),
    (COMPLETION, "presence_penalty", 2.5),  # honoured from -2 to 2, as OpenAI and vLLM take it
    (COMPLETION, "top_k", 40),  # vLLM's, not OpenAI's
    (CHAT, "n", True),  # not 1, though Python says True == 1
    (CHAT, "logprobs", True),
    (CHAT, "top_logprobs", 3),
    (CHAT, "frequency_penalty", -3),
    (CHAT, "min_p", 0.1),  # vLLM's own: only at the value that changes nothing
    (CHAT, "repetition_penalty", 1.2),
    (COMPLETION, "tools", [TOOL]),  # a chat's are honoured
    (CHAT, "tool_choice", "auto"),  # with no tools to choose from
    (CHAT, "functions", [TOOL["function"]]),
    (CHAT, "function_call", "auto"),
    (COMPLETION, "response_format", {"type": "json_object"}),  # a chat's is honoured
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "web_search_options", {}),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "verbosity", "low"),
    (CHAT, "moderation", {"model": "omni-moderation-latest"}),
    (CHAT, "store", True),
    (CHAT, "service_tier", "flex"),
    (CHAT, "suffix", "x"),  # a completions field
    # Only for a stream, as OpenAI and vLLM answer: a JSON answer has no usage chunk to send.
    (CHAT, "stream_options", {"include_usage": True}),
    (COMPLETION, "stream_options", {"include_usage": False}),
]


@pytest.mark.parametrize(("base", "field", "value"), REFUSED)
def test_an_unsupported_value_is_refused_naming_the_field(
    base: dict[str, Any], field: str, value: object
) -> None:
    model = ChatRequest if "messages" in base else CompletionRequest
    with pytest.raises(BadRequest) as refused:
        validate_body(model, {**base, field: value})
    assert refused.value.param == field
    assert refused.value.message.startswith(f"{field}: ")
    # A batch line names the same field under its body.
    with pytest.raises(BadRequest, match=f"^body.{field}: "):
        validate_body(model, {**base, field: value}, prefix="body.")


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "hi", "name": 5}, "messages.0.name"),
        # A tool call is an assistant's, and the answer to one a tool message's.
        ({"role": "user", "content": "42", "tool_call_id": "call_1"}, "messages.0"),
        (
            {"role": "assistant", "content": None, "tool_calls": [TOOL]},
            "messages.0.tool_calls.0.id",
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages.0.content",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages.0.content"),
        (
            {"role": "user", "content": [{"type": "text", "text": "hi", "weight": 2}]},
            "messages.0.content",
        ),
    ],
)
def test_a_message_laneway_cannot_render_is_refused(message: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        validate_body(ChatRequest, {**CHAT, "messages": [message]})
    assert refused.value.param == param
    content = message["content"]
    if isinstance(content, list) and content[0]["type"] == "text":
        # A text part whose text is missing or not a string is told so, not that only
        # text parts are served.
        assert "only text parts" not in refused.value.message
        assert "'text'" in refused.value.message


@pytest.mark.parametrize(
    "body",
    [
        {**CHAT, "max_completion_tokens": 10**6},
        {**CHAT, "max_tokens": 10**6},
        {**COMPLETION, "max_tokens": 4096},  # Continue's autocomplete, unless configured
    ],
)
def test_a_length_over_the_classs_cap_gets_the_cap(body: dict[str, Any]) -> None:
    """``max_tokens`` is an upper bound: more than the cap gets the cap (its finish_reason
    ``length`` says where it ended), and may be cut further to fit an upstream's context
    (``max_tokens_default``). A 400 failed every keystroke of an IDE plugin that sends
    4,096 whatever the request."""
    model = ChatRequest if "messages" in body else CompletionRequest
    settings = CommonSettings()
    request = validate_body(model, body)
    cls = "chat" if "messages" in body else "completion"
    shaped = shape_request(settings, request, cls)
    cap = settings.chat_max_tokens if cls == "chat" else settings.completion_max_tokens
    assert (shaped.max_tokens, shaped.max_tokens_default) == (cap, True)
    in_a_line = shape_request(settings, request, "batch", where="body.")
    assert in_a_line.max_tokens == max(cap, settings.chat_max_tokens)
    asked = validate_body(model, {**body, "max_tokens": 8, "max_completion_tokens": None})
    assert (shape_request(settings, asked, cls).max_tokens_default) is False
    at_cap = validate_body(model, {**body, "max_tokens": cap, "max_completion_tokens": None})
    assert (shape_request(settings, at_cap, cls).max_tokens_default) is True


async def test_over_http_continues_autocomplete_request_is_answered(stack: LiveStack) -> None:
    """Continue's autocomplete as it sends it to a self-hosted server (core/llm/llms/
    OpenAI.ts ``_legacystreamComplete``): max_tokens 4,096, temperature 0.01, streamed, its
    FIM template's every stop string. Refused before (max_tokens over the completion cap,
    more than 4 stop strings): every keystroke a 400."""
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    stops = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
    stops += ["<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>"]
    stream = await client.completions.create(
        model="laneway-code",
        prompt="<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>",
        max_tokens=4096,
        temperature=0.01,
        stream=True,
        stop=[*stops, "\n\n", "/src/", "#- coding: utf-8"],
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_no_op_and_inert_values_are_accepted_and_change_nothing() -> None:
    plain = validate_body(ChatRequest, CHAT)
    body = {
        **CHAT,
        "n": 1,
        "logprobs": False,
        "top_logprobs": 0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0,
        "logit_bias": {},
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "store": False,
        "service_tier": "auto",
        "temperature": None,  # null is absent: the default
        "user": "u-1",
        "safety_identifier": "s-1",
        "metadata": {"ticket": "42"},
        "prompt_cache_key": "repo-1",
        "parallel_tool_calls": False,
        "top_k": -1,  # vLLM's own, at values that change nothing
        "min_p": 0,
        "repetition_penalty": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    accepted = validate_body(ChatRequest, body)
    assert accepted.flat_messages() == plain.flat_messages()
    assert (accepted.temperature, accepted.top_p, accepted.stop) == (1.0, 1.0, [])
    assert accepted.include_usage
    # An empty stop string stops nowhere: taken with no effect, never passed on (vLLM refuses
    # a request that carries one).
    assert validate_body(ChatRequest, {**CHAT, "stop": ""}).stop == []
    assert validate_body(ChatRequest, {**CHAT, "stop": ["", "\n"]}).stop == ["\n"]


async def test_over_http_refusals_name_the_field_and_an_answer_can_be_sent_back(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("chat")
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    messages: list[Any] = [{"role": "user", "content": "explain this diff"}]
    for option, value in (("n", 2), ("tools", [TOOL]), ("top_logprobs", 1)):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="laneway-chat", messages=messages, max_tokens=8, **{option: value}
            )
        assert refused.value.body["param"] == option  # type: ignore[index]
    first = await client.chat.completions.create(
        model="laneway-chat", messages=messages, max_tokens=8
    )
    # The SDK sends the answer back as it came (refusal: null included): a common pattern.
    messages += [first.choices[0].message, {"role": "user", "content": "shorter"}]
    second = await client.chat.completions.create(
        model="laneway-chat", messages=messages, max_tokens=8, n=1, user="u-1"
    )
    assert second.choices[0].message.content


async def test_over_http_a_stop_sequence_ends_the_text(stack: LiveStack) -> None:
    """``stop`` reaches the engine: the text ends before the stop sequence, ``finish_reason``
    ``stop`` (the sim engine here honours it as vLLM does)."""
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    prompt = "def parse(self, data):\n    "
    whole = await client.completions.create(model="laneway-code", prompt=prompt, max_tokens=64)
    text = whole.choices[0].text
    assert len(text) > 12
    stop = text[8:12]
    cut = text.find(stop)
    stopped = await client.completions.create(
        model="laneway-code", prompt=prompt, max_tokens=64, stop=[stop]
    )
    assert stopped.choices[0].text == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = await client.completions.create(
        model="laneway-code", prompt=prompt, max_tokens=64, stop=stop, stream=True
    )
    assert "".join([chunk.choices[0].text async for chunk in streamed]) == text[:cut]


async def test_over_http_the_fields_that_steer_the_text_reach_a_separate_upstream(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """In front of a separate OpenAI-compatible server (the openai engine), each honoured
    field arrives there as the client sent it, judged by that server's own log, and its
    ``stop`` ends the text there: the client gets the text before it and ``stop``."""
    upstream = await upstreams(slots=2, token_ms=1)
    ingress = await stack.start_ingress()
    for pool in ("completion", "chat"):
        await stack.start_worker(
            pool, engine="openai", upstream_url=upstream.url, upstream_model="up"
        )
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    steer = {
        "temperature": 0.3,
        "top_p": 0.8,
        "seed": 7,
        "presence_penalty": 0.5,  # Tabby's chat sends 0.5 whatever the request
        "frequency_penalty": -0.25,
    }
    completion = await client.completions.create(
        model="laneway-code", prompt="fields-a", suffix=" return x", max_tokens=12,
        stop=["gamma"], **steer,
    )  # fmt: skip
    assert completion.choices[0].text == "alpha beta "  # the upstream's words, cut at gamma
    assert completion.choices[0].finish_reason == "stop"
    chat = await client.chat.completions.create(
        model="laneway-chat", messages=[{"role": "user", "content": "fields-b"}],
        max_completion_tokens=12, stop="delta", stream=True, **steer,
    )  # fmt: skip
    chunks = [chunk async for chunk in chat]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "alpha beta gamma "
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    sent = {
        "fields-a": {**steer, "max_tokens": 12, "stop": ["gamma"], "suffix": " return x"},
        "fields-b": {**steer, "max_tokens": 12, "stop": ["delta"]},
    }
    for prompt, fields in sent.items():
        entry = upstream.entry(prompt)
        assert entry is not None, f"{prompt} never reached the upstream"
        assert entry["sampling"] == fields
        assert entry["finish"] == "stop"


async def test_a_chat_that_sets_no_length_gets_what_the_context_leaves_up_to_the_cap(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """A chat with no ``max_tokens`` is sent laneway's cap; a server whose context has less
    room after the prompt refuses that, and the chat is sent again with the room its refusal
    names, as the server itself gives a chat that sets none. Before, the client got a 400
    ``context_length_exceeded`` for a prompt well within the context: on an 8k model, any
    chat over about 4k tokens."""
    upstream = await upstreams(slots=2, token_ms=1, max_model_len=100)
    ingress = await stack.start_ingress(chat_max_tokens=60)
    await stack.start_worker(
        "chat", engine="openai", upstream_url=upstream.url, upstream_model="up"
    )
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    # 200 characters, 50 tokens to this server: 50 of its 100 left, fewer than the cap (60).
    near = "near-" + "y" * 195
    answer = await client.chat.completions.create(
        model="laneway-chat", messages=[{"role": "user", "content": near}]
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 50
    sent = [(e["outcome"], e["sampling"]["max_tokens"]) for e in upstream.entries()]
    assert sent == [("refused", 60), ("done", 50)]
    # One with room gets the cap at once.
    short = await client.chat.completions.create(
        model="laneway-chat", messages=[{"role": "user", "content": "short"}]
    )
    assert short.usage is not None
    assert short.usage.completion_tokens == 60
    # Asking the cap (Continue's chat asks 4,096) or more leaves the length to laneway too.
    capped = await client.chat.completions.create(
        model="laneway-chat", messages=[{"role": "user", "content": near}], max_tokens=60
    )
    assert capped.usage is not None
    assert capped.usage.completion_tokens == 50
    # A length under the cap the client set goes on as set, and the refusal back to it.
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="laneway-chat", messages=[{"role": "user", "content": near}], max_tokens=55
        )
    assert refused.value.code == "context_length_exceeded"
    assert len(upstream.entries()) == 6  # that one not sent again


@pytest.mark.parametrize(
    ("said", "room"),
    [
        (  # OpenAI's words, and vLLM serve's before 0.10 (and the test upstream's)
            "This model's maximum context length is 8192 tokens. However, you requested 9099 "
            "tokens (5003 in the messages, 4096 in the completion). Please reduce the length "
            "of the messages or completion.",
            3189,
        ),
        (  # vLLM serve since
            "'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's maximum "
            "context length is 8192 tokens and your request has 5003 input tokens "
            "(4096 > 8192 - 5003).",
            3189,
        ),
        (  # SGLang, and newer vLLM
            '{"object": "error", "message": "Requested token count exceeds the model\'s '
            "maximum context length of 8192 tokens. You requested a total of 9099 tokens: "
            "5003 tokens from the input messages and 4096 tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit "
            'within the limit.", "type": "BadRequestError", "param": null, "code": 400}',
            3188,  # SGLang refuses a prompt and completion that reach its context
        ),
        (  # TGI
            "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 8192. "
            "Given: 5003 `inputs` tokens and 4096 `max_new_tokens`",
            3189,
        ),
        # The prompt alone fills the context: no room, a refusal as it is.
        (
            "This model's maximum context length is 8192 tokens. However, you requested 9192 "
            "tokens (8192 in the messages, 1000 in the completion).",
            None,
        ),
        # Only the context: no room to tell.
        ("This model's maximum context length is 8192 tokens.", None),
    ],
)
def test_the_room_a_servers_context_leaves_is_read_from_its_refusal(
    said: str, room: int | None
) -> None:
    assert context_room(said) == room


def test_a_developer_message_reaches_the_engine_as_a_system_message() -> None:
    """OpenAI's ``developer`` role is its newer name for ``system``; chat templates know
    ``system`` and many drop a role they do not know, with the instructions in it."""
    body = {
        **CHAT,
        "messages": [
            {"role": "developer", "content": "answer in French"},
            {"role": "user", "content": "hi"},
        ],
    }
    flat = validate_body(ChatRequest, body).flat_messages()
    assert [(m.role, m.content) for m in flat] == [
        ("system", "answer in French"),
        ("user", "hi"),
    ]


def test_a_messages_text_parts_reach_the_engine_one_a_line() -> None:
    """As vLLM joins them (and so the model sees the same prompt either way): joined with
    nothing, ``</task>`` and ``<environment_details>`` ran together, and so would the words
    either side of any boundary. A part's ``cache_control`` (a caching hint some clients send
    to every server) is inert."""
    parts = [
        {"type": "text", "text": "<task>fix it</task>"},
        {"type": "text", "text": "<environment_details>", "cache_control": {"type": "ephemeral"}},
    ]
    body = {**CHAT, "messages": [{"role": "user", "content": parts}]}
    [message] = validate_body(ChatRequest, body).flat_messages()
    assert message.content == "<task>fix it</task>\n<environment_details>"


def test_an_ide_plugins_whole_list_of_stop_strings_is_taken() -> None:
    """Continue sends a self-hosted server every stop string of its fill-in-the-middle
    template (9 for Qwen's, with its own on top), where OpenAI takes 4: refused, every
    completion of such a plugin failed. A bound all the same, named in the error."""
    qwen = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"]
    qwen += ["<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>", "\n\n"]
    body = {**COMPLETION, "suffix": "\n    return x", "stop": qwen}
    assert validate_body(CompletionRequest, body).stop == qwen
    with pytest.raises(BadRequest) as refused:
        validate_body(CompletionRequest, {**COMPLETION, "stop": [f"s{i}" for i in range(33)]})
    assert refused.value.param == "stop"
    assert "32" in refused.value.message


def test_what_clients_put_on_every_message_that_changes_no_prompt_is_inert() -> None:
    """Caching hints (Copilot BYOK's ``copilot_cache_control``, ``cache_control``), a
    reasoning model's thinking sent back as history (Continue and Zed send
    ``reasoning_content``, even empty), a client's own message id (Twinny): each was a 400
    naming the field, for every chat of those clients."""
    sent = [
        {"role": "system", "content": "be brief", "id": "conv-1"},
        {"role": "user", "content": "hi", "copilot_cache_control": {"type": "ephemeral"}},
        {"role": "assistant", "content": "hello", "reasoning_content": "", "reasoning": "x"},
        {"role": "user", "content": "and?", "cache_control": {"type": "ephemeral"}},
    ]
    flat = validate_body(ChatRequest, {**CHAT, "messages": sent}).flat_messages()
    assert [(m.role, m.content) for m in flat] == [(m["role"], m["content"]) for m in sent]
