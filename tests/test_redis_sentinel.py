"""A Redis behind Sentinels: laneway's clients find the master by the Sentinels' word and
follow a failover. Real processes: a master, its replica and one Sentinel."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from laneway.apikeys import create_key, hash_key
from laneway.clients import make_redis
from laneway.constants import RedisKeys
from laneway.errors import ConfigError
from laneway.settings import CommonSettings
from quota.teams import Team, get_team, set_team
from tests.stack import eventually, free_port

REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([REDIS, *args], stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[tuple[str, int, subprocess.Popen[bytes]]]:
    """(a Sentinel URL of service "main", the Sentinel's port, the master's process)."""
    master_port, replica_port, sentinel_port = free_port(), free_port(), free_port()
    # --dir: a replica's full resync writes the master's snapshot to disk, never in the repo.
    common = ["--save", "", "--appendonly", "no", "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    master = _start(["--port", str(master_port), *common], tmp_path / "master.log")
    replica = _start(
        ["--port", str(replica_port), "--replicaof", "127.0.0.1", str(master_port), *common],
        tmp_path / "replica.log",
    )
    conf = tmp_path / "sentinel.conf"  # a Sentinel rewrites its own config: a file of its own
    conf.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\n"
        f"sentinel monitor main 127.0.0.1 {master_port} 1\n"
        "sentinel down-after-milliseconds main 1000\n"
        "sentinel failover-timeout main 5000\n"
    )
    sentinel = _start([str(conf), "--sentinel"], tmp_path / "sentinel.log")
    try:
        yield f"redis+sentinel://127.0.0.1:{sentinel_port}/main/0", sentinel_port, master
    finally:
        for process in (sentinel, replica, master):
            if process.poll() is None:
                process.terminate()
                process.wait(10)


async def test_keys_and_teams_survive_a_failover_through_the_sentinels(
    sentinel_set: tuple[str, int, subprocess.Popen[bytes]],
) -> None:
    url, sentinel_port, master = sentinel_set
    redis = make_redis(CommonSettings(redis_url=url, redis_prefix="sentinel"))
    keys = RedisKeys("sentinel")
    try:

        async def writable() -> bool:
            try:
                await set_team(redis, keys, Team("alpha", size=3))
                return bool(await redis.execute_command("WAIT", 1, 1000))  # the replica has it
            except RedisError:
                return False

        await eventually(writable, 30, "the Sentinel's master to take writes, replicated")
        key = await create_key(redis, keys, "alpha")
        assert await redis.execute_command("WAIT", 1, 2000) == 1
        # The Sentinel learns of replicas from the master's INFO, every 10 s: a master killed
        # before it knows one leaves it nothing to promote.
        async with aioredis.Redis(port=sentinel_port) as sentinel:

            async def replica_known() -> bool:
                replicas = await sentinel.execute_command("SENTINEL", "REPLICAS", "main")
                return bool(replicas)

            await eventually(replica_known, 30, "the Sentinel to know the replica")

        master.send_signal(signal.SIGKILL)
        master.wait(10)

        async def promoted() -> bool:
            try:
                await set_team(redis, keys, Team("beta", size=1))
            except (RedisConnectionError, RedisTimeoutError, ReadOnlyError, RedisError):
                return False
            return True

        await eventually(promoted, 60, "the Sentinel to promote the replica")
        # What the old master had replicated is served by the new one, through the same client.
        assert (await get_team(redis, keys, "alpha")).size == 3
        assert await redis.exists(keys.api_key(hash_key(key))) == 1
    finally:
        await redis.aclose()


def test_a_malformed_sentinel_url_is_refused_by_name() -> None:
    for url in (
        "redis+sentinel://127.0.0.1:26379",  # no service
        "redis+sentinel://127.0.0.1:notaport/main",
        "redis+sentinel://:26379/main",
        "redis+sentinel://127.0.0.1:26379/main/x",
    ):
        with pytest.raises(ConfigError, match="LANEWAY_REDIS_URL"):
            make_redis(CommonSettings(redis_url=url))
