"""A local Kafka cluster of a few KRaft nodes on one machine, for the drills that kill and
restart a node."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from laneway.errors import ConfigError
from ops.devstack import StartedInside
from ops.kafka_broker import KafkaBroker, Replication, new_cluster_id

__all__ = ["KafkaCluster"]


class KafkaCluster(StartedInside):
    """``size`` KRaft nodes, each a broker and a controller voter, on ports of their own:
    node ``i`` (from 1) listens on ``port + 2(i - 1)`` and its controller one above."""

    def __init__(
        self,
        *,
        port: int,
        data_dir: Path,
        size: int = 3,
        heap_mb: int = 384,
        partitions: int = 3,
        replication: Replication | None = None,
    ) -> None:
        replication = replication or Replication()
        largest = max(replication.factor, replication.internal_factor)
        if not 1 <= size <= 9 or largest > size:
            raise ConfigError(
                f"a cluster of {size} nodes cannot hold {largest} replicas (size: 1..9, "
                "at least the replication factor)"
            )
        if not 1 <= replication.min_insync <= replication.factor or not (
            1 <= replication.internal_min_insync <= replication.internal_factor
        ):
            raise ConfigError(f"min.insync.replicas must be within 1..the factor: {replication}")
        ports = [port + 2 * i for i in range(size)]
        voters = ",".join(f"{i}@127.0.0.1:{p + 1}" for i, p in enumerate(ports, start=1))
        cluster_id = new_cluster_id()
        self.nodes = [
            KafkaBroker(
                port=p,
                data_dir=data_dir / f"node-{i}",
                heap_mb=heap_mb,
                partitions=partitions,
                node_id=i,
                voters=voters,
                cluster_id=cluster_id,
                replication=replication,
            )
            for i, p in enumerate(ports, start=1)
        ]
        self.bootstrap = ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> KafkaBroker:
        """The node with ``node_id`` (1..size)."""
        if not 1 <= node_id <= len(self.nodes):
            raise ConfigError(f"no node {node_id}: the cluster has nodes 1..{len(self.nodes)}")
        return self.nodes[node_id - 1]

    def start(self, timeout: float = 120.0) -> None:
        """Start every node at once (a quorum needs a majority before any node is ready),
        then wait until each serves metadata naming all of them."""
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def kill(self, node_id: int) -> None:
        """SIGKILL one node and reap it (a crash: no controlled shutdown)."""
        node = self.node(node_id)
        node.send_signal(signal.SIGKILL)
        if node.pid is not None:
            node.wait()
        node.stop()

    def restart(self, node_id: int, timeout: float = 90.0) -> None:
        """Start a node again on its data (after ``kill``) and wait until it serves."""
        node = self.node(node_id)
        node.stop()
        node.start(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node, killing what still runs after ``timeout``; safe to call twice.

        All are asked at once, and a shared deadline bounds the wait: a node's controlled
        shutdown needs an active controller, so whichever nodes are left last wait for a
        quorum that left with the others (seen: the last one waits for good).
        """
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop(max(0.5, deadline - time.monotonic()))
