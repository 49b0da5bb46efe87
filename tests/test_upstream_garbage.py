"""An upstream that answers with something other than OpenAI's event stream: each request it
breaks still ends, at once, with an engine error its client sees, a usage event and a
settled reservation, and the worker goes on serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from laneway.constants import RedisKeys
from quota.enforcer import QuotaEnforcer
from quota.model import QuotaPolicy
from quota.teams import get_team
from tests.stack import LiveStack, clear_of_the_hour_turn, eventually

# What the server streams for a prompt: an event that is not JSON, JSON that is not an object,
# an object whose choices are not a list of objects, then a good one.
_BROKEN = {
    "not-json": b"data: {oops\n\n",
    "a-list": b"data: [1, 2]\n\n",
    "bad-choices": b'data: {"choices": ["text"]}\n\n',
}
_GOOD = b'data: {"choices": [{"text": "fine", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_BROKEN.get(body["prompt"], _GOOD))
    await response.write_eof()
    return response


@pytest.fixture
async def garbling() -> AsyncIterator[str]:
    """A real HTTP server on a free port that garbles the streams of ``_BROKEN``'s prompts."""
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
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
    for prompt in _BROKEN:
        body = {"model": "laneway-code", "prompt": prompt, "max_tokens": 8}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 502, (prompt, answer.status_code, answer.text)
        assert "engine failed" in answer.json()["error"]["message"]
    good = await http.post(
        "/v1/completions", json={"model": "laneway-code", "prompt": "ok", "max_tokens": 8}
    )
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] == "fine"
    events = await stack.read_topic(
        stack.topics.usage, count=4, where=lambda e: e["team"] == "team-g"
    )
    assert sorted(e["status"] for e in events) == ["error", "error", "error", "ok"]
    assert all("not an OpenAI chunk" in e["error"] for e in events if e["status"] == "error")
    # Every reservation settled: none is left holding the team's tokens.
    keys = RedisKeys(stack.prefix)
    enforcer = QuotaEnforcer(stack.redis, keys, QuotaPolicy())
    team = await get_team(stack.redis, keys, "team-g")

    async def settled() -> bool:
        pools: Any = (await enforcer.snapshot(team))["pools"]
        return bool(pools["interactive"]["reservations"] == 0)

    await eventually(settled, 10, "every reservation settled")
