"""Local Kafka (KRaft: one node, or a small cluster) and Redis processes for `make up`, the
test session and the drills.

Both servers run as child processes in their own session, so a Ctrl-C in the terminal reaches
only our CLI, which then stops workers first and the servers last.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import gc
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
import warnings
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeVar
from urllib.parse import quote

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from laneway.clients import kafka_auth
from laneway.errors import ConfigError, ServiceError
from laneway.kafka_acl import scram_salted
from laneway.settings import CommonSettings

__all__ = [
    "BrokerAdmin",
    "KafkaBroker",
    "KafkaCluster",
    "RedisServer",
    "RedisUser",
    "Replication",
    "ServiceError",
    "cache_dir",
    "create_topics",
    "create_topics_async",
    "kafka_classpath",
    "port_in_use",
    "redis_acl_file",
    "stop_processes",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_POM = Path(__file__).resolve().parent.parent / "scripts" / "kafka" / "pom.xml"
_LOG_TAIL_LINES = 40
_POLL_S = 0.25

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


def cache_dir() -> Path:
    """Downloads and resolved classpaths live here: ``$LANEWAY_CACHE_DIR`` or ~/.cache/laneway."""
    configured = os.environ.get("LANEWAY_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "laneway"


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """SIGTERM every process still running, give them ``grace_s`` to drain, then kill."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_in_use(port: int) -> bool:
    """True if something already listens on (or holds) 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same flag as redis and the JVM use, so a port in TIME_WAIT still counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _require(program: str, install_hint: str) -> str:
    found = shutil.which(program)
    if found is None:
        raise ServiceError(f"`{program}` is not on PATH; install it ({install_hint})")
    return found


def kafka_classpath(cache: Path | None = None) -> str:
    """Resolve the Kafka broker jars with Maven (cached) and return the Java classpath."""
    _require("java", "apt-get install openjdk-17-jre-headless")
    mvn = _require("mvn", "apt-get install maven")
    if not _POM.is_file():
        raise ServiceError(f"{_POM} is missing; the Kafka jars are resolved from it")
    pom_digest = hashlib.sha256(_POM.read_bytes()).hexdigest()[:12]
    target_dir = (cache or cache_dir()) / "kafka"
    target = target_dir / f"classpath-{pom_digest}.txt"
    if target.is_file():
        classpath = target.read_text().strip()
        missing = [jar for jar in classpath.split(os.pathsep) if not Path(jar).is_file()]
        if classpath and not missing:
            return classpath
        log.info(
            "cached Kafka classpath lacks %d jar(s) (e.g. %s); re-resolving",
            len(missing),
            missing[:1],
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    log.info("resolving Kafka jars with Maven (first run downloads ~100 MB into ~/.m2)")
    started = time.monotonic()
    result = subprocess.run(
        [
            mvn,
            "-q",
            "-B",
            "-f",
            str(_POM),
            "dependency:build-classpath",
            f"-Dmdep.outputFile={partial}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0 or not partial.is_file():
        output = (result.stdout + result.stderr).strip().splitlines()
        raise ServiceError(
            f"mvn could not resolve the Kafka jars from {_POM} (exit {result.returncode}):\n"
            + "\n".join(output[-_LOG_TAIL_LINES:])
        )
    partial.replace(target)
    log.info("Kafka classpath resolved in %.1fs", time.monotonic() - started)
    return target.read_text().strip()


def _run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion, on a helper thread if this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


class _StartedInside:
    """``with server:`` starts it and stops it after the block."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _ServerProcess(_StartedInside):
    """A child server process: log file, port guard, stop with SIGTERM then SIGKILL."""

    name = "server"
    port_setting = "LANEWAY_PORT"
    # Found in /proc/<pid>/cmdline of our server (redis-server rewrites its argv).
    cmdline_marker = b"server"

    def __init__(self, *, port: int, data_dir: Path) -> None:
        self.port = port
        self.data_dir = data_dir
        self._process: subprocess.Popen[bytes] | None = None
        # The latest run, kept after stop() lets go of it: wait() and signals still reach it.
        self._spawned: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0

    @property
    def log_path(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    @property
    def _pid_path(self) -> Path:
        return self.data_dir / f"{self.name}.pid"

    def leftover_pid(self) -> int | None:
        """The pid of a run of this server that its pid file names and that still runs (its
        command line says so): one an earlier run left behind, if this one did not start it."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(self._pid_path.read_text())
            if self.cmdline_marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        return None

    def _check_port_free(self, port: int, what: str) -> None:
        if not port_in_use(port):
            return
        hint = ""
        pid = self.leftover_pid()
        if pid is not None:
            hint = f"; a {self.name} from an earlier run (pid {pid}) still holds it: kill {pid}"
        raise ServiceError(
            f"{what} port {port} is already in use{hint}; "
            f"set {self.port_setting} to a free port or stop whatever listens there"
        )

    def _spawn(self, argv: list[str]) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log_start = self._log.tell()
        try:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        except OSError as exc:
            self.stop()
            raise ServiceError(f"could not run {argv[0]}: {exc}") from exc
        self._spawned = self._process
        self._pid_path.write_text(str(self._process.pid))
        log.info(
            "started %s (pid %d) on port %d, log %s",
            self.name,
            self._process.pid,
            self.port,
            self.log_path,
        )

    def log_tail(self) -> str:
        """The last lines this server wrote since it was last started."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self._log_start)
                lines = fh.read().decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def _wait_ready(self, timeout: float) -> None:
        try:
            self._poll_until_ready(timeout)
        except BaseException:
            # Also on Ctrl-C: a half-started server must not outlive us in its own session.
            self.stop()
            raise

    def _poll_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_error = "not probed yet"
        while True:
            if self._process is None:
                raise ServiceError(f"{self.name} was stopped while starting")
            code = self._process.poll()
            if code is not None:
                raise ServiceError(
                    f"{self.name} exited with code {code} while starting; "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            ready, last_error = self._probe()
            if ready:
                return
            if time.monotonic() >= deadline:
                raise ServiceError(
                    f"{self.name} on port {self.port} was not ready after {timeout:.0f}s "
                    f"(last probe: {last_error}); {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    def _probe(self) -> tuple[bool, str]:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def wait(self) -> int:
        """Block until the latest run exits and return its exit code (-N: signal N)."""
        process = self._spawned
        if process is None:
            raise ServiceError(f"{self.name} was never started")
        return process.wait()

    def send_signal(self, signum: int) -> None:
        """Signal the latest run if it still runs, stopping or not (a no-op otherwise)."""
        process = self._spawned
        if process is not None and process.poll() is None:
            process.send_signal(signum)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop with SIGTERM, then SIGKILL after ``timeout`` seconds; safe to call twice."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "%s (pid %d) ignored SIGTERM for %.0fs; killing it",
                        self.name,
                        process.pid,
                        timeout,
                    )
                    process.kill()
                    process.wait()
            log.info("stopped %s (pid %d, exit %s)", self.name, process.pid, process.returncode)
            with contextlib.suppress(OSError):
                self._pid_path.unlink()
        if self._log is not None:
            self._log.close()
            self._log = None


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


@dataclass(frozen=True)
class BrokerAdmin:
    """The super user of a secured broker: SASL/SCRAM on the client listener (the one every
    client and the broker itself use), SASL/PLAIN on the controller listener (KRaft reads no
    SCRAM credential there), the ACL authorizer on, nothing allowed that no ACL allows."""

    username: str
    password: str = field(repr=False)
    mechanism: str = "SCRAM-SHA-256"

    _MARKER = "laneway-sasl-admin"

    @property
    def auth(self) -> dict[str, Any]:
        return {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": self.mechanism,
            "sasl_plain_username": self.username,
            "sasl_plain_password": self.password,
        }

    def broker_properties(self, bootstrap: str, controller: str) -> dict[str, str]:
        user, secret, mechanism = self.username, self.password, self.mechanism
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
        plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
        return {
            "listeners": f"CLIENT://{bootstrap},CONTROLLER://{controller}",
            "advertised.listeners": f"CLIENT://{bootstrap}",
            "inter.broker.listener.name": "CLIENT",
            "listener.security.protocol.map": "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "listener.name.client.sasl.enabled.mechanisms": mechanism,
            f"listener.name.client.{mechanism.lower()}.sasl.jaas.config": (
                f'{scram} required username="{user}" password="{secret}";'
            ),
            "sasl.mechanism.inter.broker.protocol": mechanism,
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": (
                f'{plain} required username="{user}" password="{secret}" user_{user}="{secret}";'
            ),
            "sasl.mechanism.controller.protocol": "PLAIN",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{user}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def format_args(self) -> list[str]:
        """``kafka-storage format --add-scram`` with the salted password, not the password
        (the command line is visible to every local user while it runs)."""
        salt, salted, iterations = scram_salted(self.password, self.mechanism)
        encode = base64.b64encode
        return [
            "--add-scram",
            f"{self.mechanism}=[name={self.username},iterations={iterations},"
            f'salt="{encode(salt).decode()}",saltedpassword="{encode(salted).decode()}"]',
        ]

    def _fingerprint(self) -> str:
        return f"{self.username} {hashlib.sha256(self.password.encode()).hexdigest()}"

    def mark_formatted(self, log_dir: Path) -> None:
        (log_dir / self._MARKER).write_text(self._fingerprint())

    def check_formatted(self, log_dir: Path) -> None:
        """Refuse storage formatted without this admin (or with another password): the
        broker could not log in to itself, nor anyone administer it."""
        if not (log_dir / "meta.properties").is_file():
            return
        marker = log_dir / self._MARKER
        found = marker.read_text().strip() if marker.is_file() else None
        if found == self._fingerprint():
            return
        if found is None:
            why = "without SASL"
        elif found.split()[0] != self.username:
            why = f"with admin {found.split()[0]!r}"
        else:
            why = "with another admin password (were its secrets lost?)"
        raise ServiceError(
            f"the Kafka data in {log_dir} was formatted {why}, so admin {self.username!r} "
            "cannot log in; secured mode needs its own data: remove that directory (its "
            "topics are lost) or use another LANEWAY_DATA_DIR"
        )


class KafkaBroker(_ServerProcess):
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
        result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
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
                brokers = _run_sync(_metadata_brokers(self.bootstrap, self.auth))
            except Exception as exc:  # noqa: BLE001 - any failure here means "not ready yet"
                return False, f"{type(exc).__name__}: {exc}"
            finally:
                gc.collect()
        if len(brokers) < self.expected_brokers:
            return False, f"metadata lists {len(brokers)} of {self.expected_brokers} brokers"
        return True, ""


class KafkaCluster(_StartedInside):
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


async def _metadata_brokers(bootstrap: str, auth: dict[str, Any]) -> list[Any]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **auth)
    try:
        await admin.start()
        cluster = await admin.describe_cluster()
    finally:
        await admin.close()
    brokers: list[Any] = cluster["brokers"]
    return brokers


@dataclass(frozen=True)
class RedisUser:
    """A Redis ACL user: a service (its keys and channels under laneway's prefix, no admin
    or dangerous commands) or, with ``admin``, the operator's (everything)."""

    name: str
    password: str = field(repr=False)
    prefix: str = "laneway"
    admin: bool = False

    def acl_line(self) -> str:
        # Only the password's SHA-256 is stored in the file.
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        if self.admin:
            rules = "~* &* +@all"
        else:
            rules = f"~{self.prefix}:* &{self.prefix}:* +@all -@admin -@dangerous"
        return f"user {self.name} on #{digest} {rules}"


def redis_acl_file(users: Sequence[RedisUser]) -> str:
    """A Redis ACL file: ``users`` and the default user off."""
    # Spelt out: a file that left the default user out would leave it on, with no password.
    lines = ["user default off resetpass resetkeys resetchannels -@all"]
    return "".join(line + "\n" for line in lines + [user.acl_line() for user in users])


class RedisServer(_ServerProcess):
    """A Redis bound to 127.0.0.1: throwaway, or ``persistent`` (an append-only file in
    ``data_dir``, so API keys, team records and quota buckets outlive a crash and a restart).

    ``maxmemory`` bounds it with policy ``noeviction``: full, it refuses writes (an error
    laneway reports) rather than silently forget a quota bucket or a key (docs/security.md).
    """

    name = "redis"
    port_setting = "LANEWAY_REDIS_PORT"
    cmdline_marker = b"redis-server"

    def __init__(
        self,
        *,
        port: int,
        data_dir: Path,
        persistent: bool = False,
        maxmemory: str = "1gb",
        users: Sequence[RedisUser] = (),
    ) -> None:
        super().__init__(port=port, data_dir=data_dir)
        self.persistent = persistent
        self.maxmemory = maxmemory
        self.url = f"redis://127.0.0.1:{port}/0"
        # Secured mode: these ACL users, the default user off (no password, no access).
        self.users = tuple(users)

    def url_of(self, user: RedisUser) -> str:
        """The Redis URL that logs in as ``user``."""
        return f"redis://{quote(user.name)}:{quote(user.password, safe='')}@127.0.0.1:{self.port}/0"

    def _acl_file(self) -> Path:
        path = self.data_dir / "users.acl"
        path.touch()
        path.chmod(0o600)
        path.write_text(redis_acl_file(self.users))
        return path

    def start(self, timeout: float = 20.0) -> None:
        """Start redis-server and wait until it answers PING."""
        if self.running:
            return
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).is_file():
            raise ServiceError("redis-server is not installed: apt-get install redis-server")
        self._check_port_free(self.port, "Redis")
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.data_dir),
            "save": "",
            # Every write is on disk within a second: a killed server loses at most that.
            "appendonly": "yes" if self.persistent else "no",
            "appendfsync": "everysec",
            "maxmemory": self.maxmemory,
            "maxmemory-policy": "noeviction",
            "daemonize": "no",
            "logfile": "",  # stdout, i.e. redis.log, next to any start-up error
        }
        if self.users:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            options["aclfile"] = str(self._acl_file())
        self._spawn(
            [binary, *(arg for key, value in options.items() for arg in (f"--{key}", value))]
        )
        self._wait_ready(timeout)

    def _probe(self) -> tuple[bool, str]:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
        except OSError as exc:
            return False, str(exc)
        # With ACL users a PING without AUTH is refused, by a server that is up all the same.
        ready = reply.startswith((b"+PONG", b"-NOAUTH"))
        return ready, reply.decode(errors="replace").strip()


def create_topics(
    bootstrap: str,
    specs: Sequence[tuple[str, int, dict[str, str]]],
    replication: int = 1,
    auth: dict[str, Any] | None = None,
) -> None:
    """Create the topics in ``specs`` (name, partitions, config) that do not exist yet;
    ``auth``: SASL options of a principal allowed to (laneway.clients.kafka_auth).

    Synchronous (runs its own event loop): call it from set-up code, not from a coroutine.
    """
    _run_sync(_create_topics(bootstrap, specs, replication, auth or {}))


async def create_topics_async(
    settings: CommonSettings,
    specs: Sequence[tuple[str, int, dict[str, str]]],
    replication: int = 1,
) -> None:
    """``create_topics`` from a coroutine, as the settings' principal."""
    await _create_topics(settings.kafka_bootstrap, specs, replication, kafka_auth(settings))


async def _create_topics(
    bootstrap: str,
    specs: Sequence[tuple[str, int, dict[str, str]]],
    replication: int,
    auth: dict[str, Any],
) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **auth)
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(name, partitions, replication, topic_configs=dict(config))
            for name, partitions, config in specs
            if name not in existing
        ]
        if not wanted:
            return
        response = await admin.create_topics(wanted)
        failures = [
            f"{item['topic']}: error {item['error_code']} {item.get('error_message') or ''}".strip()
            for item in response.to_object()["topic_errors"]
            if item["error_code"] not in (0, TopicAlreadyExistsError.errno)
        ]
        if failures:
            raise ServiceError(f"could not create topics on {bootstrap}: " + "; ".join(failures))
        # Clients that start right away would otherwise log NotLeaderForPartition and retry.
        await _wait_for_leaders(admin, [topic.name for topic in wanted])
    finally:
        await admin.close()
    log.info("created topics %s", ", ".join(topic.name for topic in wanted))


async def _wait_for_leaders(
    admin: AIOKafkaAdminClient, names: list[str], within_s: float = 15.0
) -> None:
    deadline = time.monotonic() + within_s
    while True:
        described = await admin.describe_topics(names)
        leaderless = [
            topic["topic"]
            for topic in described
            if topic.get("error_code")
            or not topic["partitions"]
            or any(p["leader"] < 0 for p in topic["partitions"])
        ]
        if not leaderless:
            return
        if time.monotonic() > deadline:
            raise ServiceError(f"topics without a partition leader after {within_s}s: {leaderless}")
        await asyncio.sleep(0.05)
