"""The Redis circuit on a real redis-server: paused (SIGSTOP), refusing, and a busy caller."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from ingress.quota_gate import QuotaGate
from laneway.constants import RedisKeys
from laneway.redis_circuit import RedisCircuit, RedisUnavailable, attach_circuit
from ops.redis_server import RedisServer
from quota import QuotaEnforcer, QuotaPolicy, Team
from tests.stack import free_port

HOT_MS = 50


@pytest.fixture
async def paused_redis(tmp_path: Path) -> AsyncIterator[tuple[RedisServer, aioredis.Redis]]:
    """A Redis of the test's own (pausing the session's would stall the other tests)."""
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis")
    server.start()
    client = aioredis.Redis.from_url(server.url, socket_timeout=5)
    try:
        yield server, client
    finally:
        if server.running and server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        await client.aclose()
        server.stop()


def _circuit(client: aioredis.Redis) -> RedisCircuit:
    return attach_circuit(client, hot_timeout_ms=HOT_MS, failures=3, probe_interval_ms=50)


async def test_a_paused_redis_opens_the_circuit_at_once_and_a_probe_closes_it(
    paused_redis: tuple[RedisServer, aioredis.Redis],
) -> None:
    server, client = paused_redis
    circuit = _circuit(client)
    told: list[bool] = []
    circuit.listen(told.append)
    # Connected outside the circuit: a connect slowed by a busy machine is not what it tests.
    await client.set("k", "v")
    assert await circuit.hot(lambda: client.get("k")) == b"v"
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        # Given up by the circuit's own timer ("within 50 ms"), not the client's 5 s socket
        # timeout (which would raise redis-py's TimeoutError).
        with pytest.raises(RedisUnavailable, match=f"did not answer within {HOT_MS} ms"):
            await circuit.hot(lambda: client.get("k"))
        assert circuit.open
        assert told == [True]
        # Open: the next calls are refused before they are made, background ones included.
        with pytest.raises(RedisUnavailable, match="circuit open"):
            await circuit.hot(lambda: client.get("k"))
        with pytest.raises(RedisUnavailable, match="circuit open"):
            await circuit.background(lambda: client.get("k"), timeout_s=None)
        await asyncio.sleep(0.3)  # several probes, all unanswered
        assert circuit.open
    finally:
        os.kill(server.pid, signal.SIGCONT)
    await asyncio.wait_for(circuit.wait_closed(), 10)
    assert told == [True, False]
    assert circuit.closings == 1
    assert await circuit.hot(lambda: client.get("k")) == b"v"
    await circuit.stop()


async def test_a_busy_caller_is_not_taken_for_a_hung_redis(
    paused_redis: tuple[RedisServer, aioredis.Redis],
) -> None:
    _, client = paused_redis
    circuit = _circuit(client)
    await client.ping()  # connected, outside the circuit

    call = asyncio.create_task(circuit.hot(lambda: client.incr("n")))
    await asyncio.sleep(0)  # the call is on its way
    _busy(4 * HOT_MS / 1000)  # the loop does other work: no answer is read meanwhile
    assert await call == 1  # its timer fired late: it waited on, and got its answer
    assert not circuit.open


def _busy(seconds: float) -> None:
    """Hold the event loop, as a burst of CPU work in the process would."""
    time.sleep(seconds)


async def test_refused_connections_open_it_after_the_failures_in_a_row() -> None:
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    circuit = _circuit(client)
    try:
        for _ in range(2):
            with pytest.raises(RedisConnectionError):
                await circuit.hot(client.ping)
            assert not circuit.open  # refused at once: no silence, so not yet
        with pytest.raises(RedisConnectionError):
            await circuit.hot(client.ping)
        assert circuit.open
    finally:
        await circuit.stop()
        await client.aclose()


async def test_a_lease_is_not_given_back_twice_when_redis_does_not_answer_its_release(
    paused_redis: tuple[RedisServer, aioredis.Redis],
) -> None:
    """A request admitted from the ingress's lease whose produce failed is settled at 0 in
    Redis. When Redis does not answer (paused), the lease does not take the tokens back
    instead: the produce may have stored the request all the same, and the worker's settle
    of that copy (dropped on its tombstone) gives them back to the pool. Both, and they were
    budget nobody granted."""
    server, client = paused_redis
    _circuit(client)
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens/h
    quota = QuotaEnforcer(client, RedisKeys("lease-test"), policy)
    gate = QuotaGate(quota, policy, lease_share=0.5)
    team = Team("alpha", size=1)
    admitted = await gate.admit(team, "r1", 100)
    assert admitted is not None
    assert admitted.leased == 100
    held = gate._leases["alpha"].tokens  # what the lease holds for later requests

    async def in_pool() -> Any:
        return (await quota.snapshot(team))["pools"]["interactive"]["remaining_tokens"]

    before = await in_pool()
    accepted = time.time()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        await gate.release(team, "r1", admitted, accepted_ts=accepted)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    await asyncio.wait_for(gate.circuit.wait_closed(), 10)
    assert gate._leases["alpha"].tokens == held  # not taken back here
    # The stored copy, dropped by its worker, is settled as a dropped request is.
    await quota.settle("alpha", "r1", 0, leased=100, accepted_ts=accepted, min_charge=0)
    assert 100 <= await in_pool() - before <= 102  # back in the pool once (and a refill)


async def test_a_team_not_heard_of_waits_for_a_redis_silent_a_moment_rather_than_guessing(
    paused_redis: tuple[RedisServer, aioredis.Redis],
) -> None:
    """Redis silent for a moment (a burst on a busy host looks like this) opens the circuit.
    A team the ingress knows nothing of is not admitted locally from a guess: its request
    waits for Redis to answer again (up to a second) and is admitted by Redis, exactly. One
    the ingress heard of is admitted locally at once, from what Redis last said it had."""
    server, client = paused_redis
    _circuit(client)
    policy = QuotaPolicy(unit_tokens=100, units_per_member=10, offpeak="")  # 1,000 tokens/h
    quota = QuotaEnforcer(client, RedisKeys("unheard-test"), policy)
    gate = QuotaGate(quota, policy)
    known, new = Team("known", size=1), Team("new", size=1)
    assert (await gate.admit(known, "k1", 100)) is not None  # heard: 900 left
    await client.set("warm", "1")  # the connection is up: the pause below is all it meets
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        local = await gate.admit(known, "k2", 100)
        assert local is not None
        assert local.local == 100  # admitted locally, at once
        waiting = asyncio.ensure_future(gate.admit(new, "n1", 100))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # waits for Redis instead
    finally:
        os.kill(server.pid, signal.SIGCONT)
    admitted = await asyncio.wait_for(waiting, 5)
    assert admitted is not None
    assert admitted.local == 0  # Redis admitted it: exact
