"""A hung Redis costs interactive traffic nothing (issue 34): the drill on the real stack.

A Redis of the test's own (pausing the session's would stall every other test) is stopped
with SIGSTOP for 10 s under steady completion traffic through an ingress process and a
completion worker process, both on the default Redis timeouts. No request may fail, and once
the worker has stopped (nothing it owes still on its way) the team's quota usage in Redis
must equal the tokens the completions were served: no charge lost, none counted twice.
How fast they were served meanwhile (P99 during the pause against before) depends on the
machine: ``bench/redis_pause.py`` measures it, the same drill, longer, with its table.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bench.redis_pause import (
    drive,
    sigcont,
    sigstop,
    table,
    used_tokens,
    warm_up,
    window_rows,
)
from laneway.redis_circuit import DEFAULT_HOT_TIMEOUT_MS
from ops.devstack import stop_processes
from ops.redis_server import RedisServer
from tests.stack import LiveStack, Services, free_port

TEAM = "paused"
ADMIN = "pause-admin-0123456"
QUIET_S, PAUSE_S, AFTER_S = 10.0, 10.0, 5.0


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_paused_redis_costs_completions_nothing(
    services: Services, tmp_path: Path, prefix: str
) -> None:
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis")
    server.start()
    stack = LiveStack(Services(services.bootstrap, server.url), prefix)
    procs: list[subprocess.Popen[bytes]] = []
    since = time.time()
    try:
        await stack.create_topics()
        port = free_port()
        defaults = {"LANEWAY_REDIS_HOT_TIMEOUT_MS": str(DEFAULT_HOT_TIMEOUT_MS)}
        procs.append(
            stack.spawn(
                "ingress",
                LANEWAY_PORT=str(port),
                LANEWAY_ADMIN_KEY=ADMIN,
                LANEWAY_PROBE_INTERVAL_S="0",
                LANEWAY_LOG_LEVEL="WARNING",
                **defaults,
            )
        )
        worker = stack.spawn(
            "workers",
            LANEWAY_POOL="completion",
            LANEWAY_ENGINE="sim",
            LANEWAY_WORKER_ID=f"{prefix}-pause",
            # An engine step of 10 ms, 16 tokens: completions take what a small model's do,
            # so the tail measures laneway, not scheduling noise on an empty engine.
            LANEWAY_SIM_DECODE_MS_PER_STEP="10",
            LANEWAY_LOG_LEVEL="WARNING",
            **defaults,
        )
        procs.append(worker)
        base_url = f"http://127.0.0.1:{port}"
        # Size 1: 50,000 tokens an hour, leased 500 at a time: the pause first spends the
        # ingress's lease, then its local limiter admits.
        key = await stack.api_key(TEAM, size=1)
        await warm_up(base_url, await stack.api_key("warm-up", size=100))

        pid = server.pid
        assert pid is not None
        (windows, samples), readiness = await asyncio.gather(
            drive(
                base_url,
                key,
                pause=sigstop(pid),
                resume=sigcont(pid),
                quiet_s=QUIET_S,
                pause_s=PAUSE_S,
                after_s=AFTER_S,
            ),
            _readiness_at(base_url, QUIET_S + PAUSE_S / 2),
        )
        rows = window_rows(windows, samples)
        report = table(rows)
        assert [(row.name, row.failed) for row in rows] == [
            ("quiet 1", 0),
            ("paused 1", 0),
            ("after", 0),
        ], report
        # The pause did cover steady traffic (a load generator starved of CPU sends late).
        assert rows[1].sent >= PAUSE_S * 10 * 0.8, report

        # Ready while Redis was paused, which it reported as degraded, not down.
        status, body = readiness
        assert status == 200, body
        assert body["ready"] is True
        assert body["checks"]["redis"]["degraded"] is True
        assert body["checks"]["kafka"]["ok"] is True
        # The ingress's circuit opened (the fallbacks carried the pause) and closed again.
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = (await http.get(f"{base_url}/metrics")).text
        assert _metric(metrics, "laneway_redis_circuit_opens_total") >= 1
        assert _metric(metrics, "laneway_redis_circuit_open") == 0

        # The worker stops: what it still owes is paid before it exits, then nothing else
        # can charge the team.
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0
        used = await used_tokens(server.url, prefix, TEAM, since)
        assert used == sum(s.tokens for s in samples), report
    finally:
        if server.running and server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)  # whatever failed (a running one: no change)
        await asyncio.to_thread(stop_processes, procs)
        await stack.stop()
        server.stop()


async def _readiness_at(base_url: str, at_s: float) -> tuple[int, dict[str, object]]:
    """``/readyz`` with the admin key (each check shown), ``at_s`` seconds from now."""
    await asyncio.sleep(at_s)
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(
            f"{base_url}/readyz", headers={"Authorization": f"Bearer {ADMIN}"}
        )
    return response.status_code, response.json()


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus's text format."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} on /metrics")
