"""Function tools: a chat's tools reach an upstream server that calls them, and its calls come
back whole to the client, as OpenAI answers them; the engines that call none say so.

Judged by a separate upstream process's own log of what it was sent (``bench.upstream_server``
calls tools as a server with a tool parser does) and by the official SDK as the client.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from laneway.errors import BadRequest, EngineError, EngineUnsupported
from laneway.openai_api import ChatRequest, validate_body
from laneway.openai_format import final_body
from laneway.requests import RequestShape, shape_request
from laneway.schema import Reply, RequestEnvelope
from laneway.settings import CommonSettings
from tests.stack import LiveStack
from tests.test_wire_conformance import problems, sse_events
from workers.upstream_refusals import refusal
from workers.upstream_stream import StreamReading

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


def envelope(shaped: RequestShape) -> RequestEnvelope:
    return shaped.envelope(
        id="chatcmpl-1", team="team-a", cls="chat", affinity="a", accepted_ts=1e9
    )


def _stream(chunks: list[dict[str, Any]]) -> StreamReading:
    reading = StreamReading(prompt_tokens=5, max_tokens=100)
    for chunk in chunks:
        reading.line(b"data: " + orjson.dumps(chunk))
    reading.line(b"data: [DONE]")
    return reading


def _calls(*parts: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "delta": {"tool_calls": list(parts)}, "finish_reason": finish}]
    }


def test_a_streams_tool_call_parts_are_folded_into_whole_calls_and_billed() -> None:
    reading = _stream(
        [
            _calls(
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "read_", "arguments": ""},
                }
            ),
            _calls({"index": 0, "function": {"name": "file", "arguments": '{"path": '}}),
            _calls(
                {
                    "index": 1,
                    "type": "function",
                    "function": {"name": "edit_file", "arguments": "{"},
                }
            ),
            _calls(
                {"index": 0, "function": {"arguments": '"a.py"}'}},
                {"index": 1, "function": {"arguments": "}"}},
            ),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        ]
    )
    final = reading.final("tool_calls", "chatcmpl-1")
    assert final.tool_calls == [
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
    ]
    # A server that reports no usage is billed a token a chunk of the calls, as of text.
    assert final.completion_tokens == 4
    with pytest.raises(EngineError, match="not an OpenAI chunk"):
        _stream([_calls({"index": "0", "function": {"arguments": "{}"}})])


def test_a_server_with_no_tool_parser_is_unsupported_not_the_teams_fault() -> None:
    """vLLM serve started without --enable-auto-tool-choice refuses an agent's every chat:
    a 400 naming ``tool_choice``, neither charged nor counted by the team's breaker."""
    said = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    refused = refusal(said)
    assert isinstance(refused, EngineUnsupported)
    assert refused.param == "tool_choice"


def test_an_answer_with_tool_calls_conforms_to_openais_schemas() -> None:
    env = envelope(shape_request(CommonSettings(), validate_body(ChatRequest, CHAT), "chat"))
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": "{}"},
    }
    reply = Reply(
        id=env.id, n=0, done=True, status="ok", finish_reason="tool_calls", tool_calls=[call]
    )
    body = final_body(env, "", reply)
    assert body["choices"][0]["message"]["content"] is None
    assert problems(body, "CreateChatCompletionResponse") == []


async def test_an_agents_chat_calls_the_upstreams_tools_and_sends_their_answers_back(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=1)
    ingress = await stack.start_ingress()
    await stack.start_worker(
        "chat", engine="openai", upstream_url=upstream.url, upstream_model="up"
    )
    key = await stack.api_key("team-a")
    client = openai.AsyncOpenAI(base_url=ingress.base_url + "/v1", api_key=key, max_retries=0)
    stack._clients.append(client)
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

    # Streamed: the calls come whole, each with its index, before the finish.
    stream = await client.chat.completions.create(
        model="laneway-chat",
        messages=[{"role": "user", "content": "agent-stream: read it"}],
        tools=[READ, EDIT],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "edit_file"}},
        max_tokens=4,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    deltas = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(deltas) == 1
    assert [(d.index, d.function.name) for d in deltas[0]] == [(0, "edit_file")]
    assert json.loads(deltas[0][0].function.arguments)["text"] == "alpha beta gamma delta "  # type: ignore[union-attr,arg-type]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
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
    client = openai.AsyncOpenAI(base_url=ingress.base_url + "/v1", api_key=key, max_retries=0)
    stack._clients.append(client)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="laneway-chat",
            messages=[{"role": "user", "content": "x"}],
            tools=[READ],  # type: ignore[list-item]
        )
    assert refused.value.body["param"] == "tools"  # type: ignore[index]
    assert "LANEWAY_UPSTREAM_URL" in refused.value.message
    # Told not to call them, it answers text.
    answer = await client.chat.completions.create(
        model="laneway-chat",
        messages=[{"role": "user", "content": "x"}],
        tools=[READ],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=4,
    )
    assert answer.choices[0].message.content
    events = await stack.read_topic(stack.topics.usage, count=2, within_s=20)
    assert sorted(e["status"] for e in events) == ["ok", "unsupported"]


async def test_a_streamed_answer_with_calls_conforms_on_the_wire(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=1)
    ingress = await stack.start_ingress()
    await stack.start_worker(
        "chat", engine="openai", upstream_url=upstream.url, upstream_model="up"
    )
    key = await stack.api_key("team-a")
    body = {**CHAT, "tools": [READ], "max_tokens": 3, "stream": True}
    async with httpx.AsyncClient() as http:
        response = await http.post(
            ingress.base_url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        )
    assert response.status_code == 200, response.text
    chunks = sse_events(response.text)
    for chunk in chunks:
        assert problems(chunk, "CreateChatCompletionStreamResponse") == [], chunk
    calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "read_file")]
