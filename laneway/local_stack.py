"""What ``laneway up`` runs: Redis, Kafka, the ingress, a worker per pool and the streams app,
each supervised (restarted when it dies), in the foreground until Ctrl-C."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from laneway.constants import POOLS
from laneway.devstack import KafkaBroker, RedisServer, create_topics
from laneway.settings import CommonSettings, StackSettings
from laneway.supervised import LocalServer, ServiceProcess, Supervised, prefixed_echo
from laneway.supervisor import RestartPolicy, Supervisor, SupervisorMetrics

__all__ = ["run_local_stack", "stack_processes"]

# Settings of `laneway up` itself; the services it starts do not get them (LANEWAY_PORT goes
# to the ingress alone).
_STACK_ONLY = {
    f"LANEWAY_{name.upper()}"
    for name in set(StackSettings.model_fields) - set(CommonSettings.model_fields)
}


def stack_processes(settings: StackSettings) -> list[Supervised]:
    """The processes of the stack in start order, servers first."""
    data = Path(settings.data_dir).resolve()
    redis = RedisServer(port=settings.redis_port, data_dir=data / "redis", persistent=True)
    kafka = KafkaBroker(
        port=settings.kafka_port,
        data_dir=data / "kafka",
        heap_mb=settings.kafka_heap_mb,
        partitions=settings.partitions,
    )
    specs = settings.topics.specs(settings.partitions)
    env = {k: v for k, v in os.environ.items() if k.upper() not in _STACK_ONLY}
    env.update(LANEWAY_KAFKA_BOOTSTRAP=kafka.bootstrap, LANEWAY_REDIS_URL=redis.url)
    # (name, module run as `python -m`, its own settings)
    services = [("ingress", "ingress", {"LANEWAY_PORT": str(settings.port)})]
    for pool in POOLS:
        # A fixed worker id: a restarted worker takes its partitions straight back (static
        # group membership) and serves what was accepted while it was down.
        worker = {"LANEWAY_POOL": pool, "LANEWAY_WORKER_ID": f"{pool}-1"}
        services.append((f"worker-{pool}", "workers", worker))
    services.append(("streams", "streams", {"LANEWAY_STREAMS_DATA_DIR": str(data / "streams")}))
    width = max(len(name) for name, _, _ in services)
    processes: list[Supervised] = [
        LocalServer(redis),
        LocalServer(kafka, on_ready=lambda: create_topics(kafka.bootstrap, specs)),
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
            )
        )
    return processes


def run_local_stack(settings: StackSettings) -> None:
    """Run the stack until SIGINT/SIGTERM (twice: kill at once); raises ``CrashLoop``."""
    # What the supervisor does (starts, exits, restarts) is worth a line in the terminal.
    logging.getLogger("laneway").setLevel(logging.INFO)
    metrics = SupervisorMetrics()
    supervisor = Supervisor(
        stack_processes(settings), RestartPolicy.from_settings(settings), metrics=metrics
    )
    close_metrics = metrics.serve(settings.supervisor_port) if settings.supervisor_port else None
    data = Path(settings.data_dir).resolve()

    def started() -> None:
        print(  # noqa: T201 - the one line a user waits for
            f"laneway is up: OpenAI base URL http://127.0.0.1:{settings.port}/v1 "
            "(create a key: .venv/bin/laneway keys create --team myteam). Ctrl-C stops.\n"
            f"Logs: {data / 'logs'}; restarts and what is down: "
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
        await supervisor.run(on_started=started)

    try:
        asyncio.run(supervise())
    finally:
        if close_metrics is not None:
            close_metrics()
