"""The test upstream's hold and release (``bench.upstream_server``), which tests use to keep a
request on its slot instead of racing a token clock: a held request starts no token until it
is released, a release is all or nothing, and a prompt can be held again after a release."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from tests.upstream_process import UpstreamProcess


async def _complete(upstream: UpstreamProcess, prompt: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        body = {"model": "up", "prompt": prompt, "max_tokens": 3}
        reply = await client.post(upstream.url + "/completions", json=body)
        reply.raise_for_status()
        return dict(reply.json())


async def test_a_held_request_keeps_its_slot_without_a_token_until_released(
    upstreams: Callable[..., Any],
) -> None:
    upstream = await upstreams(slots=1, token_ms=5)
    await upstream.hold("held one")
    first = asyncio.ensure_future(_complete(upstream, "held one"))
    await upstream.until(lambda running, _: running == 1, "the held request on its slot")
    second = asyncio.ensure_future(_complete(upstream, "behind it"))
    await upstream.until(lambda _, waiting: waiting == 1, "the next request queued")
    # Both are still in the upstream (its log has an entry per ended request only).
    assert upstream.entries() == []
    assert not first.done()
    assert not second.done()

    await upstream.release("held one")
    assert (await first)["usage"]["completion_tokens"] == 3
    await second
    ran = {e["prompt"]: e for e in upstream.entries()}
    assert ran["held one"]["tokens"] == 3
    assert ran["behind it"]["queued"]
    assert ran["held one"]["end"] < ran["behind it"]["start"]


async def test_a_release_naming_an_unknown_prompt_releases_none(
    upstreams: Callable[..., Any],
) -> None:
    upstream = await upstreams(slots=2, token_ms=5)
    await upstream.hold("a", "b")
    refused = await upstream.control("release", {"prompts": ["a", "typo"]})
    assert refused.status_code == 400
    assert "typo" in refused.text
    assert await upstream.held() == ["a", "b"]
    # "a" was not released by the bad call: a request with it still waits on its slot.
    waiting = asyncio.ensure_future(_complete(upstream, "a"))
    await upstream.until(lambda running, _: running == 1 or waiting.done(), "a's request")
    assert not waiting.done(), "the refused release let the held prompt through"
    await upstream.release("a")
    await waiting

    bodies: list[object] = [{"prompt": ["a"]}, {"prompts": "a"}, {"prompts": [1]}, []]
    for body in bodies:
        bad = await upstream.control("hold", body)
        assert bad.status_code == 400, body
        assert "prompts" in bad.text, body
    assert await upstream.held() == ["b"]


async def test_a_prompt_held_again_after_a_release_holds_the_next_request(
    upstreams: Callable[..., Any],
) -> None:
    upstream = await upstreams(slots=1, token_ms=5)
    await upstream.hold("again")
    await upstream.release("again")
    await _complete(upstream, "again")  # released: runs through
    assert await upstream.held() == []

    await upstream.hold("again")
    assert await upstream.held() == ["again"]
    held = asyncio.ensure_future(_complete(upstream, "again"))
    await upstream.until(lambda running, _: running == 1, "the re-held request on its slot")
    assert len(upstream.entries()) == 1
    assert not held.done()
    await upstream.release("again")
    await held
    assert [e["tokens"] for e in upstream.entries()] == [3, 3]
