"""What ``laneway up`` runs: Redis, Kafka, the ingress, the workers of each pool and the
streams app, each supervised (restarted when it dies), in the foreground until Ctrl-C. A
pool's workers above its minimum are standby processes that the local autoscaler starts and
stops by the pool's scaling signal."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import redis.asyncio as aioredis

from ingress.settings import IngressSettings
from laneway.constants import POOLS, RequestClass
from laneway.errors import ConfigError, ServiceError
from laneway.settings import CommonSettings, load_settings
from ops.autoscale import LocalAutoscaler
from ops.devstack import port_in_use
from ops.group_members import GroupMembers
from ops.kafka_broker import KafkaBroker
from ops.kafka_topics import create_topics
from ops.redis_server import RedisServer
from ops.restart_policy import RestartPolicy
from ops.secured_stack import StackSecrets
from ops.settings import StackSettings
from ops.supervised import (
    LocalServer,
    ServiceProcess,
    Supervised,
    prefixed_echo,
    stray_services,
)
from ops.supervisor import Supervisor
from ops.supervisor_metrics import SupervisorMetrics
from streams.settings import StreamsSettings
from workers.settings import WorkerSettings

__all__ = [
    "pool_replicas",
    "run_local_stack",
    "stack_processes",
    "standby_processes",
    "stop_grace_s",
    "stop_leftovers",
]

log = logging.getLogger(__name__)

# Settings of `laneway up` itself; the services it starts do not get them (LANEWAY_PORT goes
# to the ingress alone).
_STACK_ONLY = {
    f"LANEWAY_{name.upper()}"
    for name in set(StackSettings.model_fields) - set(CommonSettings.model_fields)
}
# How to log in to a Kafka: they go with its address, which the stack sets to its own broker.
# From the shell (a secured stack's admin.env sourced earlier, a remote cluster's login),
# they made every service try a login the stack's broker does not take; a secured stack sets
# each service's own (``secured.service_env``).
_BROKER_LOGIN = {
    f"LANEWAY_{name.upper()}"
    for name in CommonSettings.model_fields
    if name.startswith("kafka_") and name != "kafka_bootstrap"
}
# A stopping process gets at least this long after its SIGTERM before it is killed.
_SHORTEST_STOP_GRACE_S = 15.0
# What a stopping worker does after its drain (LANEWAY_DRAIN_GRACE_S): its last commit
# (bounded at 10 s), then it closes its Kafka and Redis clients and its engine.
_AFTER_DRAIN_S = 15.0


def pool_replicas(settings: StackSettings) -> dict[RequestClass, list[str]]:
    """Each pool's worker process names, in start order (the first is ``worker-<pool>``)."""
    return {
        pool: [f"worker-{pool}"]
        + [f"worker-{pool}-{i}" for i in range(2, settings.replicas_of(pool)[1] + 1)]
        for pool in POOLS
    }


def worker_ids(settings: StackSettings) -> dict[str, str]:
    """The worker id (static group membership) of each worker process: <pool>-<n>."""
    return {
        name: f"{pool}-{i}"
        for pool, names in pool_replicas(settings).items()
        for i, name in enumerate(names, start=1)
    }


def standby_processes(settings: StackSettings) -> list[str]:
    """Worker processes above each pool's minimum: started only when its signal asks."""
    return [
        name
        for pool, names in pool_replicas(settings).items()
        for name in names[settings.replicas_of(pool)[0] :]
    ]


def stack_secrets(settings: StackSettings) -> StackSecrets | None:
    """The secured mode's passwords (generated on first use), or None when it is off."""
    if not settings.secured:
        return None
    return StackSecrets.load_or_create(Path(settings.data_dir).resolve() / "secrets")


def stack_processes(
    settings: StackSettings, secured: StackSecrets | None = None
) -> list[Supervised]:
    """The processes of the stack in start order, servers first."""
    data = Path(settings.data_dir).resolve()
    redis = RedisServer(
        port=settings.redis_port,
        data_dir=data / "redis",
        persistent=True,
        users=secured.redis_users(settings.redis_prefix) if secured else (),
        maxmemory=settings.redis_maxmemory,
    )
    kafka = KafkaBroker(
        port=settings.kafka_port,
        data_dir=data / "kafka",
        heap_mb=settings.kafka_heap_mb,
        partitions=settings.partitions,
        admin=secured.kafka_admin if secured else None,
    )
    specs = settings.topics.specs(settings.partitions)
    env = {k: v for k, v in os.environ.items() if k.upper() not in _STACK_ONLY | _BROKER_LOGIN}
    env.update(LANEWAY_KAFKA_BOOTSTRAP=kafka.bootstrap, LANEWAY_REDIS_URL=redis.url)

    def login(service: str, pool: str = "") -> dict[str, str]:
        # Secured: each service logs in as its own Kafka principal and Redis user.
        return secured.service_env(service, redis, pool) if secured else {}

    def kafka_ready() -> None:
        create_topics(kafka.bootstrap, specs, auth=kafka.auth)
        if secured:
            secured.ensure_principals(settings, kafka)
            secured.write_admin_env(kafka, redis)

    # (name, module run as `python -m`, its own settings)
    services = [("ingress", "ingress", {"LANEWAY_PORT": str(settings.port), **login("ingress")})]
    ids = worker_ids(settings)
    for pool, names in pool_replicas(settings).items():
        low, high = settings.replicas_of(pool)
        for name in names:
            # A fixed worker id: a restarted worker takes its partitions straight back
            # (static group membership) and serves what was accepted while it was down.
            worker = {
                "LANEWAY_POOL": pool,
                "LANEWAY_WORKER_ID": ids[name],
                # The signal asks for no more than the stack will run.
                "LANEWAY_SCALE_MIN_REPLICAS": str(low),
                "LANEWAY_SCALE_MAX_REPLICAS": str(high),
                **login("worker", pool),
            }
            services.append((name, "workers", worker))
    services.append(
        (
            "streams",
            "streams",
            {"LANEWAY_STREAMS_DATA_DIR": str(data / "streams"), **login("streams")},
        )
    )
    _check_services(services, env)
    width = max(len(name) for name, _, _ in services)
    processes: list[Supervised] = [
        LocalServer(redis),
        LocalServer(kafka, on_ready=kafka_ready),
    ]
    for name, module, extra in services:
        processes.append(
            ServiceProcess(
                name,
                [sys.executable, "-m", module],
                {**env, **extra},
                log_dir=data / "logs",
                needs=(redis.name, kafka.name),
                echo=prefixed_echo(name, width),
                # Stopped first: it finishes its open requests (up to 10 s) while the workers
                # that answer them still run.
                front=module == "ingress",
                watchdog=True,
            )
        )
    return processes


@contextlib.contextmanager
def claimed(data: Path) -> Iterator[None]:
    """``data`` as this process's alone while inside: a second ``laneway up`` on the same data
    dir is refused, naming the first (a lock the kernel lets go when its holder dies, however
    it dies)."""
    try:
        data.mkdir(parents=True, exist_ok=True)
        lock_file = (data / "up.pid").open("a+")
    except OSError as exc:
        why = "it is not a directory" if data.exists() and not data.is_dir() else exc.strerror
        raise ConfigError(
            f"LANEWAY_DATA_DIR: {data} cannot hold the stack's data and logs ({why}); set "
            "LANEWAY_DATA_DIR to a directory laneway may create and write"
        ) from None
    with lock_file as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                # A filesystem without locks (some FUSE and NFS mounts): run unguarded.
                log.warning(
                    "%s cannot be locked (%s): a second laneway up there is not told",
                    lock.name,
                    exc.strerror,
                )
                yield
                return
            lock.seek(0)
            pid = lock.read().strip() or "unknown"
            raise ServiceError(
                f"laneway is already running on {data} (pid {pid}): Ctrl-C in its terminal, or "
                f"kill -INT {pid}, stops it; a second stack beside it needs a LANEWAY_DATA_DIR "
                "and ports of its own (LANEWAY_PORT, LANEWAY_KAFKA_PORT, LANEWAY_REDIS_PORT, "
                "LANEWAY_SUPERVISOR_PORT)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield


def _ingress_host() -> str:
    """Where the ingress can be reached on this machine (LANEWAY_HOST; any address: here)."""
    host = load_settings(IngressSettings).host
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # noqa: S104 - compared, not bound


def _check_ingress_port_set(port: int) -> None:
    if not port:
        raise ConfigError(
            "LANEWAY_PORT=0: `laneway up` needs a fixed ingress port (it tells you where the "
            "API is, and the CLI finds the stack by it); set LANEWAY_PORT, e.g. 8000"
        )


def _check_ingress_port(port: int) -> None:
    """Before anything starts: the ingress would fail on a taken port only once Kafka and
    Redis are up, and another server answering there would look like laneway."""
    if port_in_use(port):
        raise ServiceError(
            f"the ingress port {port} is already in use; set LANEWAY_PORT to a free port or "
            "stop whatever listens there"
        )


async def _accepting(host: str, port: int) -> None:
    """Until something accepts connections on ``host``:``port`` (uvicorn listens once the
    ingress has started)."""
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.2)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


def stop_leftovers(
    processes: Sequence[Supervised], log_dir: Path, grace_s: float = _SHORTEST_STOP_GRACE_S
) -> None:
    """What an earlier ``laneway up`` on the same data dir left running when it was killed
    (each child runs in a process group of its own, so a SIGKILL of the supervisor leaves
    them): stopped before anything starts, services before the servers they need, as its
    Ctrl-C would have. Only a process its pid file names and whose command line matches:
    one of ``processes``, or any laneway service with a pid file in ``log_dir`` (a worker
    replica the earlier stack ran and this one does not)."""
    left = {p.name: pid for p in processes if (pid := p.leftover_pid()) is not None}
    strays = stray_services(log_dir, {p.name for p in processes})
    left.update(strays)
    if not left:
        return
    log.warning(
        "an earlier laneway up here was killed and left %s running: stopping them first",
        ", ".join(f"{name} (pid {pid})" for name, pid in left.items()),
    )
    needed = {need for p in processes for need in p.needs}
    for wave in ([n for n in left if n not in needed], [n for n in left if n in needed]):
        for name in wave:
            with contextlib.suppress(ProcessLookupError):
                os.kill(left[name], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(process_runs(left[n]) for n in wave):
            time.sleep(0.1)
        for name in wave:
            if process_runs(left[name]):
                log.warning("%s (pid %d) ignored SIGTERM; killing it", name, left[name])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(left[name], signal.SIGKILL)
    for name in strays:  # no process of this stack goes by that name to remove it
        with contextlib.suppress(OSError):
            (log_dir / f"{name}.pid").unlink()


def stop_grace_s() -> float:
    """How long a stopping process gets after its SIGTERM before it is killed: enough for a
    worker's drain (LANEWAY_DRAIN_GRACE_S) and what follows it, and at least 15 s."""
    drain = load_settings(WorkerSettings).drain_grace_s
    return max(_SHORTEST_STOP_GRACE_S, drain + _AFTER_DRAIN_S)


def process_runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def run_local_stack(settings: StackSettings) -> None:
    """Run the stack until SIGINT/SIGTERM (twice: kill at once); raises ``CrashLoop``."""
    # What the supervisor does (starts, exits, restarts) is worth a line in the terminal.
    for name in ("laneway", "ops"):  # the supervisor and the autoscaler live in ops/
        logging.getLogger(name).setLevel(logging.INFO)
    _check_ingress_port_set(settings.port)
    data = Path(settings.data_dir).resolve()
    with claimed(data):
        secured = stack_secrets(settings)
        processes = stack_processes(settings, secured)
        grace_s = stop_grace_s()
        stop_leftovers(processes, data / "logs", grace_s)
        _check_ingress_port(settings.port)
        _run_local_stack(settings, secured, processes, grace_s)


def _run_local_stack(
    settings: StackSettings,
    secured: StackSecrets | None,
    processes: list[Supervised],
    grace_s: float,
) -> None:
    host = _ingress_host()
    metrics = SupervisorMetrics()
    supervisor = Supervisor(
        processes,
        RestartPolicy.from_settings(settings),
        metrics=metrics,
        standby=standby_processes(settings),
        grace_s=grace_s,
        hang_timeout_s=settings.hang_timeout_s,
    )
    close_metrics = metrics.serve(settings.supervisor_port) if settings.supervisor_port else None
    data = Path(settings.data_dir).resolve()

    ready = asyncio.Event()
    announcing: list[asyncio.Task[None]] = []

    def started() -> None:
        ready.set()
        announcing.append(asyncio.create_task(announce(), name="announce"))

    async def announce() -> None:
        # Once the ingress takes connections: a request sent on this line must not be refused.
        await _accepting(host, settings.port)
        if supervisor.stopping:
            return
        print(  # noqa: T201 - the one line a user waits for
            f"laneway is up: OpenAI base URL http://{host}:{settings.port}/v1 "
            "(create a key: .venv/bin/laneway keys create --team myteam). Ctrl-C stops.\n"
            + (
                f"Secured: the operator's Kafka and Redis logins are in {secured.directory}/"
                "admin.env (set -a; . that file; set +a before laneway keys|teams|principals)\n"
                if secured
                else ""
            )
            + f"Logs: {data / 'logs'}; restarts and what is down: "
            + (
                f"http://127.0.0.1:{settings.supervisor_port}/metrics"
                if settings.supervisor_port
                else "LANEWAY_SUPERVISOR_PORT=0, not served"
            ),
            flush=True,
        )

    async def supervise() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, supervisor.request_stop)
        # The autoscaler acts as the operator: the Kafka admin and Redis's operator user.
        local_redis = RedisServer(port=settings.redis_port, data_dir=data / "redis")
        groups = GroupMembers(
            f"127.0.0.1:{settings.kafka_port}", **(secured.kafka_admin.auth if secured else {})
        )
        redis = aioredis.Redis.from_url(
            secured.operator_redis_url(local_redis) if secured else local_redis.url,
            socket_timeout=5.0,
        )
        autoscaler = LocalAutoscaler(
            supervisor,
            redis,
            settings.keys,
            pool_replicas(settings),
            {pool: settings.replicas_of(pool)[0] for pool in POOLS},
            groups=groups,
            topics=settings.topics,
            worker_ids=worker_ids(settings),
            interval_s=settings.autoscale_interval_s,
            metrics=metrics,
        )
        scaling = asyncio.create_task(autoscaler.run(ready), name="autoscaler")
        try:
            await supervisor.run(on_started=started)
        finally:
            for task in (scaling, *announcing):
                task.cancel()
            await asyncio.gather(*announcing, return_exceptions=True)  # a line, nothing more
            with contextlib.suppress(asyncio.CancelledError):
                await scaling
            await redis.aclose()
            await groups.stop()

    try:
        asyncio.run(supervise())
    finally:
        if close_metrics is not None:
            close_metrics()


_SETTINGS_OF: dict[str, type[CommonSettings]] = {
    "ingress": IngressSettings,
    "workers": WorkerSettings,
    "streams": StreamsSettings,
}


def _check_services(services: list[tuple[str, str, dict[str, str]]], env: dict[str, str]) -> None:
    """Each service's settings as it will be started: one it would refuse stops ``laneway up``
    now, naming it, instead of after Kafka and Redis started, as a crash loop."""
    if env.get("LANEWAY_METRICS_PORT", "0") not in ("", "0"):
        raise ConfigError(
            f"LANEWAY_METRICS_PORT={env['LANEWAY_METRICS_PORT']}: under `laneway up` every "
            "worker and the streams app would serve /metrics on that one port (all but one "
            "failing); leave it unset: LANEWAY_SUPERVISOR_PORT serves the stack's /metrics"
        )
    checked: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for name, module, extra in services:
        own = {k.removeprefix("LANEWAY_").lower(): v for k, v in extra.items()}
        key = (module, tuple(sorted((k, v) for k, v in own.items() if k != "worker_id")))
        if key in checked:
            continue
        checked.add(key)
        try:
            load_settings(_SETTINGS_OF[module], **own)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
