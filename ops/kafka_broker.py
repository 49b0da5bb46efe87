"""A local KRaft Kafka node (broker and controller in one JVM): its settings, storage format,
start and readiness probe."""

from __future__ import annotations

import base64
import gc
import logging
import socket
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from laneway.errors import ServiceError
from ops.broker_admin import BrokerAdmin
from ops.devstack import ServerProcess, run_sync, run_tool
from ops.kafka_jars import kafka_classpath

__all__ = ["KafkaBroker", "Replication"]

log = logging.getLogger(__name__)

# Formatting the storage starts one JVM and writes a few files: seconds, or a stuck machine.
_FORMAT_TIMEOUT_S = 120.0

# Kafka's INFO chatter from these packages drowns what matters when a start fails.
_QUIET_LOGGERS = (
    "kafka.coordinator",
    "kafka.log",
    "kafka.request.logger",
    "org.apache.kafka.controller",
    "org.apache.kafka.coordinator",
    "org.apache.kafka.image",
    "org.apache.kafka.metadata",
    "org.apache.kafka.raft",
    "org.apache.kafka.storage",
    "state.change.logger",
    # Every refused request is a line at INFO: one tenant's client retrying a topic it may
    # not read wrote 44 MB a minute into kafka.log, which nothing rotates (the secured mode).
    "kafka.authorizer.logger",
)
# Console to stdout, which the broker's Popen sends to kafka.log. No log4j shutdown hook:
# it would stop logging before Kafka's own hook has logged its shutdown.
_LOG4J2 = "".join(
    [
        "status = warn\nshutdownHook = disable\n",
        "appender.out.type = Console\nappender.out.name = out\nappender.out.target = SYSTEM_OUT\n",
        "appender.out.layout.type = PatternLayout\n",
        "appender.out.layout.pattern = [%d] %p %m (%c{1})%n\n",
        "rootLogger.level = INFO\nrootLogger.appenderRef.out.ref = out\n",
        *(
            f"logger.q{i}.name = {name}\nlogger.q{i}.level = WARN\n"
            for i, name in enumerate(_QUIET_LOGGERS)
        ),
    ]
)


@dataclass(frozen=True)
class Replication:
    """Replica counts a broker gives new topics and its own internal topics (consumer
    offsets, transaction state, share-group state)."""

    factor: int = 3
    min_insync: int = 2
    internal_factor: int = 3
    internal_min_insync: int = 2

    @classmethod
    def single(cls) -> Replication:
        """One node: one replica of everything."""
        return cls(1, 1, 1, 1)


def new_cluster_id() -> str:
    """A random KRaft cluster id (base64 of a UUID, as ``kafka-storage random-uuid``)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


class KafkaBroker(ServerProcess):
    """A KRaft Kafka node (broker and controller in one JVM): alone by default, for
    development and tests, or one voter of a ``KafkaCluster``.

    The controller listens on ``port + 1``. ``voters`` is the shared
    ``controller.quorum.voters`` (default: this node alone) and ``cluster_id`` the id every
    node of a cluster is formatted with (default: a new one on first use).
    """

    name = "kafka"
    port_setting = "LANEWAY_KAFKA_PORT"
    cmdline_marker = b"kafka.Kafka"

    def __init__(
        self,
        *,
        port: int,
        data_dir: Path,
        heap_mb: int = 768,
        partitions: int = 3,
        jvm_options: Sequence[str] = (),
        node_id: int = 1,
        voters: str = "",
        cluster_id: str = "",
        replication: Replication | None = None,
        admin: BrokerAdmin | None = None,
    ) -> None:
        super().__init__(port=port, data_dir=data_dir)
        self.heap_mb = heap_mb
        self.partitions = partitions
        self.jvm_options = tuple(jvm_options)  # extra JVM flags for the broker (benchmarks)
        self.bootstrap = f"127.0.0.1:{port}"
        self.node_id = node_id
        # Static voters, not a dynamic quorum: the port may change between runs without
        # reformatting (a --standalone format records the controller endpoint in the log).
        self.voters = voters or f"{node_id}@127.0.0.1:{port + 1}"
        self.cluster_id = cluster_id
        self.replication = replication or Replication.single()
        # Ready once metadata names every voter as a live broker (all nodes are both).
        self.expected_brokers = len(self.voters.split(","))
        # Secured mode: SASL on every listener, ACLs enforced, ``admin`` the super user.
        self.admin = admin

    @property
    def auth(self) -> dict[str, Any]:
        """aiokafka options that connect as the admin principal ({} on a PLAINTEXT broker)."""
        return self.admin.auth if self.admin is not None else {}

    @property
    def _log_dir(self) -> Path:
        return self.data_dir / "kafka-logs"

    def _server_properties(self) -> str:
        controller = f"127.0.0.1:{self.port + 1}"
        rep = self.replication
        settings = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters,
            "listeners": f"PLAINTEXT://{self.bootstrap},CONTROLLER://{controller}",
            "advertised.listeners": f"PLAINTEXT://{self.bootstrap}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self._log_dir),
            "num.partitions": str(self.partitions),
            "default.replication.factor": str(rep.factor),
            "min.insync.replicas": str(rep.min_insync),
            "auto.create.topics.enable": "false",
            # A restarted node finds its own previous registration still alive and retries
            # until that session expires (9 s by default); keep that wait short.
            "broker.session.timeout.ms": "3000",
            "broker.heartbeat.interval.ms": "500",
            "group.initial.rebalance.delay.ms": "0",
            # Fewer partitions than the default 50 keep the first group join and
            # transaction init fast.
            "offsets.topic.replication.factor": str(rep.internal_factor),
            "offsets.topic.num.partitions": "5",
            "transaction.state.log.replication.factor": str(rep.internal_factor),
            "transaction.state.log.min.isr": str(rep.internal_min_insync),
            "transaction.state.log.num.partitions": "5",
            "share.coordinator.state.topic.replication.factor": str(rep.internal_factor),
            "share.coordinator.state.topic.min.isr": str(rep.internal_min_insync),
            # Small segments so the cleaner gets to compact topics during a dev session.
            "log.segment.bytes": str(16 * 1024 * 1024),
            "log.retention.hours": "24",
            "log.retention.check.interval.ms": "60000",
            "log.cleaner.enable": "true",
            "log.cleaner.threads": "1",
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
            # Two cores: every hand-off between broker threads costs a context switch.
            "num.network.threads": "1",
            "num.io.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
        }
        if self.admin is not None:
            settings.update(self.admin.broker_properties(self.bootstrap, controller))
        return "".join(f"{key}={value}\n" for key, value in settings.items())

    def _java(self, classpath: str, heap_mb: int, *args: str) -> list[str]:
        return [
            "java",
            f"-Xmx{heap_mb}m",
            # ZGC: sub-millisecond pauses. With the parallel collector, 25-40 ms young pauses
            # every ~20 s set the P99 of every request that crosses the broker (bench/overhead).
            "-XX:+UseZGC",
            # No proactive cycles: by default ZGC also collects whenever it guesses the cost is
            # under 1 % of throughput, which at 200 requests/s meant a cycle every 7-11 s, each
            # taking 80-240 ms of a core (the largest bunches of slow requests in
            # bench/overhead). Without them it collects when the heap fills: every ~40 s at
            # 768 MB, each cycle costing the same (it depends on the live set, ~90 MB).
            "-XX:-ZProactive",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp",
            classpath,
            *args,
        ]

    def _format_storage(self, classpath: str, properties: Path) -> None:
        if (self._log_dir / "meta.properties").is_file():
            return
        cluster_id = self.cluster_id or new_cluster_id()
        log.info("formatting Kafka storage in %s (cluster id %s)", self._log_dir, cluster_id)
        argv = self._java(
            classpath,
            256,
            "kafka.tools.StorageTool",
            "format",
            # One argument with "=": a random id may start with "-" and parse as an option.
            f"--cluster-id={cluster_id}",
            "--config",
            str(properties),
            "--ignore-formatted",
            # The admin's SCRAM credential, there before the broker serves anyone: the broker
            # authenticates to itself with it, and it creates every other principal.
            *(self.admin.format_args() if self.admin is not None else ()),
        )
        result = run_tool(
            argv,
            _FORMAT_TIMEOUT_S,
            f"kafka storage format of {self._log_dir} (a machine too loaded to start a JVM?)",
        )
        if result.returncode == 0 and self.admin is not None:
            self.admin.mark_formatted(self._log_dir)
        if result.returncode != 0:
            raise ServiceError(
                f"kafka storage format failed (exit {result.returncode}) for {self._log_dir}:\n"
                + (result.stdout + result.stderr).strip()[-4000:]
            )

    def start(self, timeout: float = 90.0) -> None:
        """Format storage on first use, start the broker and wait until it serves metadata
        that names every voter as a broker."""
        if self.running:
            return
        self.launch()
        self._wait_ready(timeout)

    def launch(self) -> None:
        """Format storage on first use and start the JVM, without waiting for it: a
        cluster's nodes need each other (a quorum) before any of them is ready."""
        if self.running:
            return
        self._check_port_free(self.port, "Kafka")
        self._check_port_free(self.port + 1, "Kafka controller (LANEWAY_KAFKA_PORT + 1)")
        classpath = kafka_classpath()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        properties = self.data_dir / "server.properties"
        properties.touch()
        properties.chmod(0o600)  # in secured mode it holds the admin's password
        properties.write_text(self._server_properties())
        if self.admin is not None:
            self.admin.check_formatted(self._log_dir)
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2)
        self._format_storage(classpath, properties)
        argv = self._java(classpath, self.heap_mb, "kafka.Kafka", str(properties))
        cp = argv.index("-cp")
        argv[cp:cp] = self.jvm_options  # after the defaults: the JVM takes the last of a flag
        self._spawn(argv)

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Wait until a launched node serves metadata naming every voter (stopped if not)."""
        self._wait_ready(timeout)

    def _probe(self) -> tuple[bool, str]:
        # A plain connect first: aiokafka logs an ERROR for every refused connection.
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
        except OSError as exc:
            return False, str(exc)
        # A broker still starting may drop aiokafka's connection mid-answer; aiokafka then
        # leaves the transport to the garbage collector, whose ResourceWarning would surface
        # in whatever runs next. Collected here, on this probe's account.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            try:
                brokers = run_sync(_metadata_brokers(self.bootstrap, self.auth))
            except Exception as exc:  # noqa: BLE001 - any failure here means "not ready yet"
                return False, f"{type(exc).__name__}: {exc}"
            finally:
                gc.collect()
        if len(brokers) < self.expected_brokers:
            return False, f"metadata lists {len(brokers)} of {self.expected_brokers} brokers"
        return True, ""


async def _metadata_brokers(bootstrap: str, auth: dict[str, Any]) -> list[Any]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **auth)
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    brokers: list[Any] = cluster["brokers"]
    return brokers
