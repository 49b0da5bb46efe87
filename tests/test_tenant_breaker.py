"""One team's bad traffic raises only its own breaker level, on the real stack: a worker on
an OpenAI-compatible upstream (a separate process) that refuses prompts longer than its
context, the streams app as a process, and two teams on one route."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.stack import LiveStack, eventually
from tests.test_streams_process import StreamsProcess
from tests.upstream_process import UpstreamProcess

CONTEXT = 64  # the upstream's context, in tokens
SHORT = {"model": "laneway-code", "prompt": "def handler(request):", "max_tokens": 8}
TOO_LONG = {"model": "laneway-code", "prompt": "x = 1\n" * 80, "max_tokens": 8}  # ~120 tokens
BREAKER = {
    "breaker_window_s": 30.0,
    "breaker_bucket_s": 0.5,
    "breaker_min_requests": 20,
    "breaker_cooldown_s": 120.0,  # nothing steps down while the test looks
}


async def _level(stack: LiveStack, team: str | None = None) -> int | None:
    key = f"{stack.prefix}:breaker:route:laneway-code"
    if team is not None:
        key = f"{stack.prefix}:breaker:team:laneway-code:{team}"
    raw = await stack.redis.get(key)
    return None if raw is None else int(orjson.loads(raw)["level"])


async def test_one_teams_over_long_prompts_isolate_that_team_alone(
    stack: LiveStack, tmp_path: Path
) -> None:
    upstream = UpstreamProcess(tmp_path / "up.jsonl", slots=8, token_ms=0, max_model_len=CONTEXT)
    streams = StreamsProcess(stack, tmp_path / "streams", **BREAKER)
    await streams.start()
    try:
        await upstream.ready()
        ingress = await stack.start_ingress()
        await stack.start_worker(
            "completion",
            engine="openai",
            upstream_url=upstream.url,
            upstream_slots=8,
            upstream_metrics_url="",
        )
        a = stack.http(ingress, await stack.api_key("team-a"))
        b = stack.http(ingress, await stack.api_key("team-b"))

        async def both(i: int) -> tuple[httpx.Response, httpx.Response]:
            return await asyncio.gather(
                a.post(
                    "/v1/completions", json={**TOO_LONG, "prompt": f"# {i}\n" + TOO_LONG["prompt"]}
                ),
                b.post("/v1/completions", json={**SHORT, "prompt": f"def f{i}():"}),
            )

        answers = [await both(i) for i in range(40)]
        # The engine refused A's prompts: the client is told why, as a 400 (not a 5xx).
        refused = answers[0][0]
        assert refused.status_code == 400, refused.text
        assert f"maximum context length is {CONTEXT} tokens" in refused.json()["error"]["message"]
        assert {a_.status_code for a_, _ in answers} <= {400, 503}
        assert {b_.status_code for _, b_ in answers} == {200}

        async def a_isolated() -> bool:
            return await _level(stack, "team-a") == 3

        try:
            await eventually(a_isolated, 30, "team-a at level 3", every_s=0.1)
        except TimeoutError:
            raise AssertionError(streams.log()[-3000:]) from None

        # A is refused at the door; B, on the same route, is served as before.
        await eventually(lambda: _isolated(a), 10, "team-a refused with 503", every_s=0.1)
        later = [
            await b.post("/v1/completions", json={**SHORT, "prompt": f"g{i}"}) for i in range(10)
        ]
        assert [r.status_code for r in later] == [200] * 10
        assert await _level(stack) is None  # the route: never raised
        assert await _level(stack, "team-b") is None
        # Those of A's long prompts that ran (the breaker may have isolated A at the door
        # before the 40th: a 503, no run, no usage) were refused by the engine. One
        # partition (keyed by team), in the order produced: those come first.
        ran = sum(a_.status_code == 400 for a_, _ in answers)
        events = await stack.read_topic(
            stack.topics.usage, count=ran, where=lambda e: e["team"] == "team-a"
        )
        assert [e["status"] for e in events[:ran]] == ["rejected"] * ran
    finally:
        assert await streams.stop() == 0, streams.log()
        upstream.stop()


async def _isolated(client: httpx.AsyncClient) -> bool:
    response = await client.post("/v1/completions", json=SHORT)
    body: dict[str, Any] = response.json()
    return response.status_code == 503 and "isolated by the breaker" in body["error"]["message"]
