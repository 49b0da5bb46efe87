"""Breaker levels as the ingress applies them, over HTTP, with the route in usage events.

The levels are written to Redis the way the streams app writes them; the streams tests cover
how error rates move them.
"""

from __future__ import annotations

import asyncio

import orjson

from ingress.breaker import BREAKER_CACHE_S
from laneway.constants import RedisKeys
from tests.stack import LiveStack


async def _set_level(stack: LiveStack, route: str, level: int, team: str | None = None) -> None:
    state = orjson.dumps({"level": level, "rate": 0.3, "since": 0, "cooldown_s": 42})
    await stack.redis.set(RedisKeys(stack.prefix).breaker(route, team), state)
    await asyncio.sleep(BREAKER_CACHE_S + 0.1)  # the ingress caches levels for a second


async def test_levels_route_and_isolate_over_http(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    hit = stack.http(ingress, await stack.api_key("hit"))
    bystander = stack.http(ingress, await stack.api_key("bystander"))
    body = {"model": "laneway-code", "prompt": "def f():", "max_tokens": 8}
    routes = ingress.settings.breaker_routes["laneway-code"]

    seen = []
    for level in (0, 1, 2):
        await _set_level(stack, "laneway-code", level)
        response = await hit.post("/v1/completions", json=body)
        assert response.status_code == 200
        seen.append((response.json()["id"], response.headers["x-laneway-route"]))
    assert [route for _, route in seen] == ["laneway-code", routes["quantized"], routes["fallback"]]

    await _set_level(stack, "laneway-code", 0)
    await _set_level(stack, "laneway-code", 3, team="hit")
    refused = await hit.post("/v1/completions", json=body)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "42"
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert (await bystander.post("/v1/completions", json=body)).status_code == 200

    ids = {rid for rid, _ in seen}
    events = await stack.read_topic(stack.topics.usage, count=3, where=lambda e: e["id"] in ids)
    assert {(e["model"], e["route"]) for e in events} == {
        ("laneway-code", "laneway-code"),
        ("laneway-code", routes["quantized"]),
        ("laneway-code", routes["fallback"]),
    }
