"""Redis killed and started again on its data directory in the middle of traffic: the
append-only file brings back every API key and every quota bucket as it was."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ops.redis_server import RedisServer
from tests.stack import Ingress, LiveStack, Services, eventually, free_port

ADMIN = "admin-secret-0123456"
# complexity 0.1, size 1: a 5,000-token hourly budget that refills 1.4 tokens a second.
TEAM = {"size": 1, "complexity": 0.1}


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A Redis of this test's own, as `make up` runs it (its restarts touch no other test)."""
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis", persistent=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _remaining(admin: httpx.AsyncClient, team: str) -> tuple[int, int]:
    """(remaining, budget) of the team's interactive pool, as the admin API reads Redis."""
    response = await admin.get(f"/admin/teams/{team}")
    assert response.status_code == 200, f"team {team} lost: {response.text}"
    pool = response.json()["pools"]["interactive"]
    return int(pool["remaining_tokens"]), int(pool["budget_tokens_per_hour"])


async def _typing(http: httpx.AsyncClient, stop: asyncio.Event, codes: list[int]) -> None:
    body = {"model": "laneway-code", "prompt": "def handler(request):", "max_tokens": 64}
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):  # a connection cut while Redis restarts
            codes.append((await http.post("/v1/completions", json=body)).status_code)
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_redis_restart_mid_traffic_loses_no_key_and_refills_no_bucket(
    services: Services, prefix: str, own_redis: RedisServer
) -> None:
    stack = LiveStack(Services(services.bootstrap, own_redis.url), prefix)
    await stack.create_topics()
    try:
        await _restart_scenario(stack, own_redis)
    finally:
        await stack.stop()


async def _restart_scenario(stack: LiveStack, redis_server: RedisServer) -> None:
    # No quota lease: every request reserves in Redis, so the bucket there is the whole truth.
    options: dict[str, Any] = {"admin_key": ADMIN, "quota_lease_share": 0}
    ingress = await stack.start_ingress(**options)
    await stack.start_worker("completion")
    keys = {f"team-{i}": await stack.api_key(f"team-{i}", **TEAM) for i in range(5)}
    admin = stack.http(ingress, ADMIN)
    typist = stack.http(ingress, keys["team-0"])

    stop, codes = asyncio.Event(), list[int]()
    traffic = asyncio.create_task(_typing(typist, stop, codes))
    try:
        budget = (await _remaining(admin, "team-0"))[1]
        # Spend a third of the budget, then note what is left.
        spent = False
        deadline = time.monotonic() + 60
        while not spent:
            remaining, _ = await _remaining(admin, "team-0")
            spent = remaining < budget * 2 / 3
            assert time.monotonic() < deadline, f"{remaining} of {budget} left after 60 s"
            await asyncio.sleep(0.1)
        before, noted_at = remaining, time.monotonic()
        # What was noted is on disk within a second (appendfsync everysec).
        await asyncio.sleep(2.0)
        redis_server.send_signal(signal.SIGKILL)
        assert redis_server.wait() == -signal.SIGKILL
        redis_server.stop()  # lets go of the dead run (its log file)
        served_before_restart = len(codes)
        redis_server.start()
        # Traffic goes on against the restarted Redis: answered by the quota again (the
        # typist spends faster than its bucket refills, so by now mostly 429s), not by 503s.
        await eventually(
            lambda: sum(c in (200, 429) for c in codes[served_before_restart:]) >= 10,
            60,
            "quota answers after the restart",
        )
    finally:
        stop.set()
        await traffic
    after, budget_after = await _remaining(admin, "team-0")
    elapsed = time.monotonic() - noted_at

    assert budget_after == budget, "the team record was lost: its budget is the default's"
    # Refilled by time (1.4 tokens a second) and at most one request's reservation
    # settled back (prompt + max_tokens): never the whole budget.
    refill = budget / 3600 * elapsed
    assert after <= before + refill + 100, (before, after, budget)
    assert after < budget * 0.8, f"the bucket was refilled: {after} of {budget}"
    assert codes[:served_before_restart].count(200) > 10

    # A replica that never saw these keys: each is looked up in the restarted Redis.
    fresh: Ingress = await stack.start_ingress(**options)
    for team, key in keys.items():
        response = await stack.http(fresh, key).get("/v1/models")
        assert response.status_code == 200, (team, response.text)
