"""Function tools: a chat's tools reach an upstream server that calls them, and its calls come
back whole to the client, as OpenAI answers them; the engines that call none say so.

Judged by a separate upstream process's own log of what it was sent (``bench.upstream_server``
calls tools as a server with a tool parser does) and by the official SDK as the client.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from unittest.mock import ANY

import openai
import orjson
import pytest

from ingress.replies import ReplyChannel
from laneway.errors import BadRequest, EngineError, EngineRejected, EngineUnsupported
from laneway.openai_api import ChatRequest, validate_body
from laneway.openai_format import final_body
from laneway.requests import RequestShape, shape_request
from laneway.schema import Reply, RequestEnvelope
from laneway.settings import CommonSettings
from laneway.tokens import estimate_tokens
from laneway.tool_frames import CallFrames, CallReader, calls_of
from tests.stack import Ingress, LiveStack
from tests.test_batch_api import _lines, _until_done
from tests.test_wire_conformance import problems, sse_events
from workers.types import EngineDelta
from workers.upstream_refusals import refusal
from workers.upstream_stream import StreamReading, TokensPerChunk

CHAT = {"model": "laneway-chat", "messages": [{"role": "user", "content": "fix the bug"}]}
READ = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
EDIT = {"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "x", "weight": 1}}]},
            "tools.0.function.weight",
        ),
        ({"tools": [READ], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [READ], "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
        ({"tools": [READ] * 129}, "tools"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
            "messages.0.tool_calls.0.function",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages.0",
        ),
    ],
)
def test_tools_and_calls_the_engine_could_not_take_are_refused_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        validate_body(ChatRequest, {**CHAT, **fields})
    assert refused.value.param == param


def test_a_chats_tools_and_history_of_calls_travel_in_its_envelope_and_estimate() -> None:
    settings = CommonSettings()
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "read_file", "arguments": "{}"},
    }
    history = [
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "def f(): ..."},
    ]
    body = {
        **CHAT,
        "messages": history,
        "tools": [READ, {**EDIT, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
    }
    shaped = shape_request(settings, validate_body(ChatRequest, body), "chat")
    env = envelope(shaped)
    assert env.tools == [READ, EDIT]  # the inert caching hint is not passed on
    assert (env.tool_choice, env.parallel_tool_calls) == ("auto", False)
    assert env.messages is not None
    assert [m.wire() for m in env.messages] == history  # content null where it was
    plain = shape_request(settings, validate_body(ChatRequest, CHAT), "chat")
    # An agent's tools are much of its prompt: the estimate (quota, size limit) counts them.
    assert shaped.prompt_tokens > plain.prompt_tokens + len(json.dumps(READ)) // 4
    # `tool_choice: "none"` with no tools asks for nothing: no tool fields at all.
    none = shape_request(
        settings, validate_body(ChatRequest, {**CHAT, "tool_choice": "none"}), "chat"
    )
    assert envelope(none).tools is None
    assert envelope(none).tool_choice is None


async def _through(
    stack: LiveStack, upstream: Any, pool: str = "chat", team: str = "team-a", **fields: Any
) -> tuple[Ingress, str]:
    """laneway in front of ``upstream`` (a pool's worker on the openai engine): its ingress
    and a key of ``team``."""
    ingress = await stack.start_ingress()
    await stack.start_worker(pool, engine="openai", upstream_url=upstream.url, upstream_model="up")
    return ingress, await stack.api_key(team, **fields)


def envelope(shaped: RequestShape) -> RequestEnvelope:
    return shaped.envelope(
        id="chatcmpl-1", team="team-a", cls="chat", affinity="a", accepted_ts=1e9
    )


def _stream(chunks: list[dict[str, Any]]) -> tuple[StreamReading, list[EngineDelta]]:
    reading = StreamReading(prompt_tokens=5, max_tokens=100)
    deltas = [reading.line(b"data: " + orjson.dumps(chunk)) for chunk in chunks]
    reading.line(b"data: [DONE]")
    return reading, [d for d in deltas if d is not None]


def _calls(*parts: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    delta = {"tool_calls": list(parts)}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _framed(deltas: list[EngineDelta], request_id: str = "chatcmpl-1") -> tuple[str, CallFrames]:
    frames = CallFrames(request_id)
    return "".join(frames.text(d.text, d.tool_parts) for d in deltas) + frames.end(), frames


# Text, then two calls whose parts interleave: a name in two pieces, no id for the second.
SERVER_STREAM = [
    {"choices": [{"index": 0, "delta": {"content": "Reading \ue000 it"}}]},
    _calls(
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "read_"}},
    ),
    _calls({"index": 0, "function": {"name": "file", "arguments": '{"path": '}}),
    _calls({"index": 1, "type": "function", "function": {"name": "edit_file", "arguments": "{"}}),
    _calls(
        {"index": 0, "function": {"arguments": '"a.py"}'}},
        {"index": 1, "function": {"arguments": "}"}},
    ),
    _calls({"index": 2, "id": "call_c", "function": {"name": "list_dir"}}),  # no argument
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]
WHOLE_CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
    },
    # No id from the server: given one, which the client's answer will name.
    {
        "id": "call_chatcmpl-1_1",
        "type": "function",
        "function": {"name": "edit_file", "arguments": "{}"},
    },
    {"id": "call_c", "type": "function", "function": {"name": "list_dir", "arguments": ""}},
]


def test_a_streams_tool_call_parts_come_back_whole_however_its_text_is_cut() -> None:
    reading, deltas = _stream(SERVER_STREAM)
    # A server that reports no usage is billed a token a chunk of the calls, as of text.
    assert reading.final("tool_calls").completion_tokens == 6
    framed, frames = _framed(deltas)
    assert calls_of(framed, frames.ids, "chatcmpl-1") == ("Reading \ue000 it", WHOLE_CALLS)
    # Streamed, the ingress reads the text as its messages bring it, cut anywhere (inside a
    # frame too): the same text and calls, each call's head (id, name) once and first.
    for cut in range(len(framed) + 1):
        reader = CallReader("chatcmpl-1")
        pieces = [reader.read(framed[:cut], frames.ids), reader.read(framed[cut:])]
        text = "".join(piece[0] for piece in pieces)
        parts = [part for piece in pieces for part in piece[1]]
        assert text == "Reading \ue000 it", cut
        assert _whole(parts) == WHOLE_CALLS, cut
        heads = [p["index"] for p in parts if "id" in p]
        assert heads == [0, 1, 2], cut
    with pytest.raises(EngineError, match="not an OpenAI chunk"):
        _stream([_calls({"index": "0", "function": {"arguments": "{}"}})])


def _whole(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stream deltas accumulated as OpenAI's SDKs do."""
    calls: dict[int, dict[str, Any]] = {}
    for part in parts:
        call = calls.setdefault(
            part["index"],
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        call["id"] = call["id"] or part.get("id", "")
        call["function"]["name"] += part["function"].get("name", "")
        call["function"]["arguments"] += part["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_a_rerun_after_a_worker_crash_passes_each_call_once_with_its_first_id() -> None:
    """A worker that restarted runs the request again: the server makes the same calls
    (the same seed) under new ids (vLLM's are random), cut into other messages. The client
    gets the rest of the arguments once, and keeps the ids it already has."""
    _, deltas = _stream(SERVER_STREAM)
    first, first_frames = _framed(deltas)
    rerun_deltas = [
        EngineDelta(
            **{
                **_fields(d),
                "tool_parts": tuple(replace(p, id=p.id and p.id + "-2") for p in d.tool_parts),
            }
        )
        for d in deltas
    ]
    rerun, rerun_frames = _framed(rerun_deltas)
    assert rerun == first  # ids travel beside the text: its offsets hold across runs
    channel = ReplyChannel("chatcmpl-1", "team-a")
    cut = first.index("a.py")  # the first run got into call 0's arguments
    channel.feed(Reply(id="chatcmpl-1", n=0, at=0, text=first[:cut], call_ids=first_frames.ids))
    channel.feed(Reply(id="chatcmpl-1", n=0, at=0, text=rerun[:5], call_ids=rerun_frames.ids))
    done = Reply(
        id="chatcmpl-1",
        n=1,
        at=5,
        text=rerun[5:],
        done=True,
        status="ok",
        call_ids=rerun_frames.ids,
    )
    channel.feed(done)
    reader = CallReader("chatcmpl-1")
    parts: list[dict[str, Any]] = []
    while (reply := channel.take()) is not None:
        parts += reader.read(reply.text, reply.call_ids)[1]
    assert _whole(parts) == WHOLE_CALLS


def _fields(delta: EngineDelta) -> dict[str, Any]:
    return {name: getattr(delta, name) for name in EngineDelta.__slots__}


@pytest.mark.parametrize(
    "said",
    [
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
        'tool_choice="required" requires --tool-call-parser to be set',
        'tool_choice=function "read_file" requires --tool-call-parser to be set',
    ],
)
def test_a_server_with_no_tool_parser_is_unsupported_not_the_teams_fault(said: str) -> None:
    """vLLM serve (0.32) started without a tool parser refuses an agent's every chat, in
    its words for each tool_choice: a 400 naming ``tool_choice``, neither charged nor
    counted by the team's breaker."""
    refused = refusal(said)
    assert isinstance(refused, EngineUnsupported)
    assert refused.param == "tool_choice"


def test_an_answer_with_tool_calls_conforms_to_openais_schemas() -> None:
    body = {**CHAT, "tools": [READ]}
    env = envelope(shape_request(CommonSettings(), validate_body(ChatRequest, body), "chat"))
    _, deltas = _stream(SERVER_STREAM)
    framed, frames = _framed(deltas)
    reply = Reply(
        id=env.id, n=0, done=True, status="ok", finish_reason="tool_calls", call_ids=frames.ids
    )
    answer = final_body(env, framed, reply)
    assert answer["choices"][0]["message"]["content"] == "Reading \ue000 it"
    assert answer["choices"][0]["message"]["tool_calls"] == WHOLE_CALLS
    assert problems(answer, "CreateChatCompletionResponse") == []
    # Calls and no text: the content is null, as OpenAI sends it.
    calls_only, frames = _framed(deltas[1:])
    answer = final_body(env, calls_only, reply.model_copy(update={"call_ids": frames.ids}))
    assert answer["choices"][0]["message"]["content"] is None
    assert problems(answer, "CreateChatCompletionResponse") == []


async def test_an_agents_chat_calls_the_upstreams_tools_and_sends_their_answers_back(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=100)
    ingress, key = await _through(stack, upstream)
    client = stack.sdk(ingress, key)
    asked = [{"role": "user", "content": "agent-json: fix the bug"}]

    answer = await client.chat.completions.create(
        model="laneway-chat",
        messages=asked,
        tools=[READ, EDIT],
        max_tokens=6,  # type: ignore[list-item]
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["read_file", "edit_file"]  # type: ignore[union-attr]
    entry = upstream.entry("agent-json")
    assert entry is not None
    assert (entry["tools"], entry["called"]) == (
        ["read_file", "edit_file"],
        ["read_file", "edit_file"],
    )
    # The calls as the upstream made them: ids, names, arguments to the byte.
    assert [c.id for c in calls] == [f"call_{entry['id']}_0", f"call_{entry['id']}_1"]
    words = "".join(json.loads(c.function.arguments)["text"] for c in calls)  # type: ignore[union-attr]
    assert words == "alpha beta gamma delta omega sigma "
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 6

    # Streamed: each call's arguments as the server makes them, its head (index, id, name)
    # first; the client has a part of the call while the server still makes the rest.
    stream = await client.chat.completions.create(
        model="laneway-chat",
        messages=[{"role": "user", "content": "agent-stream: read it"}],
        tools=[READ, EDIT],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "edit_file"}},
        max_tokens=4,
        stream=True,
    )
    parts: list[Any] = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            if not parts:
                assert upstream.entry("agent-stream") is None  # not ended upstream
            parts += chunk.choices[0].delta.tool_calls
        last = chunk
    assert len(parts) > 1
    assert (parts[0].index, parts[0].id, parts[0].function.name) == (0, ANY, "edit_file")
    assert all(p.index == 0 and p.id is None for p in parts[1:])
    arguments = "".join(p.function.arguments for p in parts)
    assert json.loads(arguments)["text"] == "alpha beta gamma delta "
    assert last.choices[0].finish_reason == "stop"  # a named call: as vLLM and OpenAI say
    streamed = upstream.entry("agent-stream")
    assert streamed is not None
    assert streamed["tool_choice"] == {
        "type": "function",
        "function": {"name": "edit_file"},
    }

    # The history an agent sends next: its calls, and each tool's answer by the call's id.
    history: list[Any] = [
        *asked,
        choice.message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": f"ran {c.id}"} for c in calls),
    ]
    text = await client.chat.completions.create(
        model="laneway-chat",
        messages=history,
        tools=[READ],
        tool_choice="none",
        max_tokens=3,
        parallel_tool_calls=False,
    )
    assert text.choices[0].message.content == "alpha beta gamma "
    assert text.choices[0].message.tool_calls is None
    assert text.choices[0].finish_reason == "length"
    sent = upstream.entries()[-1]
    assert (sent["tool_choice"], sent["called"]) == ("none", [])
    assert sent["history"] == [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "content": f"ran {c.id}", "tool_call_id": c.id} for c in calls),
    ]
    usage = await stack.usage_of(answer.id, text.id)
    assert [usage[i]["status"] for i in (answer.id, text.id)] == ["ok", "ok"]


async def test_the_simulation_refuses_tools_it_cannot_call_and_is_not_charged(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("chat")
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="laneway-chat",
            messages=[{"role": "user", "content": "x"}],
            tools=[READ],  # type: ignore[list-item]
        )
    assert refused.value.body["param"] == "tools"  # type: ignore[index]
    assert "LANEWAY_UPSTREAM_URL" in refused.value.message
    # Nor does it write JSON.
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="laneway-chat",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
        )
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]
    # Told not to call them, it answers text.
    answer = await client.chat.completions.create(
        model="laneway-chat",
        messages=[{"role": "user", "content": "x"}],
        tools=[READ],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=4,
    )
    assert answer.choices[0].message.content
    events = await stack.read_topic(stack.topics.usage, count=3, within_s=20)
    assert sorted(e["status"] for e in events) == ["ok", "unsupported", "unsupported"]


async def test_a_streamed_answer_with_calls_conforms_on_the_wire(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=1)
    ingress, key = await _through(stack, upstream)
    body = {**CHAT, "tools": [READ], "max_tokens": 3, "stream": True}
    response = await stack.http(ingress, key).post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    chunks = sse_events(response.text)
    for chunk in chunks:
        assert problems(chunk, "CreateChatCompletionStreamResponse") == [], chunk
    parts = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert _whole(parts)[0]["function"]["name"] == "read_file"
    assert [p["index"] for p in parts if "id" in p] == [0]  # a call's head once


async def test_a_batch_lines_calls_come_back_in_its_result(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=1)
    ingress, key = await _through(stack, upstream, pool="batch", team="docs", size=100)
    client = stack.sdk(ingress, key)
    lines = [
        {
            "custom_id": f"doc-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**CHAT, "tools": [READ], "max_tokens": 3, "tool_choice": choice},
        }
        for i, choice in enumerate(["required", "none"])
    ]
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    uploaded = await client.files.create(file=("agent.jsonl", data), purpose="batch")
    created = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = await _until_done(client, created.id)
    assert batch.status == "completed", batch
    output = await _lines(client, batch.output_file_id)
    bodies = {row["custom_id"]: row["response"]["body"] for row in output}
    called = bodies["doc-0"]["choices"][0]
    assert called["finish_reason"] == "tool_calls"
    assert called["message"]["content"] is None
    (call,) = called["message"]["tool_calls"]
    assert call["function"]["name"] == "read_file"
    assert json.loads(call["function"]["arguments"]) == {"text": "alpha beta gamma "}
    text = bodies["doc-1"]["choices"][0]
    assert (text["message"]["content"], text["finish_reason"]) == ("alpha beta gamma ", "length")
    assert "tool_calls" not in text["message"]


def test_calls_as_other_servers_stream_them_come_back_whole() -> None:
    """TGI before 3.1 sends a call as an object; older Ollama sends each call whole in a
    chunk of its own, with no index; some servers repeat the name in every part."""
    tgi = {"id": "t", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
    ollama = [
        _calls({"id": "o1", "function": {"name": "read_file", "arguments": '{"a": 1}'}}),
        _calls({"id": "o2", "function": {"name": "edit_file", "arguments": "{}"}}),
    ]
    repeated = [
        _calls({"index": 0, "id": "r", "function": {"name": "read_file"}}),
        _calls({"index": 0, "function": {"name": "read_file", "arguments": "{"}}),
        _calls({"index": 0, "function": {"name": "read_file", "arguments": "}"}}),
    ]
    for chunks, names in [
        ([{"choices": [{"index": 0, "delta": {"tool_calls": tgi}}]}], ["read_file"]),
        (ollama, ["read_file", "edit_file"]),
        (repeated, ["read_file"]),
    ]:
        _, deltas = _stream(chunks)
        framed, frames = _framed(deltas)
        _, calls = calls_of(framed, frames.ids, "chatcmpl-1")
        assert [c["function"]["name"] for c in calls or ()] == names, chunks
    # Ollama's two calls keep their own arguments and ids.
    _, deltas = _stream(ollama)
    framed, frames = _framed(deltas)
    _, calls = calls_of(framed, frames.ids, "chatcmpl-1")
    assert [(c["id"], c["function"]["arguments"]) for c in calls or ()] == [
        ("o1", '{"a": 1}'),
        ("o2", "{}"),
    ]
    # A call with no name is one no client could run, nor send back as history.
    _, deltas = _stream([_calls({"index": 0, "id": "n", "function": {"arguments": "{}"}})])
    with pytest.raises(EngineError, match="no function name"):
        _framed(deltas)


def test_a_streams_calls_teach_no_count_a_chunk_and_an_error_after_them_is_the_engines() -> None:
    """A tool parser sends no chunk for the tokens that frame a call (vLLM's hermes:
    ``<tool_call>``): 25 tokens over 5 chunks taught 4.8 tokens a chunk, and a text stream
    its client left after 100 chunks was billed 480. And an error after a call's parts is a
    failure midway, not a refusal of the team's request."""
    learned = TokensPerChunk()
    for _ in range(5):
        reading, _ = _stream(
            [_calls({"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}})] * 5
            + [{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 25}}]
        )
        learned.learn(reading)
    assert learned.value == 1.0
    reading = StreamReading(prompt_tokens=5)
    reading.line(b"data: " + orjson.dumps(_calls({"index": 0, "function": {"name": "f"}})))
    error = {"error": {"message": "bad request", "code": 400, "type": "BadRequestError"}}
    with pytest.raises(EngineError) as failed:
        reading.line(b"data: " + orjson.dumps(error))
    assert not isinstance(failed.value, EngineRejected)


def test_an_arguments_json_is_estimated_as_it_is_not_escaped_again() -> None:
    settings = CommonSettings()
    code = 'def f():\n    return "x"\n' * 200
    arguments = json.dumps({"path": "a.py", "content": code})
    call = {"id": "c", "type": "function", "function": {"name": "write", "arguments": arguments}}
    history = [
        {"role": "user", "content": "write it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    shaped = shape_request(
        settings, validate_body(ChatRequest, {**CHAT, "messages": history}), "chat"
    )
    plain = shape_request(
        settings, validate_body(ChatRequest, {**CHAT, "messages": history[:1]}), "chat"
    )
    assert shaped.prompt_tokens - plain.prompt_tokens <= estimate_tokens("write" + arguments) + 3


def test_llama_cpp_without_jinja_is_unsupported_not_a_fault_of_the_route() -> None:
    unsupported = EngineUnsupported.from_engine("tools param requires --jinja flag")
    assert unsupported is not None
    assert unsupported.param == "tools"


SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "Answer",
        "schema": {"type": "object", "properties": {"text": {"type": "string"}}},
        "strict": True,
    },
}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_object", "json_schema": SCHEMA["json_schema"]}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"messages": [{"role": "user", "content": "x", "name": ["bob"]}]}, "messages.0.name"),
    ],
)
def test_a_response_format_or_name_the_engine_could_not_take_is_refused(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        validate_body(ChatRequest, {**CHAT, **fields})
    assert refused.value.param == param


def test_what_agent_frameworks_send_travels_as_they_sent_it() -> None:
    """AutoGen names every message and LangGraph its agents; openai-python's stream helper
    keeps each call's ``index`` in the message it gives back; structured output asks for a
    JSON schema. Each was a 400. And sampling fields the client did not set are marked, so
    an upstream server uses its own defaults (vLLM: its model's), not laneway's 1.0."""
    settings = CommonSettings()
    call = {
        "id": "call_7",
        "index": 0,
        "type": "function",
        "function": {"name": "read_file", "arguments": "{}", "parsed_arguments": {}},
    }
    body = {
        **CHAT,
        "messages": [
            {"role": "user", "name": "user", "content": "fix it"},
            {
                "role": "assistant",
                "name": "researcher",
                "content": None,
                "tool_calls": [call],
                "parsed": {"text": "x"},  # openai-python's parse(), sent back
            },
            {"role": "tool", "tool_call_id": "call_7", "content": "ok"},
        ],
        "response_format": SCHEMA,
        "temperature": 0.2,
    }
    env = envelope(shape_request(settings, validate_body(ChatRequest, body), "chat"))
    assert env.messages is not None
    wired = [m.wire() for m in env.messages]
    assert [m.get("name") for m in wired] == ["user", "researcher", None]
    assert wired[1]["tool_calls"] == [
        {"id": "call_7", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
    ]
    assert "parsed" not in wired[1]
    assert env.response_format == SCHEMA  # `schema` by its own name
    assert env.unset == ["top_p"]
    plain = envelope(shape_request(settings, validate_body(ChatRequest, CHAT), "chat"))
    assert plain.unset == ["temperature", "top_p"]
    assert plain.response_format is None
    # A response format constrains the decoding, not the prompt: not in the estimate.
    formatted = {**CHAT, "response_format": SCHEMA}
    shaped = shape_request(settings, validate_body(ChatRequest, formatted), "chat")
    assert (
        shaped.prompt_tokens
        == shape_request(settings, validate_body(ChatRequest, CHAT), "chat").prompt_tokens
    )
    text = {**CHAT, "response_format": {"type": "text"}}  # as if absent
    assert (
        envelope(shape_request(settings, validate_body(ChatRequest, text), "chat")).response_format
        is None
    )


async def test_an_autogen_style_chat_with_structured_output_reaches_the_upstream_as_sent(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=1)
    ingress, key = await _through(stack, upstream)
    client = stack.sdk(ingress, key)
    answer = await client.chat.completions.create(
        model="laneway-chat",
        messages=[
            {"role": "system", "content": "You are a helpful AI assistant."},
            {"role": "user", "name": "user", "content": "autogen: look it up"},
        ],
        response_format=SCHEMA,  # type: ignore[arg-type]
        max_tokens=3,
    )
    assert answer.choices[0].message.content == "alpha beta gamma "
    entry = upstream.entry("autogen")
    assert entry is not None
    assert entry["names"] == ["user"]
    assert entry["response_format"] == SCHEMA
    # Neither temperature nor top_p: the server's own defaults, as straight to it.
    assert "temperature" not in entry["sampling"]
    assert "top_p" not in entry["sampling"]
