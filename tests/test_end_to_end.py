"""The whole path on the real parts: HTTP → Kafka → worker → Redis reply stream → HTTP."""

from __future__ import annotations

import openai
import pytest

from tests.stack import Ingress, LiveStack

USAGE_FIELDS = {
    "id",
    "team",
    "class",
    "model",
    "route",
    "status",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "engine_ms",
    "queue_ms",
    "ttft_ms",
    "total_ms",
    "ts",
}


async def _openai_client(stack: LiveStack, ingress: Ingress) -> openai.AsyncOpenAI:
    """An unmodified OpenAI client on ``ingress`` with a key of team-a, closed with the stack."""
    return stack.sdk(ingress, await stack.api_key("team-a"))


@pytest.fixture
async def served(stack: LiveStack) -> tuple[LiveStack, openai.AsyncOpenAI]:
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    await stack.start_worker("chat")
    return stack, await _openai_client(stack, ingress)


async def test_completion_not_streamed(served: tuple[LiveStack, openai.AsyncOpenAI]) -> None:
    stack, client = served
    result = await client.completions.create(
        model="laneway-code", prompt="def add(a, b):", suffix="\n", max_tokens=16
    )
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert result.choices[0].text.strip()
    assert result.choices[0].finish_reason in ("stop", "length")
    assert result.usage is not None
    assert result.usage.completion_tokens == len(result.choices[0].text.split())
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens

    events = await stack.read_topic(
        stack.topics.usage, count=1, where=lambda e: e["id"] == result.id
    )
    assert len(events) == 1
    event = events[0]
    assert set(event) >= USAGE_FIELDS
    assert event["team"] == "team-a"
    assert event["class"] == "completion"
    assert event["status"] == "ok"
    assert event["model"] == event["route"] == "laneway-code"
    assert event["completion_tokens"] == result.usage.completion_tokens
    assert event["total_ms"] >= event["queue_ms"] >= 0


async def test_completion_streamed_matches_unstreamed(
    served: tuple[LiveStack, openai.AsyncOpenAI],
) -> None:
    _, client = served
    whole = await client.completions.create(
        model="laneway-code", prompt="class Tree:", max_tokens=32
    )
    stream = await client.completions.create(
        model="laneway-code",
        prompt="class Tree:",
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    finish = None
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


async def test_chat_streamed_and_not(served: tuple[LiveStack, openai.AsyncOpenAI]) -> None:
    stack, client = served
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "explain this diff"},
    ]
    whole = await client.chat.completions.create(
        model="laneway-chat", messages=messages, max_tokens=24
    )  # type: ignore[arg-type]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content or ""
    assert text

    stream = await client.chat.completions.create(
        model="laneway-chat", messages=messages, max_tokens=24, stream=True
    )  # type: ignore[arg-type]
    roles, deltas = [], []
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                deltas.append(choice.delta.content)
    assert roles == ["assistant"]
    assert "".join(deltas) == text

    events = await stack.read_topic(
        stack.topics.usage, count=2, where=lambda e: e["class"] == "chat"
    )
    assert [e["status"] for e in events] == ["ok", "ok"]


async def test_a_stream_interval_sends_fewer_larger_chunks_and_the_same_text(
    stack: LiveStack,
) -> None:
    # Decode steps 5 ms apart: at interval 1 nearly every token would be a chunk of its own.
    ingress = await stack.start_ingress()
    await stack.start_worker("chat", stream_interval=8, sim_decode_ms_per_step=5.0)
    client = await _openai_client(stack, ingress)
    messages = [{"role": "user", "content": "summarise this module"}]
    whole = await client.chat.completions.create(
        model="laneway-chat", messages=messages, max_tokens=24
    )  # type: ignore[arg-type]
    assert whole.usage is not None
    tokens = whole.usage.completion_tokens
    assert tokens > 8  # enough for the interval to show
    stream = await client.chat.completions.create(
        model="laneway-chat", messages=messages, max_tokens=24, stream=True
    )  # type: ignore[arg-type]
    deltas = [
        choice.delta.content
        async for chunk in stream
        for choice in chunk.choices
        if choice.delta.content
    ]
    assert "".join(deltas) == whole.choices[0].message.content
    # The first token at once, then a chunk per 8 tokens, the rest with the end.
    assert len(deltas) <= 2 + (tokens - 1) // 8 < tokens, deltas


async def test_models_lists_served_models(served: tuple[LiveStack, openai.AsyncOpenAI]) -> None:
    _, client = served
    models = await client.models.list()
    assert {m.id for m in models.data} == {"laneway-code", "laneway-chat"}
    model = await client.models.retrieve("laneway-code")
    assert (model.id, model.object, model.owned_by) == ("laneway-code", "model", "laneway")
    with pytest.raises(openai.NotFoundError) as refused:
        await client.models.retrieve("gpt-nothing")
    assert "is not served here" in str(refused.value)


async def test_server_timing_splits_the_time_inside_laneway(
    served: tuple[LiveStack, openai.AsyncOpenAI],
) -> None:
    _, client = served
    raw = await client.completions.with_raw_response.create(
        model="laneway-code", prompt="def sub(a, b):", max_tokens=8
    )
    timing: dict[str, float] = {}
    for part in raw.headers["server-timing"].split(", "):
        name, _, duration = part.partition(";dur=")
        timing[name] = float(duration)
    assert set(timing) == {"laneway", "admit", "enqueue", "worker"}
    parts = timing["admit"] + timing["enqueue"] + timing["worker"]
    assert 0 < parts <= timing["laneway"] + 0.1  # the parts lie within the whole
