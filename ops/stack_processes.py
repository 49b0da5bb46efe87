"""The processes ``laneway up`` runs, in start order, and what each is started with: its
name, a worker's pool and id, and an environment checked before anything starts."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from ingress.settings import IngressSettings
from laneway.constants import POOLS, RequestClass
from laneway.errors import ConfigError
from laneway.settings import CommonSettings, load_settings
from ops.kafka_broker import KafkaBroker
from ops.kafka_topics import create_topics
from ops.redis_server import RedisServer
from ops.secured_stack import StackSecrets
from ops.settings import StackSettings
from ops.supervised import LocalServer, ServiceProcess, Supervised, prefixed_echo
from streams.settings import StreamsSettings
from workers.settings import WorkerSettings

__all__ = ["ingress_host", "pool_replicas", "stack_processes", "standby_processes", "worker_ids"]

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


def ingress_host() -> str:
    """Where the ingress can be reached on this machine (LANEWAY_HOST; any address: here)."""
    host = load_settings(IngressSettings).host
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # noqa: S104 - compared, not bound


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
    own = {"LANEWAY_KAFKA_BOOTSTRAP": kafka.bootstrap, "LANEWAY_REDIS_URL": redis.url}
    for variable, address in own.items():
        if env.get(variable, address) != address:
            # The value is not shown: a Redis URL may hold a password.
            log.warning(
                "%s is set in this shell, but laneway up runs its services on its own %s "
                "(the CLI in this shell still reaches the one the variable names)",
                variable,
                "Kafka" if "KAFKA" in variable else "Redis",
            )
    env.update(own)

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
    _check_services(services, env, settings.partitions)
    width = max(len(name) for name, _, _ in services)
    processes: list[Supervised] = [
        LocalServer(redis),
        LocalServer(kafka, on_ready=kafka_ready),
    ]
    # With the supervisor's /metrics on, it serves every service's too: the ingress's from its
    # own port, the others' from a port each run is given.
    metrics = bool(settings.supervisor_port)
    for name, module, extra in services:
        ingress = module == "ingress"
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
                front=ingress,
                watchdog=True,
                metrics_url=(
                    f"http://{ingress_host()}:{settings.port}/metrics"
                    if metrics and ingress
                    else None
                ),
                serve_metrics=metrics and not ingress,
            )
        )
    return processes


_SETTINGS_OF: dict[str, type[CommonSettings]] = {
    "ingress": IngressSettings,
    "workers": WorkerSettings,
    "streams": StreamsSettings,
}


def _check_services(
    services: list[tuple[str, str, dict[str, str]]], env: dict[str, str], partitions: int
) -> None:
    """Each service's settings as it will be started: one it would refuse stops ``laneway up``
    now, naming it, instead of after Kafka and Redis started, as a crash loop."""
    if env.get("LANEWAY_METRICS_PORT", "0") not in ("", "0"):
        raise ConfigError(
            f"LANEWAY_METRICS_PORT={env['LANEWAY_METRICS_PORT']}: under `laneway up` every "
            "worker and the streams app would serve /metrics on that one port (all but one "
            "failing); leave it unset: LANEWAY_SUPERVISOR_PORT's /metrics serves every "
            "process's series, each labelled with its process"
        )
    checked: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for name, module, extra in services:
        own = {k.removeprefix("LANEWAY_").lower(): v for k, v in extra.items()}
        key = (module, tuple(sorted((k, v) for k, v in own.items() if k != "worker_id")))
        if key in checked:
            continue
        checked.add(key)
        try:
            loaded = load_settings(_SETTINGS_OF[module], **own)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if isinstance(loaded, IngressSettings):
            _listenable(loaded.host)
        if isinstance(loaded, StreamsSettings) and loaded.streams_partitions not in (0, partitions):
            raise ConfigError(
                f"{name}: LANEWAY_STREAMS_PARTITIONS={loaded.streams_partitions}, but the "
                f"stack's topics have LANEWAY_PARTITIONS={partitions}: the tables are "
                "partitioned as the usage topic they fold; leave it unset (0: the topic's own)"
            )


def _listenable(host: str) -> None:
    """The ingress's LANEWAY_HOST names an address of this machine's resolver: otherwise the
    ingress exits at once, its server's error ("Name or service not known") naming no
    setting, in a crash loop."""
    try:
        socket.getaddrinfo(host or None, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(
            f"ingress: LANEWAY_HOST={host!r} is not an address the ingress can listen on "
            f"({getattr(exc, 'strerror', None) or exc})"
        ) from None
