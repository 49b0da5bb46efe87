"""An engine's prefix cache is one team's, not every team's (``workers.cache_salt``).

Shared, it answers one team's question "did anyone send this text lately?" about another
team: the usage field ``prompt_tokens_details.cached_tokens`` (and the time to first token)
says how much of a prompt was found cached. Each request carries its team's salt (vLLM's
``cache_salt``), so a team reuses its own prefixes and finds nobody else's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from laneway.constants import RedisKeys
from tests.stack import LiveStack
from tests.upstream_process import UpstreamProcess
from workers.cache_salt import CacheSalts

# A prompt of many whole cache blocks: a team's repository context, say.
PROMPT = "".join(f"def helper_{i}(value):\n    return value * {i}\n\n" for i in range(40))


async def _cached(client: httpx.AsyncClient, prompt: str = PROMPT) -> int:
    response = await client.post(
        "/v1/completions", json={"model": "laneway-code", "prompt": prompt, "max_tokens": 4}
    )
    assert response.status_code == 200, response.text
    cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


@pytest.mark.parametrize("isolation", [True, False], ids=["isolated", "shared"])
async def test_a_team_finds_its_own_cached_prefix_and_never_another_teams(
    stack: LiveStack, isolation: bool
) -> None:
    """Through the ingress, on the sim engine (a simulated GPU with vLLM's block-hash prefix
    cache): team B sends the very prompt team A just sent. Isolated (the default), B finds
    none of it cached and A finds all of it; shared (``LANEWAY_CACHE_ISOLATION=false``), B
    learns A sent it."""
    ingress = await stack.start_ingress()
    await stack.start_worker("completion", cache_isolation=isolation)
    a = stack.http(ingress, await stack.api_key("team-a"))
    b = stack.http(ingress, await stack.api_key("team-b"))

    assert await _cached(a) == 0  # nobody sent it before
    again = await _cached(a)
    assert again > len(PROMPT) // 8  # A's own prefix, reused
    if isolation:
        assert await _cached(b) == 0  # B cannot tell A sent it
        assert await _cached(b) == again  # and B reuses its own, as A does
    else:
        assert await _cached(b) == again  # the leak the salt closes


async def test_each_request_reaches_a_separate_server_with_its_teams_salt(
    stack: LiveStack, tmp_path: Path
) -> None:
    """Judged by the server's own log (``bench.upstream_server``): two workers in front of
    one server (the completion and the chat pool) salt a team alike, since they share the
    deployment's secret in Redis; two teams differ; and a salt is vLLM's 256 bits that do
    not name the team, so no client can make another team's."""
    upstream = UpstreamProcess(tmp_path / "up.jsonl", slots=4, token_ms=0)
    await upstream.ready()
    try:
        ingress = await stack.start_ingress()
        engine = {"engine": "openai", "upstream_url": upstream.url, "upstream_metrics_url": ""}
        await stack.start_worker("completion", **engine)
        await stack.start_worker("chat", **engine)
        clients = {
            team: stack.http(ingress, await stack.api_key(team)) for team in ("team-a", "team-b")
        }
        for team, client in clients.items():
            await _cached(client, f"# {team} completion")
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "laneway-chat",
                    "messages": [{"role": "user", "content": f"# {team} chat"}],
                    "max_tokens": 4,
                },
            )
            assert chat.status_code == 200, chat.text
        salts = {e["prompt"]: e["cache_salt"] for e in upstream.entries()}
        a = {salts["# team-a completion"], salts["# team-a chat"]}
        b = {salts["# team-b completion"], salts["# team-b chat"]}
        assert len(a) == len(b) == 1, salts  # one salt a team, whichever worker sent it
        assert a != b
        for salt in a | b:
            assert len(salt) == 43  # base64url of an HMAC-SHA256
            assert "team" not in salt
        secret = await stack.redis.get(RedisKeys(stack.prefix).cache_salt_secret())
        assert secret is not None
        assert len(bytes.fromhex(secret.decode())) == 32
    finally:
        upstream.stop()


async def test_the_deployments_secret_is_made_once_and_a_foreign_value_is_refused(
    stack: LiveStack,
) -> None:
    keys = RedisKeys(stack.prefix)
    first, second = CacheSalts(), CacheSalts()
    assert first.of("team-a") != second.of("team-a")  # each its own secret until they adopt
    await first.adopt(stack.redis, keys)
    await second.adopt(stack.redis, keys)
    assert first.of("team-a") == second.of("team-a") != first.of("team-b")
    assert first.shared
    assert second.shared

    await stack.redis.set(keys.cache_salt_secret(), "not a secret")
    third = CacheSalts()
    own = third.of("team-a")
    with pytest.raises(ValueError, match="cache_salt_secret is not a secret laneway made"):
        await third.adopt(stack.redis, keys)
    assert third.of("team-a") == own  # it keeps salting with its own
    assert not third.shared
    await stack.redis.delete(keys.cache_salt_secret())
    await stack.redis.rpush(keys.cache_salt_secret(), "a list")
    with pytest.raises(ValueError, match="holds another type of value"):
        await third.adopt(stack.redis, keys)
