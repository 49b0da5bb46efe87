"""`laneway up` with LANEWAY_SECURED=true: every service logs in as its own principal, a
client without a login gets nothing from Kafka or Redis, and the operator's credentials in
<data dir>/secrets/admin.env run the CLI (keys, principals)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError
from redis.exceptions import AuthenticationError, ResponseError

from laneway.apikeys import create_key
from tests.stack import ROOT
from tests.test_stack_up import KEYS, UpStack, _wait_ready, start_up

pytestmark = pytest.mark.slow


def _admin_env(data: Path) -> dict[str, str]:
    text = (data / "secrets" / "admin.env").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def _start(tmp_path: Path) -> tuple[UpStack, dict[str, str]]:
    return start_up(tmp_path / "up", tmp_path / "up.out", LANEWAY_SECURED="true")


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_secured_stack_serves_and_shuts_out_the_anonymous(tmp_path: Path) -> None:
    stack, env = _start(tmp_path)
    data, process = stack.data, stack.process
    try:
        _wait_ready(stack, 180)
        admin = _admin_env(data)
        assert oct((data / "secrets" / "admin.env").stat().st_mode & 0o777) == "0o600"

        operator = aioredis.Redis.from_url(admin["LANEWAY_REDIS_URL"])
        try:
            key = await create_key(operator, KEYS, "team-a")
        finally:
            await operator.aclose()
        async with stack.http(key) as http:
            response = await http.post(
                "/v1/completions",
                json={"model": "laneway-code", "prompt": "def f():", "max_tokens": 4},
            )
        assert response.status_code == 200, response.text

        anonymous = aioredis.Redis.from_url(stack.redis_url)
        try:
            # Refused before any command runs (an open Redis would answer the ping).
            with pytest.raises((AuthenticationError, ResponseError)):
                await anonymous.ping()
        finally:
            await anonymous.aclose()
        plain = AIOKafkaAdminClient(bootstrap_servers=stack.kafka, request_timeout_ms=3000)
        with pytest.raises(KafkaConnectionError):
            await plain.start()
        await plain.close()

        cli_env = {**env, **admin}
        cli_env.pop("LANEWAY_SECURED")
        created = await asyncio.to_thread(
            _cli, cli_env, "principals", "create", "acme-batch", "--role", "tenant:acme"
        )
        assert created.returncode == 0, created.stderr
        assert "laneway.req.batch.team.acme" in created.stdout
        assert len(created.stdout.splitlines()[-1]) >= 24  # the password, alone
        shown = await asyncio.to_thread(_cli, cli_env, "principals", "acls", "acme-batch")
        assert "User:acme-batch write topic:laneway.req.batch.team.acme" in shown.stdout
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=90)
    assert code == 0, stack.log()
