"""The local servers of `make up` and of the test session, started here on ports of their own."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from ops.devstack import (
    KafkaBroker,
    RedisServer,
    ServiceError,
    cache_dir,
    create_topics,
    port_in_use,
)
from tests.stack import free_port, free_port_pair


@pytest.fixture
def occupied_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_cache_dir_follows_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LANEWAY_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("LANEWAY_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "laneway"


def test_port_in_use(occupied_port: int) -> None:
    assert port_in_use(occupied_port)
    assert not port_in_use(free_port())


def test_redis_server_serves_and_stops_twice(tmp_path: Path) -> None:
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis")
    with server:
        client = redis.Redis.from_url(server.url)
        try:
            assert client.ping()
            client.set("devstack-test", "1")
            assert client.get("devstack-test") == b"1"
        finally:
            client.close()
    assert not port_in_use(server.port)
    server.stop()  # second stop is a no-op
    assert "Ready to accept connections" in (tmp_path / "redis" / "redis.log").read_text()


def test_redis_refuses_taken_port(occupied_port: int, tmp_path: Path) -> None:
    server = RedisServer(port=occupied_port, data_dir=tmp_path)
    with pytest.raises(ServiceError, match=rf"port {occupied_port} .*LANEWAY_REDIS_PORT"):
        server.start()
    server.stop()


def test_redis_names_leftover_from_earlier_run(tmp_path: Path) -> None:
    leftover = RedisServer(port=free_port(), data_dir=tmp_path)
    with leftover:
        assert leftover.running
        fresh = RedisServer(port=leftover.port, data_dir=tmp_path)
        with pytest.raises(ServiceError, match=r"earlier run \(pid \d+\)"):
            fresh.start()
        assert leftover.running


def test_kafka_refuses_taken_port(occupied_port: int, tmp_path: Path) -> None:
    broker = KafkaBroker(port=occupied_port, data_dir=tmp_path)
    with pytest.raises(ServiceError, match=rf"port {occupied_port} .*LANEWAY_KAFKA_PORT"):
        broker.start()
    assert not (tmp_path / "kafka.log").exists()


def test_kafka_refuses_taken_controller_port(tmp_path: Path) -> None:
    port = free_port_pair()
    with socket.socket() as controller:
        controller.bind(("127.0.0.1", port + 1))
        controller.listen()
        broker = KafkaBroker(port=port, data_dir=tmp_path)
        with pytest.raises(ServiceError, match=r"controller \(LANEWAY_KAFKA_PORT \+ 1\) port"):
            broker.start()


@pytest.mark.slow
async def test_kafka_broker_creates_compacted_topic(tmp_path: Path) -> None:
    broker = KafkaBroker(port=free_port_pair(), data_dir=tmp_path / "kafka")
    # Blocking calls inside a coroutine on purpose: they must work with a loop running.
    with broker:
        specs = [("devstack.state", 2, {"cleanup.policy": "compact"})]
        create_topics(broker.bootstrap, specs)
        create_topics(broker.bootstrap, specs)  # already there: no error
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            assert "devstack.state" in await admin.list_topics()
            [response] = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, "devstack.state")]
            )
        finally:
            await admin.close()
        entries = response.to_object()["resources"][0]["config_entries"]
        policy = {e["config_names"]: e["config_value"] for e in entries}["cleanup.policy"]
        assert policy == "compact"
    broker.stop()
    assert not port_in_use(broker.port)
