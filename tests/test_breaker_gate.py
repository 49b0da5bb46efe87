"""``ingress.breaker.BreakerGate`` on the real Redis: routes per level, 503 for an isolated
team or route, and levels cached for at most one second."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from ingress.breaker import BreakerGate
from laneway.constants import RedisKeys
from laneway.errors import ServiceUnavailable
from tests.stack import LiveStack

ROUTES = {"laneway-code": {"quantized": "laneway-code-fp8", "fallback": "laneway-code-small"}}


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _set(stack: LiveStack, level: int, team: str | None = None) -> None:
    payload = {"level": level, "rate": 0.3, "since": 0.0, "cooldown_s": 12.0}
    await stack.redis.set(
        RedisKeys(stack.prefix).breaker("laneway-code", team), orjson.dumps(payload)
    )


@pytest.mark.parametrize(
    ("level", "route"),
    [(0, "laneway-code"), (1, "laneway-code-fp8"), (2, "laneway-code-small")],
)
async def test_route_per_level(stack: LiveStack, level: int, route: str) -> None:
    await _set(stack, level)
    gate = BreakerGate(stack.redis, RedisKeys(stack.prefix), SimpleNamespace(breaker_routes=ROUTES))
    decision = await gate.route_for("team-a", "laneway-code")
    assert (decision.route, decision.level, decision.wait_in_queue) == (route, level, level > 0)
    unconfigured = await gate.route_for("team-a", "laneway-chat")
    assert unconfigured.route == "laneway-chat"


async def test_level_3_isolates_the_team_or_the_whole_route(stack: LiveStack) -> None:
    clock = _Clock()
    gate = BreakerGate(
        stack.redis, RedisKeys(stack.prefix), SimpleNamespace(breaker_routes=ROUTES), clock=clock
    )
    await _set(stack, 3, team="team-a")
    with pytest.raises(ServiceUnavailable) as refused:
        await gate.route_for("team-a", "laneway-code")
    assert refused.value.retry_after == 12.0
    assert "team 'team-a'" in str(refused.value)
    assert (await gate.route_for("team-b", "laneway-code")).route == "laneway-code"

    await _set(stack, 3)
    clock.now += 0.5  # still cached: team-b keeps being served for up to a second
    assert (await gate.route_for("team-b", "laneway-code")).level == 0
    clock.now += 0.6
    with pytest.raises(ServiceUnavailable, match="model 'laneway-code'"):
        await gate.route_for("team-b", "laneway-code")


async def test_unreadable_state_fails_open(stack: LiveStack) -> None:
    await stack.redis.set(RedisKeys(stack.prefix).breaker("laneway-code"), b"{not json")
    gate = BreakerGate(stack.redis, RedisKeys(stack.prefix), SimpleNamespace(breaker_routes=ROUTES))
    assert (await gate.route_for("team-a", "laneway-code")).level == 0


async def test_an_isolated_team_stays_isolated_while_redis_does_not_answer(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last levels read stay in force while Redis fails: an isolated team must not
    flood its failing model again because Redis stalled."""
    now = [100.0]
    keys = RedisKeys(stack.prefix)
    await stack.redis.set(
        keys.breaker("laneway-code", "team-a"), orjson.dumps({"level": 3, "cooldown_s": 12.0})
    )
    gate = BreakerGate(stack.redis, keys, SimpleNamespace(breaker_routes={}), clock=lambda: now[0])
    with pytest.raises(ServiceUnavailable):
        await gate.route_for("team-a", "laneway-code")

    async def hung(*_args: object, **_kw: object) -> object:
        raise RedisConnectionError("Redis does not answer")

    monkeypatch.setattr(stack.redis, "mget", hung)
    now[0] += 5  # past the one-second cache: the read fails, the last level stays
    with pytest.raises(ServiceUnavailable):
        await gate.route_for("team-a", "laneway-code")
