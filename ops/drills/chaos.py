"""The chaos drill (issue 25): nothing lost, nothing twice.

On a topology of its own (``ops.drills.topology``), under steady mixed load
(completions, streamed chats, a running batch job, and a job of another team several
times its batch budget, whose lines wait for it beside the lane through the faults and run
once its budget is raised after them), it SIGKILLs a chat worker and starts it
again under the same worker id, SIGSTOPs a batch worker past its session timeout and
resumes it, kills the broker that leads request and usage partitions (and restarts it),
kills Redis (and restarts it on its append-only file), and kills an ingress, whose clients
go on at the other. Then it counts (``ops.drills.chaos_audit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from aiokafka.errors import KafkaError

from laneway.apikeys import create_key
from laneway.batch import BatchClient
from laneway.clients import make_redis
from laneway.errors import ConfigError, LanewayError
from laneway.settings import CommonSettings
from ops.drills.chaos_audit import (
    ChaosTally,
    accepted_requests,
    batch_lines,
    batch_results,
    batch_tokens_used,
    ids_with_usage,
    read_to_end,
    rollup_requests,
    tally,
    usage_outcomes,
)
from ops.drills.chaos_clients import ChaosClients
from ops.drills.load import OpenLoop
from ops.drills.topology import ChaosTopology, TopologyPlan
from quota.model import QuotaPolicy

__all__ = ["ChaosPlan", "ChaosRun", "run_chaos"]

log = logging.getLogger(__name__)

_TEAM = "chaos"
# A team whose batch budget covers about 90 of its lines (2,000 tokens an hour, a line is
# charged about 23): the rest of its lines wait, parked beside the lane, most of them
# without their bodies (topology: LANEWAY_BATCH_PARKED_BODIES), through every fault.
_LEAN = "chaos-lean"
_TEAMS = (_TEAM, _LEAN)
_LEAN_BUDGET: dict[str, Any] = {"size": 1, "complexity": 0.04, "type_through": False}
_RAISED_BUDGET: dict[str, Any] = {"size": 100_000, "type_through": False}
_FOREVER_S = 24 * 3600.0  # the load runs until it is stopped


@dataclass(frozen=True)
class ChaosPlan:
    """Load and the spacing of the faults (seconds from the start of the load)."""

    completion_rps: float = 6.0
    chat_rps: float = 2.0
    chat_tokens: int = 96
    batch_lines: int = 2400
    lean_lines: int = 600  # the over-budget team's job
    batch_tokens: int = 24
    lead_s: float = 20.0  # load before the first fault
    gap_s: float = 20.0  # load between one fault's end and the next one
    worker_down_s: float = 1.0
    pause_s: float = 15.0  # past the topology's session timeout
    broker_down_s: float = 15.0
    redis_down_s: float = 5.0
    tail_s: float = 30.0  # load after the ingress died
    settle_s: float = 180.0  # after the load: longest wait for the batch job and usage

    def __post_init__(self) -> None:
        for name in ("completion_rps", "chat_rps", "lead_s", "gap_s", "pause_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be above 0")
        for name in ("batch_lines", "lean_lines"):
            if (value := getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, not {value}")

    @classmethod
    def short(cls) -> ChaosPlan:
        """The variant ``make test`` runs: the same faults, closer together, less load."""
        return cls(
            completion_rps=4.0,
            chat_rps=1.5,
            batch_lines=1000,
            lean_lines=300,
            lead_s=5.0,
            gap_s=7.0,
            pause_s=9.0,
            broker_down_s=5.0,
            redis_down_s=2.0,
            tail_s=8.0,
            settle_s=120.0,
        )

    @property
    def load_s(self) -> float:
        """Seconds of load if every restart were instant (they take some more)."""
        faults = self.worker_down_s + self.pause_s + self.broker_down_s + self.redis_down_s
        return self.lead_s + faults + 4 * self.gap_s + self.tail_s


@dataclass
class ChaosRun:
    """What one drill did and counted."""

    plan: ChaosPlan
    events: list[tuple[float, str]] = field(default_factory=list)
    tally: ChaosTally = field(default_factory=ChaosTally)
    job_id: str = ""
    lean_job_id: str = ""  # the over-budget team's
    lean_waited: int | None = None  # its lines still waiting when its budget was raised
    seconds: float = 0.0


async def run_chaos(plan: ChaosPlan, topology_plan: TopologyPlan, data_dir: Path) -> ChaosRun:
    """Start the topology, load it, break it, count, and stop it all."""
    topology = ChaosTopology(topology_plan, data_dir)
    run = ChaosRun(plan, events=topology.events)
    try:
        await topology.start()
        await _drive(plan, topology, run)
    finally:
        await topology.stop()
        run.seconds = topology.now()
    return run


async def _drive(plan: ChaosPlan, topology: ChaosTopology, run: ChaosRun) -> None:
    settings = CommonSettings(
        kafka_bootstrap=topology.kafka.bootstrap, redis_url=topology.redis.url
    )
    first_hour = int(time.time() // 3600)  # Redis's clock, on this machine
    key = await _team_key(settings, topology, _TEAM, {"size": 100_000, "type_through": False})
    await _team_key(settings, topology, _LEAN, _LEAN_BUDGET)
    clients = ChaosClients(
        topology.urls, key, started=topology.started, chat_tokens=plan.chat_tokens
    )
    completions = OpenLoop(clients.completion, started=topology.started, max_open=1024)
    chats = OpenLoop(clients.chat, started=topology.started, max_open=1024)
    killed: dict[int, float] = {}
    try:
        async with BatchClient(settings) as batch:
            # The over-budget job first: its lines are ahead on the partitions, and those
            # its budget does not cover wait from the start.
            run.lean_job_id = await batch.submit(
                _batch_input(plan.lean_lines, plan.batch_tokens),
                team=_LEAN,
                source="chaos drill, over its budget",
            )
            topology.note(
                f"batch job {run.lean_job_id} of team {_LEAN}: {plan.lean_lines} lines "
                "submitted, several times its batch budget"
            )
            run.job_id = await batch.submit(
                _batch_input(plan.batch_lines, plan.batch_tokens), team=_TEAM, source="chaos drill"
            )
            topology.note(f"batch job {run.job_id}: {plan.batch_lines} lines submitted")
            progress = _Progress(batch, {run.job_id: None, run.lean_job_id: _LEAN}, topology)
            # The load goes on until the faults are over and for ``tail_s`` after them,
            # however long the restarts took.
            loads = asyncio.gather(
                completions.run(plan.completion_rps, _FOREVER_S),
                chats.run(plan.chat_rps, _FOREVER_S),
            )
            try:
                await _faults(plan, topology, killed, progress)
                waiting = await progress.waiting(run.lean_job_id)
                await _set_team(topology.urls[-1], topology.admin_key, _LEAN, _RAISED_BUDGET)
                topology.note(f"{_LEAN}'s budget raised: its {waiting} waiting lines may run")
                run.lean_waited = waiting
                await asyncio.sleep(plan.tail_s)
            finally:
                loads.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loads
            topology.note(f"load stopped: {completions.sent} completions, {chats.sent} chats sent")
            await asyncio.gather(completions.drain(90.0), chats.drain(90.0))
            await _settle(plan, topology, batch, [run.job_id, run.lean_job_id])
        run.tally = await _count(topology, clients, killed, [run.job_id, run.lean_job_id])
        hours = range(first_hour, int(time.time() // 3600) + 1)
        run.tally.batch_tokens_charged = await _charged(settings, _TEAMS, hours)
    finally:
        await clients.aclose()


async def _team_key(
    settings: CommonSettings, topology: ChaosTopology, team: str, record: dict[str, Any]
) -> str:
    """A key of ``team``, whose record (its budget) is set through the admin API."""
    redis = make_redis(settings)
    try:
        key = await create_key(redis, settings.keys, team)
    finally:
        await redis.aclose()
    await _set_team(topology.urls[0], topology.admin_key, team, record)
    return key


async def _set_team(url: str, admin_key: str, team: str, record: dict[str, Any]) -> None:
    async with httpx.AsyncClient(timeout=10.0) as http:
        response = await http.put(
            f"{url}/admin/teams/{team}",
            json=record,
            headers={"Authorization": f"Bearer {admin_key}"},
        )
    if response.status_code != 200:
        raise LanewayError(f"could not set up team {team}: {response.text}")


def _batch_input(lines: int, max_tokens: int) -> list[str]:
    """OpenAI Batch input lines: completions of prompts of their own."""
    return [
        orjson.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": "laneway-code",
                    "prompt": f"# batch line {i}\ndef job_{i}():",
                    "max_tokens": max_tokens,
                },
            }
        ).decode()
        for i in range(lines)
    ]


class _Progress:
    """Notes how far the batch jobs are: proof that they run, or wait, while the faults
    happen. ``jobs``: job id → the team whose batch pool the note shows too (None: not)."""

    def __init__(
        self, batch: BatchClient, jobs: dict[str, str | None], topology: ChaosTopology
    ) -> None:
        self.batch, self.jobs, self.topology = batch, jobs, topology

    async def note(self) -> None:
        for job, team in self.jobs.items():
            named = f" ({team})" if team else ""
            try:
                status = await self.batch.status(job)
            except (LanewayError, KafkaError) as exc:
                self.topology.note(f"batch job{named} progress unreadable: {exc}")
                continue
            pool = f"; {await self._pool(team)}" if team else ""
            self.topology.note(f"batch job{named}: {status.done}/{status.lines} lines done{pool}")

    async def _pool(self, team: str) -> str:
        """The team's batch pool, as the admin API shows it (at an ingress still up)."""
        try:
            async with httpx.AsyncClient(timeout=5.0) as http:
                response = await http.get(
                    f"{self.topology.urls[-1]}/admin/teams/{team}",
                    headers={"Authorization": f"Bearer {self.topology.admin_key}"},
                )
            response.raise_for_status()
            pool = response.json()["pools"]["batch"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            return f"its batch pool unreadable ({exc!r})"
        return (
            f"its batch pool: {pool['remaining_tokens']} of {pool['budget_tokens_per_hour']} "
            f"tokens left, {pool['used_tokens_this_hour']} used this hour, "
            f"{pool['reservations']} reservations ({pool['reserved_tokens']} tokens)"
        )

    async def waiting(self, job: str) -> int | None:
        """Lines of ``job`` not answered yet (None: unreadable)."""
        try:
            status = await self.batch.status(job)
        except (LanewayError, KafkaError):
            return None
        return status.lines - status.done


async def _faults(
    plan: ChaosPlan, topology: ChaosTopology, killed: dict[int, float], progress: _Progress
) -> None:
    """The faults, one after another, while the load runs."""
    await asyncio.sleep(plan.lead_s)

    await progress.note()
    chat = await topology.busiest("chat")
    await topology.kill(chat)
    topology.note(f"SIGKILL {chat} (the chat worker holding the most requests)")
    await asyncio.sleep(plan.worker_down_s)
    await topology.restart(chat)
    topology.note(f"{chat} started again with the same LANEWAY_WORKER_ID")
    await asyncio.sleep(plan.gap_s)

    await progress.note()
    batch = await topology.busiest("batch")
    topology.pause(batch)
    topology.note(f"SIGSTOP {batch} for {plan.pause_s:g} s (past its session timeout)")
    await asyncio.sleep(plan.pause_s)
    topology.resume(batch)
    topology.note(f"SIGCONT {batch}")
    await asyncio.sleep(plan.gap_s)

    await progress.note()
    leaders = await topology.leaders()
    node = max(leaders, key=lambda n: (min(leaders[n]) > 0, sum(leaders[n])))
    requests, usage = leaders[node]
    await asyncio.to_thread(topology.kafka.kill, node)
    topology.note(
        f"SIGKILL broker {node} (leader of {requests} request and {usage} usage partitions)"
    )
    await asyncio.sleep(plan.broker_down_s)
    await asyncio.to_thread(topology.kafka.restart, node)
    topology.note(f"broker {node} started again and serving")
    await asyncio.sleep(plan.gap_s)

    await progress.note()
    topology.redis.send_signal(signal.SIGKILL)
    await asyncio.to_thread(topology.redis.stop)
    topology.note("SIGKILL Redis")
    await asyncio.sleep(plan.redis_down_s)
    await asyncio.to_thread(topology.redis.start)
    topology.note("Redis started again on its append-only file")
    await asyncio.sleep(plan.gap_s)

    await progress.note()
    killed[0] = topology.now()  # before the signal: a connection may break at once
    await topology.kill("ingress-1")
    topology.note("SIGKILL ingress-1 (its clients go on at ingress-2)")


async def _settle(
    plan: ChaosPlan, topology: ChaosTopology, batch: BatchClient, jobs: list[str]
) -> None:
    """Wait for the batch jobs to finish (or ``settle_s`` to pass)."""
    deadline = time.monotonic() + plan.settle_s
    left = list(jobs)
    while left:
        job = left[0]
        try:
            status = await batch.status(job)
            if status.complete:
                topology.note(f"batch job {job} complete: {status.done}/{status.lines} lines")
                left.pop(0)
                continue
        except LanewayError as exc:
            log.info("batch status not read yet: %s", exc)
        if time.monotonic() > deadline:
            topology.note(f"batch job {job} not complete after {plan.settle_s:g} s of settling")
            return
        await asyncio.sleep(2.0)


async def _count(
    topology: ChaosTopology, clients: ChaosClients, killed: dict[int, float], jobs: list[str]
) -> ChaosTally:
    topics = topology.topics
    bootstrap = topology.kafka.bootstrap
    interactive = [t for pool in ("completion", "chat") for t in topics.pool_topics(pool)]
    requests = await read_to_end(bootstrap, interactive)
    accepted = accepted_requests(requests)
    lines = batch_lines(await read_to_end(bootstrap, [topics.request("batch")]), jobs)
    ids = {a.id for a in accepted} | set(lines)
    # Usage of requests still finishing may be a moment behind, and the streams app's count
    # of it a moment more: read again until every accepted request has its event and the
    # rollups count every one, or for a minute.
    deadline = time.monotonic() + 60.0
    while True:
        raw = await read_to_end(bootstrap, [topics.usage])
        usage, with_usage = usage_outcomes(raw), ids_with_usage(raw, _TEAMS)
        changelog = await read_to_end(bootstrap, [topology.rollups_changelog])
        counted = rollup_requests(changelog, _TEAMS)
        if (ids <= usage.keys() and counted == with_usage) or time.monotonic() > deadline:
            break
        await asyncio.sleep(2.0)
    results = batch_results(await read_to_end(bootstrap, [topics.results_batch]), jobs)
    used = batch_tokens_used(raw, _TEAMS, QuotaPolicy().min_charge_tokens)
    topology.note("topics read to their end offsets (read_committed)")
    return tally(
        clients.requests,
        killed,
        accepted,
        usage,
        lines=lines,
        results=results,
        with_usage=with_usage,
        rollups=counted,
        batch_tokens=used,
    )


async def _charged(settings: CommonSettings, teams: Sequence[str], hours: range) -> dict[str, int]:
    """Per team: tokens the quota charged its batch pool in ``hours`` (epoch hours)."""
    redis = make_redis(settings)
    try:
        charged = {}
        for team in teams:
            keys = [settings.keys.quota_used(team, "batch", h) for h in hours]
            charged[team] = sum(int(v) for v in await redis.mget(keys) if v is not None)
        return charged
    finally:
        await redis.aclose()
