"""What ``laneway up`` runs: Redis, Kafka, the ingress, the workers of each pool and the
streams app, each supervised (restarted when it dies), in the foreground until Ctrl-C. A
pool's workers above its minimum are standby processes that the local autoscaler starts and
stops by the pool's scaling signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import redis.asyncio as aioredis

from laneway.constants import POOLS
from laneway.errors import ConfigError, ServiceError
from ops.autoscale import LocalAutoscaler
from ops.data_dir_lock import claimed
from ops.devstack import port_in_use
from ops.group_members import GroupMembers
from ops.leftovers import stop_grace_s, stop_leftovers
from ops.redis_server import RedisServer
from ops.restart_policy import RestartPolicy
from ops.secured_stack import StackSecrets, stack_secrets
from ops.settings import StackSettings
from ops.stack_processes import (
    ingress_host,
    pool_replicas,
    stack_processes,
    standby_processes,
    worker_ids,
)
from ops.supervised import Supervised
from ops.supervisor import Supervisor
from ops.supervisor_metrics import ServiceMetrics, SupervisorMetrics

__all__ = ["run_local_stack"]


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
    host = ingress_host()
    metrics = SupervisorMetrics()
    supervisor = Supervisor(
        processes,
        RestartPolicy.from_settings(settings),
        metrics=metrics,
        standby=standby_processes(settings),
        grace_s=grace_s,
        hang_timeout_s=settings.hang_timeout_s,
    )
    metrics.registry.register(
        ServiceMetrics(
            lambda: [
                (process.name, process.metrics_url)
                for process in processes
                if process.metrics_url is not None and supervisor.is_up(process.name)
            ]
        )
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
