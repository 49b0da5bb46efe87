"""An upstream that answers with something other than OpenAI's event stream: each request it
breaks still ends, at once, with an engine error its client sees, a usage event and a
settled reservation, and the worker goes on serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from laneway.constants import RedisKeys
from quota.enforcer import QuotaEnforcer
from quota.model import QuotaPolicy
from quota.teams import get_team
from tests.stack import LiveStack, clear_of_the_hour_turn, eventually

_WORDS = b'data: {"choices": [{"text": "half an "}]}\n\n'
# What the server streams for a prompt, and the words the usage event's error must have: an
# event that is not JSON, JSON that is not an object, choices that are not objects, an error
# event midway (as vLLM ends a failed stream, [DONE] after it), a stream that stops with no
# finish_reason and no [DONE]; then a good one.
_BROKEN = {
    "not-json": (b"data: {oops\n\n", "not an OpenAI chunk"),
    "a-list": (b"data: [1, 2]\n\n", "not an OpenAI chunk"),
    "bad-choices": (b'data: {"choices": ["text"]}\n\n', "not an OpenAI chunk"),
    "error-midway": (
        _WORDS + b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n',
        "failed midway: engine died",
    ),
    "cut-short": (_WORDS, "ended before its end"),
}
_GOOD = b'data: {"choices": [{"text": "fine", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
_NOT_STREAMED = "json"  # answered with one JSON body, though a stream was asked for


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == _NOT_STREAMED:
        return web.json_response({"choices": [{"text": "whole", "finish_reason": "stop"}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    sent = _BROKEN.get(body["prompt"])
    await response.write(sent[0] if sent else _GOOD)
    await response.write_eof()
    return response


async def _chat(request: web.Request) -> web.StreamResponse:
    """A good chat stream that reports no usage (as some OpenAI-compatible servers do)."""
    await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"choices": [{"delta": {"content": "fine"}, "finish_reason": "stop"}]}
    await response.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


@pytest.fixture
async def garbling() -> AsyncIterator[str]:
    """A real HTTP server on a free port that garbles the streams of ``_BROKEN``'s prompts."""
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def test_a_garbled_upstream_stream_ends_its_request_with_an_error(
    stack: LiveStack, garbling: str
) -> None:
    await clear_of_the_hour_turn(60)
    ingress = await stack.start_ingress(quota_lease_share=0)
    await stack.start_worker(
        "completion", engine="openai", upstream_url=garbling, upstream_model="up", upstream_slots=4
    )
    http = stack.http(ingress, await stack.api_key("team-g", size=5))
    expected = {**{p: words for p, (_, words) in _BROKEN.items()}, _NOT_STREAMED: "not the event"}
    ids = {}
    for prompt, words in expected.items():
        body = {"model": "laneway-code", "prompt": prompt, "max_tokens": 8}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 502, (prompt, answer.status_code, answer.text)
        assert "engine failed" in answer.json()["error"]["message"]
        ids[answer.headers["x-laneway-request-id"]] = words
    good = await http.post(
        "/v1/completions", json={"model": "laneway-code", "prompt": "ok", "max_tokens": 8}
    )
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] == "fine"
    events = await stack.read_topic(
        stack.topics.usage, count=len(ids) + 1, where=lambda e: e["team"] == "team-g"
    )
    assert sorted(e["status"] for e in events) == ["error"] * len(ids) + ["ok"]
    for event in events:
        if event["id"] in ids:
            assert ids[event["id"]] in event["error"], event
    # Every reservation settled: none is left holding the team's tokens.
    keys = RedisKeys(stack.prefix)
    enforcer = QuotaEnforcer(stack.redis, keys, QuotaPolicy())
    team = await get_team(stack.redis, keys, "team-g")

    async def settled() -> bool:
        pools: Any = (await enforcer.snapshot(team))["pools"]
        return bool(pools["interactive"]["reservations"] == 0)

    await eventually(settled, 10, "every reservation settled")


async def test_an_upstream_that_reports_no_usage_is_billed_the_ingress_estimate(
    stack: LiveStack, garbling: str
) -> None:
    """A chat's prompt is billed with its message framing (3 tokens a message and 3 for the
    reply, as the ingress estimated and reserved it) when the upstream gives no count."""
    ingress = await stack.start_ingress(quota_lease_share=0)
    await stack.start_worker(
        "chat", engine="openai", upstream_url=garbling, upstream_model="up", upstream_slots=4
    )
    http = stack.http(ingress, await stack.api_key("team-u", size=5))
    messages = [{"role": "user", "content": "a"}] * 50
    answer = await http.post(
        "/v1/chat/completions",
        json={"model": "laneway-chat", "messages": messages, "max_tokens": 8},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "fine"
    billed = answer.json()["usage"]["prompt_tokens"]
    assert billed >= 50 * 3 + 3, billed  # the framing alone, whatever the text's estimate
    (event,) = await stack.read_topic(
        stack.topics.usage, count=1, where=lambda e: e["team"] == "team-u"
    )
    assert event["prompt_tokens"] == billed
