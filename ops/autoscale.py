"""``laneway up``'s local autoscaler: a pool's worker processes follow its scaling signal.

The pool's lead worker writes the signal (``ScalingDecision``, see ``workers.scaling``) to
Redis at each heartbeat; this loop reads it and starts or stops the pool's standby worker
processes so that as many run as it asks, within the pool's local minimum and maximum
(``LANEWAY_LOCAL_REPLICAS``). It is what KEDA or the HPA do on Kubernetes, on one machine.
A worker it stops is then removed from its consumer group by its id: a static member does
not leave by itself, and its partitions would wait for the session timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.constants import RedisKeys, RequestClass, Topics
from laneway.errors import MalformedMessage, ServiceError
from laneway.schema import ScalingDecision, decode
from ops.group_members import GroupMembers
from ops.supervisor import Supervisor
from ops.supervisor_metrics import SupervisorMetrics

__all__ = ["LocalAutoscaler"]

log = logging.getLogger(__name__)


class LocalAutoscaler:
    """Starts and stops standby worker processes of each pool as its signal asks.

    ``replicas`` maps a pool to its worker process names in start order: the first
    ``minimum[pool]`` always run, the rest are the supervisor's standby processes.
    ``worker_ids`` names each process's worker id (its static group membership).
    """

    def __init__(
        self,
        supervisor: Supervisor,
        redis: aioredis.Redis,
        keys: RedisKeys,
        replicas: Mapping[RequestClass, Sequence[str]],
        minimum: Mapping[RequestClass, int],
        *,
        groups: GroupMembers,
        topics: Topics,
        worker_ids: Mapping[str, str],
        interval_s: float,
        metrics: SupervisorMetrics,
    ) -> None:
        self.supervisor = supervisor
        self.redis = redis
        self.keys = keys
        self.replicas = {pool: list(names) for pool, names in replicas.items()}
        self.minimum = dict(minimum)
        self.groups = groups
        self.topics = topics
        self.worker_ids = dict(worker_ids)
        self.interval_s = interval_s
        self.metrics = metrics

    def running(self, pool: RequestClass) -> list[str]:
        return [n for n in self.replicas[pool] if not self.supervisor.is_parked(n)]

    async def run(self, ready: asyncio.Event) -> None:
        """Once ``ready`` (the stack is up), adjust every pool each interval until cancelled."""
        for pool in self.replicas:
            self.metrics.replicas.labels(pool).set(len(self.running(pool)))
        await ready.wait()
        while True:
            for pool in self.replicas:
                await self.adjust(pool)
            await asyncio.sleep(self.interval_s)

    async def adjust(self, pool: RequestClass) -> int:
        """Start or stop ``pool``'s workers to match its signal; the count now running."""
        names = self.replicas[pool]
        running = self.running(pool)
        desired = await self._desired(pool)
        target = len(running) if desired is None else desired
        target = min(max(target, self.minimum.get(pool, 1)), len(names))
        self.metrics.desired.labels(pool).set(target)
        if target > len(running):
            for name in [n for n in names if n not in running][: target - len(running)]:
                await self._activate(name)
        elif target < len(running):
            # The newest go first: the first ones are the pool's minimum.
            stopped = []
            for name in list(reversed(running))[: len(running) - target]:
                if await self.supervisor.park(name):
                    stopped.append(self.worker_ids[name])
            if stopped:
                await self._leave_group(pool, stopped)
        count = len(self.running(pool))
        self.metrics.replicas.labels(pool).set(count)
        if count != len(running):
            log.warning("pool %s: %d → %d worker processes (signal: %s)", pool, len(running),
                        count, desired)  # fmt: skip
        return count

    async def _activate(self, name: str) -> None:
        try:
            await self.supervisor.activate(name)
        except Exception as exc:  # noqa: BLE001 - a start may raise anything; it is said
            # Any failed start (a full disk, a Python that went away): the process stays a
            # standby and the next look tries again. Raised, it ended the autoscaler for
            # good, and no pool followed its signal any more.
            said = str(exc) if isinstance(exc, (OSError, ServiceError)) else repr(exc)
            log.warning("%s could not be started (%s); trying again at the next look", name, said)

    async def _leave_group(self, pool: RequestClass, worker_ids: list[str]) -> None:
        group = self.topics.consumer_group(pool)
        try:
            removed = await self.groups.remove(group, worker_ids)
        except (KafkaError, OSError) as exc:
            log.warning(
                "%s stopped but still in %s (%s): their partitions move on after the "
                "session timeout",
                ", ".join(worker_ids),
                group,
                exc,
            )
            return
        if removed:
            log.info("removed %s from %s: partitions move on now", ", ".join(removed), group)

    async def _desired(self, pool: RequestClass) -> int | None:
        """The pool's signal, or None while there is none fresh (keep what runs)."""
        try:
            raw = await self.redis.get(self.keys.scaling(pool))
        except (RedisError, OSError) as exc:
            log.info("pool %s: scaling signal unreadable (%s); keeping its workers", pool, exc)
            return None
        if raw is None:
            return None
        try:
            return decode(ScalingDecision, raw).desired
        except MalformedMessage as exc:
            log.warning("pool %s: ignoring its scaling signal: %s", pool, exc)
            return None
