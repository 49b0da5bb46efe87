"""The local servers of `make up` and of the test session, started here on ports of their own."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import redis
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from laneway.errors import ConfigError
from ops import kafka_jars
from ops.devstack import ServiceError, port_in_use
from ops.kafka_broker import KafkaBroker, Replication
from ops.kafka_cluster import KafkaCluster
from ops.kafka_jars import cache_dir, kafka_classpath
from ops.kafka_topics import create_topics
from ops.redis_server import RedisServer
from tests.stack import free_port, free_port_block, free_port_pair


def test_cache_dir_follows_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LANEWAY_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("LANEWAY_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "laneway"


def test_a_maven_that_never_answers_is_named_not_waited_on_for_ever(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A registry that stops answering holds ``mvn`` for ever: setup says so and stops."""
    stuck = tmp_path / "bin" / "mvn"
    stuck.parent.mkdir()
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stuck.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(kafka_jars, "_MVN_TIMEOUT_S", 0.5)
    with pytest.raises(
        ServiceError, match=r"mvn resolving the Kafka jars .* did not finish within 0 s"
    ):
        kafka_classpath(cache=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "kafka").glob("classpath-*.txt"))  # nothing cached


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


def test_a_cluster_needs_as_many_nodes_as_replicas(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a cluster of 2 nodes cannot hold 3 replicas"):
        KafkaCluster(port=free_port_block(4), data_dir=tmp_path, size=2)
    with pytest.raises(ConfigError, match=r"min\.insync\.replicas must be within 1\.\.the factor"):
        KafkaCluster(port=free_port_block(6), data_dir=tmp_path, replication=Replication(3, 4))
    with pytest.raises(ConfigError, match=r"no node 4: the cluster has nodes 1\.\.3"):
        KafkaCluster(port=free_port_block(6), data_dir=tmp_path).node(4)


async def _describe(
    bootstrap: str, topic: str, partitions: int
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The topic's partitions and config, once the node asked knows all its partitions (a
    node learns of a new topic a moment after the one that created it)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        async with asyncio.timeout(15):
            while True:
                [described] = await admin.describe_topics([topic])
                if len(described["partitions"]) >= partitions:
                    break
                await asyncio.sleep(0.1)
            # The node asked for the config may not know the topic yet either (no entries).
            while True:
                [response] = await admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, topic)]
                )
                entries = response.to_object()["resources"][0]["config_entries"]
                if entries:
                    break
                await asyncio.sleep(0.1)
    finally:
        await admin.close()
    return described["partitions"], {e["config_names"]: e["config_value"] for e in entries}


@pytest.mark.slow
async def test_a_three_node_cluster_takes_writes_with_a_node_down(tmp_path: Path) -> None:
    cluster = KafkaCluster(port=free_port_block(6), data_dir=tmp_path, heap_mb=256, partitions=2)
    await asyncio.to_thread(cluster.start)
    try:
        await asyncio.to_thread(create_topics, cluster.bootstrap, [("cluster.t", 2, {})], 3)
        partitions, config = await _describe(cluster.bootstrap, "cluster.t", 2)
        assert [len(p["replicas"]) for p in partitions] == [3, 3]
        assert config["min.insync.replicas"] == "2"
        leader = partitions[0]["leader"]
        await asyncio.to_thread(cluster.kill, leader)
        assert not cluster.node(leader).running
        # Two replicas of three are in sync: acks=all writes go on (min ISR 2).
        producer = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap, acks="all")
        await producer.start()
        try:
            for partition in (0, 1):
                await producer.send_and_wait("cluster.t", b"x", partition=partition)
        finally:
            await producer.stop()
        partitions, _ = await _describe(cluster.bootstrap, "cluster.t", 2)
        assert all(leader not in p["isr"] for p in partitions)
        await asyncio.to_thread(cluster.restart, leader)
        assert cluster.node(leader).running  # and its metadata names all three brokers
    finally:
        await asyncio.to_thread(cluster.stop)
    assert not any(port_in_use(node.port) for node in cluster.nodes)


def test_a_stale_pid_file_naming_another_redis_is_not_a_leftover(tmp_path: Path) -> None:
    """After a reboot (or orphans cleared by hand) a pid file may name a process that got
    the pid since: another stack's Redis, the system's, a test suite's. Stopping it as this
    stack's leftover killed it. One this data dir's did start is still one, on whatever port
    (LANEWAY_REDIS_PORT changed since)."""
    other = RedisServer(port=free_port(), data_dir=tmp_path / "other")
    with other:
        assert other.pid is not None
        (tmp_path / "ours").mkdir()
        (tmp_path / "ours" / "redis.pid").write_text(str(other.pid))
        assert RedisServer(port=free_port(), data_dir=tmp_path / "ours").leftover_pid() is None
        moved = RedisServer(port=free_port(), data_dir=tmp_path / "other")
        assert moved.leftover_pid() == other.pid
