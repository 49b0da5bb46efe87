"""The sim engine's injected failure rate drives the breaker on the real broker and Redis:
7.5 % → level 1, 12 % → level 2, 25 % → level 3, back down one level per cool-down once the
errors left the window; the ingress gate routes accordingly and on-call gets one webhook per
transition into level 2 or above. Two teams share the route: engine errors both see move the
route's level as well as each team's own."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from ingress.breaker import BreakerGate
from laneway.constants import RedisKeys
from laneway.errors import ServiceUnavailable
from laneway.schema import RequestEnvelope
from tests.stack import LiveStack, envelope, eventually
from tests.test_streams_process import StreamsProcess

ROUTES = {"laneway-code": {"quantized": "laneway-code-fp8", "fallback": "laneway-code-small"}}
REQUESTS = 400
COOLDOWN_S = 2.0
TEAMS = ("team-a", "team-b")  # request i is team i % 2's
# Seeds of the sim's failure draws for which, in each team's 200 of the 400 requests, every
# run of >= 100 consecutive ones has an error rate inside the level's band (so the level
# reached is exact, not luck; the route's rate is then one of the two teams').
CASES = [(0.075, 30, 1), (0.12, 6, 2), (0.25, 1, 3)]
BREAKER = {
    # Long enough to hold 100 requests of each team (200 in all) on a busy machine, where
    # one worker serving one at a time managed 17 a second.
    "breaker_window_s": 20.0,
    "breaker_bucket_s": 0.5,
    "breaker_min_requests": 100,
    "breaker_cooldown_s": COOLDOWN_S,
}


class Webhook:
    """A tiny HTTP server that records every POSTed JSON body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/oncall"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.decode().split("\r\n"):
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        self.bodies.append(orjson.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def _envelope(i: int) -> RequestEnvelope:
    # One partition, one worker: failures drawn in order.
    return envelope(
        team=TEAMS[i % 2],
        prompt=f"def f{i}():",
        max_tokens=2,
        affinity="p:one-partition",
        deadline_ts=time.time() + 120,
    )


async def _level(stack: LiveStack, team: str | None = None) -> int:
    key = f"{stack.prefix}:breaker:route:laneway-code"
    if team is not None:
        key = f"{stack.prefix}:breaker:team:laneway-code:{team}"
    raw = await stack.redis.get(key)
    return 0 if raw is None else int(orjson.loads(raw)["level"])


def _check_transitions(transitions: list[dict[str, Any]], expected: int) -> None:
    levels = [t["level"] for t in transitions]
    top = levels.index(max(levels))
    assert max(levels) == expected, levels
    assert levels[top:] == list(range(expected, -1, -1)), f"not one step per cool-down: {levels}"
    assert levels[:top] == sorted(levels[:top]), f"flapped on the way up: {levels}"
    downs = transitions[top:]
    for before, after in itertools.pairwise(downs):
        assert after["since"] - before["since"] >= COOLDOWN_S - 0.05, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize(("failure_rate", "seed", "expected"), CASES)
async def test_failure_rate_moves_the_breaker_and_back_after_cooldown(
    stack: LiveStack, tmp_path: Path, failure_rate: float, seed: int, expected: int
) -> None:
    webhook = Webhook()
    url = await webhook.start()
    streams = StreamsProcess(stack, tmp_path, breaker_webhook_url=url, **BREAKER)
    await streams.start()
    try:
        await stack.start_worker(
            "completion", sim_failure_rate=failure_rate, sim_seed=seed, max_inflight=1
        )
        producer = await stack.producer()
        topic = stack.topics.request("completion", "hi")
        sent = [
            await producer.send(topic, _envelope(i).to_json(), key=b"p:one-partition")
            for i in range(REQUESTS)
        ]
        await asyncio.gather(*sent)

        async def both_at_expected() -> bool:
            return (await _level(stack), await _level(stack, "team-a")) == (expected, expected)

        try:
            await eventually(both_at_expected, 40, f"level {expected}", every_s=0.05)
        except TimeoutError:
            control = await stack.read_all(stack.topics.control)
            raise AssertionError(f"control: {control}\n{streams.log()[-3000:]}") from None

        # The ingress acts on what the streams app decided.
        gate = BreakerGate(
            stack.redis, RedisKeys(stack.prefix), SimpleNamespace(breaker_routes=ROUTES)
        )
        if expected == 3:
            with pytest.raises(ServiceUnavailable) as refused:
                await gate.route_for("team-a", "laneway-code")
            assert refused.value.retry_after == COOLDOWN_S
        else:
            decision = await gate.route_for("team-a", "laneway-code")
            want = "laneway-code-fp8" if expected == 1 else "laneway-code-small"
            assert (decision.route, decision.level, decision.wait_in_queue) == (
                want,
                expected,
                True,
            )

        await eventually(
            lambda: _level_is_zero(stack), 40, "the breaker back at level 0", every_s=0.1
        )
    finally:
        assert await streams.stop() == 0, streams.log()
        await webhook.stop()

    # The app has stopped cleanly (its producer flushed): the topic holds all it announced.
    control = await stack.read_all(stack.topics.control, where=lambda r: r["kind"] == "breaker")
    route = [t for t in control if t["subject"] == "breaker:laneway-code"]
    team = [t for t in control if t["subject"] == "breaker:laneway-code:team-a"]
    _check_transitions(route, expected)
    _check_transitions(team, expected)
    paging = [t for t in control if t["level"] >= 2 and t["level"] > t["previous"]]
    assert sorted((b["subject"], b["level"]) for b in webhook.bodies) == sorted(
        (t["subject"], t["level"]) for t in paging
    )
    if expected < 2:
        assert webhook.bodies == []


async def _level_is_zero(stack: LiveStack) -> bool:
    return await _level(stack) == 0 and await _level(stack, "team-a") == 0
