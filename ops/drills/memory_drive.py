"""Driving the memory drill against a running stack (``ops.drills.memory`` judges the run).

The traffic: hi-band completions (the latency probe), lo-band chats with long contexts (the
``X-Laneway-Priority: lo`` header lowers them) and one batch job through the ingress's Batches
API, all with the drill's API key. The pressure: ``RedisKeys.sim_kv_hold`` set to the hold's
share for the hold's length (with that TTL, so a drill that dies leaves no stack pinned),
which every worker with a simulated engine reads at its heartbeat. What it watches: the
workers' heartbeats (KV usage, pressure, work shed and waiting), once a second; afterwards the
usage event of each of its requests and of each line of its job (``laneway.usage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from laneway.batch_http import HttpBatchClient
from laneway.constants import HEARTBEAT_TTL_S, POOLS, RedisKeys
from laneway.errors import LanewayError
from laneway.settings import CommonSettings
from ops.drills.load import OpenLoopLoad
from ops.drills.memory import MemoryPlan, MemoryRun, MemorySample
from ops.drills.usage_log import usage_events

__all__ = ["run_memory"]

_SAMPLE_S = 1.0
_SAY_EVERY_S = 5.0
_USAGE_WAIT_S = 30.0  # the last usage events may reach the topic a moment after the answers


async def run_memory(
    plan: MemoryPlan,
    *,
    base_url: str,
    key: str,
    redis: aioredis.Redis,
    settings: CommonSettings,
    say: Callable[[str], None] = print,
) -> MemoryRun:
    """Drive the plan against a running stack; sample its workers each second meanwhile."""
    run = MemoryRun(plan, began_wall=time.time())
    began = time.monotonic()
    hold_key = settings.keys.sim_kv_hold()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with (
        httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=plan.finish_within_s,
            limits=limits,
        ) as http,
        HttpBatchClient(f"{base_url.rstrip('/')}/v1", key) as batches,
    ):
        run.batch_id = await _submit_batch(batches, plan)
        say(f"batch job {run.batch_id}: {plan.batch_lines} lines submitted")
        hi = OpenLoopLoad(
            http, "/v1/completions", functools.partial(_completion, plan), started=began
        )
        lo = OpenLoopLoad(
            http,
            "/v1/chat/completions",
            functools.partial(_chat, plan),
            started=began,
            headers={"X-Laneway-Priority": "lo"},
        )
        done = asyncio.Event()
        watch = _Watch(redis, settings.keys, batches, began, say)
        watching = asyncio.create_task(watch.loop(run, done))
        try:
            await _traffic(hi, lo, plan, plan.baseline_s)
            await redis.set(hold_key, str(plan.hold_share), ex=math.ceil(plan.hold_s))
            held = f"simulated KV memory held at {plan.hold_share:.0%}"
            say(f"+{time.monotonic() - began:.0f} s: {held}")
            try:
                await _traffic(hi, lo, plan, plan.hold_s)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await redis.delete(hold_key)
            say(f"+{time.monotonic() - began:.0f} s: hold released")
            await _traffic(hi, lo, plan, plan.after_s)
            say(f"+{time.monotonic() - began:.0f} s: traffic stopped; waiting for what is left")
            await asyncio.gather(hi.drain(plan.finish_within_s), lo.drain(plan.finish_within_s))
            await _job_finished(batches, run, plan.finish_within_s)
        finally:
            done.set()
            await watching
        run.batch_output_ids = await _output_ids(batches, run.batch_id)
    run.hi = sorted(hi.outcomes, key=lambda o: o.sent_at)
    run.lo = sorted(lo.outcomes, key=lambda o: o.sent_at)
    say(f"+{time.monotonic() - began:.0f} s: reading the usage events of the drill's work")
    run.usage = await _usage_events(run, settings)
    return run


async def _traffic(hi: OpenLoopLoad, lo: OpenLoopLoad, plan: MemoryPlan, seconds: float) -> None:
    await asyncio.gather(hi.run(plan.hi_rps, seconds), lo.run(plan.lo_rps, seconds))


def _completion(plan: MemoryPlan, n: int) -> dict[str, object]:
    # A prompt of its own each: no supersession, no cache hit (as in the surge drill).
    return {
        "model": "laneway-code",
        "prompt": f"# request {n}\ndef handler_{n}(request):\n    ",
        "max_tokens": plan.max_tokens,
    }


def _chat(plan: MemoryPlan, n: int) -> dict[str, object]:
    # Four conversations over long contexts (a repository's files): KV memory is what they
    # take, and what a full engine has no more of.
    context = f"# file {n % 4}\n" + "def helper(value):\n    return value\n" * (
        plan.lo_context_chars // 36
    )
    return {
        "model": "laneway-chat",
        "messages": [
            {"role": "system", "content": context},
            {"role": "user", "content": f"question {n}: what does helper do?"},
        ],
        "max_tokens": plan.lo_max_tokens,
    }


async def _submit_batch(batches: HttpBatchClient, plan: MemoryPlan) -> str:
    lines = [
        {
            "custom_id": f"memory-drill-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "laneway-chat",
                "messages": [{"role": "user", "content": f"summarise document {i}: " * 40}],
                "max_tokens": plan.batch_max_tokens,
            },
        }
        for i in range(plan.batch_lines)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory-drill.jsonl"
        path.write_bytes(b"\n".join(orjson.dumps(line) for line in lines) + b"\n")
        batch = await batches.submit(path, "/v1/chat/completions", {"drill": "memory"})
    return str(batch["id"])


async def _job_finished(batches: HttpBatchClient, run: MemoryRun, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        batch = await batches.batch(run.batch_id)
        counts = batch["request_counts"]
        run.batch_total, run.batch_completed = counts["total"], counts["completed"]
        run.batch_failed = counts["failed"]
        if HttpBatchClient.finished(batch) or time.monotonic() > deadline:
            return
        await asyncio.sleep(1.0)


async def _output_ids(batches: HttpBatchClient, batch_id: str) -> list[str]:
    try:
        raw = await batches.results(batch_id)
    except LanewayError:
        return []  # not finished: the verdict says so
    return [str(orjson.loads(line)["custom_id"]) for line in raw.splitlines() if line.strip()]


@dataclass(frozen=True)
class _Watch:
    """What the drill samples each second, and where it says so."""

    redis: aioredis.Redis
    keys: RedisKeys
    batches: HttpBatchClient
    began: float
    say: Callable[[str], None]

    async def loop(self, run: MemoryRun, done: asyncio.Event) -> None:
        next_say = 0.0
        while not done.is_set():
            t = time.monotonic() - self.began
            sample = await _sample(self.redis, self.keys, t)
            with contextlib.suppress(LanewayError, KeyError):
                counts = (await self.batches.batch(run.batch_id))["request_counts"]
                sample.batch_done = int(counts["completed"]) + int(counts["failed"])
            run.samples.append(sample)
            if t >= next_say:
                next_say += _SAY_EVERY_S
                self.say(_progress(sample, run.plan.batch_lines))
            await asyncio.sleep(max(0.0, _SAMPLE_S - (time.monotonic() - self.began) % _SAMPLE_S))


async def _sample(redis: aioredis.Redis, keys: RedisKeys, t: float) -> MemorySample:
    """Every pool's live workers' heartbeats, summed (KV usage: the highest)."""
    sample = MemorySample(t)
    for pool in POOLS:
        beats: list[dict[str, Any]] = []
        with contextlib.suppress(RedisError, OSError, orjson.JSONDecodeError):
            ids = await redis.zrangebyscore(
                keys.workers(pool), time.time() - HEARTBEAT_TTL_S, "+inf"
            )
            if ids:
                names = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
                infos = await redis.mget([keys.worker_info(name) for name in names])
                beats = [orjson.loads(raw) for raw in infos if raw is not None]
        if not beats:
            sample.kv[pool] = None
            continue
        sample.kv[pool] = max(float(b.get("kv_cache_usage") or 0.0) for b in beats)
        sample.pressed[pool] = any(bool(b.get("memory_pressure")) for b in beats)
        sample.shed[pool] = sum(int(b.get("memory_shed", 0)) for b in beats)
        sample.waiting[pool] = sum(int(b.get("dispatch_queue", 0)) for b in beats)
    return sample


def _progress(sample: MemorySample, lines: int) -> str:
    kv = " ".join(
        f"{pool} {'-' if value is None else f'{value:.0%}'}" for pool, value in sample.kv.items()
    )
    shed = " ".join(f"{pool} {n}" for pool, n in sample.shed.items())
    done = "-" if sample.batch_done is None else str(sample.batch_done)
    return f"  +{sample.t:5.1f} s  KV {kv} | shed so far {shed} | batch {done}/{lines}"


async def _usage_events(run: MemoryRun, settings: CommonSettings) -> list[dict[str, Any]]:
    """The usage events of the drill's requests and of its job's lines, until each request
    and line has one (or for ``_USAGE_WAIT_S``)."""
    wanted = {o.request_id for o in run.hi + run.lo if o.request_id}

    def ours(event: dict[str, Any]) -> bool:
        return event.get("id") in wanted or event.get("job_id") == run.batch_id

    def complete(found: list[dict[str, Any]]) -> bool:
        seen = {e["id"] for e in found}
        lines = {e["id"] for e in found if e.get("job_id") == run.batch_id}
        return wanted <= seen and len(lines) >= run.batch_total

    return await usage_events(
        settings, run.began_wall, ours, complete=complete, within_s=_USAGE_WAIT_S
    )
