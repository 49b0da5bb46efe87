"""``laneway drill canary``: a healthy canary walks its steps to 100 %, a faulty one is rolled
back at its first step, and no session changes route mid-step.

Two phases against a running stack, each with steady completion traffic over many sessions
(``X-Laneway-Session``): first a canary to a healthy route, then one to a route the workers'
simulated engine fails on purpose (``LANEWAY_SIM_ROUTE_FAILURE_RATES`` of ``laneway up``).
The canary's state is sampled from Redis each second; which route served each request is read
back from ``laneway.usage`` (the client cannot see it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from laneway.canary import CanaryState, delete_canary, get_canary, start_canary
from laneway.constants import RedisKeys
from laneway.errors import LanewayError, NotFound
from laneway.settings import CommonSettings
from ops.drills.surge import Verdict
from ops.drills.usage_log import usage_events

__all__ = ["CanaryPlan", "CanaryRun", "judge", "run_canary", "table", "write_timeline"]

# The ingress reads a canary's state once a second: a request sent this soon after a step
# changed may still be routed by the step before.
_STEP_SLACK_S = 2.5
_SAMPLE_S = 1.0  # the canary's state is sampled once a second


@dataclass(frozen=True)
class CanaryPlan:
    model: str = "laneway-code"
    good_target: str = "laneway-code-v2"
    bad_target: str = "laneway-code-bad"
    steps: tuple[float, ...] = (1.0, 5.0, 10.0, 100.0)
    rps: float = 20.0
    sessions: int = 400
    max_tokens: int = 8
    window_s: float = 60.0  # the streams app's LANEWAY_CANARY_WINDOW_S
    phase_max_s: float = 600.0


@dataclass
class Sent:
    """One request of the drill: when it left (s since the drill began), its session, id."""

    t: float
    phase: str
    session: str
    status: int
    request_id: str = ""
    route: str = ""


@dataclass
class Phase:
    name: str
    target: str
    started: float  # s since the drill began
    samples: list[tuple[float, CanaryState]] = field(default_factory=list)
    ended: float = math.nan

    @property
    def final(self) -> CanaryState | None:
        return self.samples[-1][1] if self.samples else None

    def weights(self) -> list[float]:
        """The running weights it went through, in order, each once."""
        seen: list[float] = []
        for _, state in self.samples:
            if state.status == "running" and (not seen or seen[-1] != state.weight):
                seen.append(state.weight)
        return seen

    def step_changes(self) -> list[float]:
        """When (s since the drill began) the weight changed, as sampled."""
        return [
            t
            for (_, a), (t, b) in itertools.pairwise(self.samples)
            if (a.weight, a.status) != (b.weight, b.status)
        ]


@dataclass
class CanaryRun:
    plan: CanaryPlan
    phases: list[Phase] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)


async def run_canary(
    plan: CanaryPlan,
    *,
    base_url: str,
    key: str,
    redis: aioredis.Redis,
    settings: CommonSettings,
    say: Any = print,
) -> CanaryRun:
    keys = settings.keys
    run = CanaryRun(plan)
    began = time.monotonic()
    wall_began = time.time()
    async with httpx.AsyncClient(
        base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=30
    ) as http:
        for name, target in (("healthy", plan.good_target), ("faulty", plan.bad_target)):
            with_leftover = await get_canary(redis, keys, plan.model)
            if with_leftover is not None:
                if with_leftover.status == "running":
                    raise LanewayError(
                        f"{plan.model} has a canary running already; "
                        f"`laneway canary abort {plan.model}` first"
                    )
                await delete_canary(redis, keys, plan.model)
            await start_canary(redis, keys, plan.model, target, plan.steps)
            phase = Phase(name, target, time.monotonic() - began)
            run.phases.append(phase)
            say(f"{name} canary {plan.model} → {target}: steps {list(plan.steps)}")
            await _drive(run, phase, http, _Watch(redis, keys, began, say))
    with_leftover = await get_canary(redis, keys, plan.model)
    if with_leftover is not None and with_leftover.status != "running":
        with contextlib.suppress(NotFound):
            await delete_canary(redis, keys, plan.model)
    await _routes(run, settings, wall_began)
    return run


@dataclass(frozen=True)
class _Watch:
    redis: aioredis.Redis
    keys: RedisKeys
    began: float
    say: Any


async def _drive(run: CanaryRun, phase: Phase, http: httpx.AsyncClient, watch: _Watch) -> None:
    plan, began, say = run.plan, watch.began, watch.say
    pending: set[asyncio.Task[None]] = set()
    counter = itertools.count()

    async def one(n: int, t: float) -> None:
        session = f"drill/canary/{n % plan.sessions}.py"
        sent = Sent(t, phase.name, session, 0)
        run.sent.append(sent)
        try:
            response = await http.post(
                "/v1/completions",
                json={"model": plan.model, "prompt": f"def f{n}():", "max_tokens": plan.max_tokens},
                headers={"X-Laneway-Session": session},
            )
            sent.status = response.status_code
            sent.request_id = response.headers.get("x-laneway-request-id", "")
        except httpx.HTTPError:
            sent.status = 0

    start = time.monotonic()
    next_sample = start
    while time.monotonic() - start < plan.phase_max_s:
        now = time.monotonic()
        if now >= next_sample:
            state = await get_canary(watch.redis, watch.keys, plan.model)
            if state is not None:
                if not phase.samples or phase.samples[-1][1] != state:
                    say(f"  +{now - start:5.1f} s  {state.status} at {state.weight:g} %")
                phase.samples.append((now - began, state))
                if state.status != "running":
                    break
            next_sample += _SAMPLE_S
        task = asyncio.create_task(one(next(counter), now - began))
        pending.add(task)
        task.add_done_callback(pending.discard)
        await asyncio.sleep(1 / plan.rps)
    phase.ended = time.monotonic() - began
    if pending:
        await asyncio.wait(pending, timeout=30)


async def _routes(run: CanaryRun, settings: CommonSettings, since_wall: float) -> None:
    """Which route served each request: its usage event on ``laneway.usage``."""
    wanted = {s.request_id: s for s in run.sent if s.request_id}
    events = await usage_events(settings, since_wall, lambda e: e.get("id") in wanted)
    for event in events:
        wanted[event["id"]].route = str(event.get("route", ""))


def _flips(run: CanaryRun, phase: Phase) -> tuple[int, int]:
    """(sessions that went back to the stable route, sessions that changed route mid-step)."""
    changes = phase.step_changes()
    routes: dict[str, list[Sent]] = defaultdict(list)
    for sent in run.sent:
        if sent.phase == phase.name and sent.route:
            routes[sent.session].append(sent)
    back = mid = 0
    for requests in routes.values():
        requests.sort(key=lambda s: s.t)
        for before, after in itertools.pairwise(requests):
            if before.route == after.route:
                continue
            if before.route == phase.target and phase.final and phase.final.status == "running":
                back += 1
            # A change is due to a step change between the two: one the drill saw up to a
            # sample (1 s) after it happened, or the ingress read up to a second late.
            due = any(before.t - _STEP_SLACK_S <= c <= after.t + _SAMPLE_S for c in changes)
            if not due:
                mid += 1
    return back, mid


def judge(run: CanaryRun) -> list[Verdict]:
    plan = run.plan
    rows = []
    phases = {p.name: p for p in run.phases}
    healthy, faulty = phases.get("healthy"), phases.get("faulty")
    if healthy is not None:
        final = healthy.final
        walked = healthy.weights()
        want = list(plan.steps[:-1])
        took = healthy.ended - healthy.started
        rows.append(
            Verdict(
                "a healthy canary walks its steps",
                " → ".join(f"{w:g}" for w in plan.steps) + " %, promoted",
                " → ".join(f"{w:g}" for w in walked)
                + f" → {final.status if final else '?'} after {took:.0f} s",
                walked == want and final is not None and final.status == "promoted",
            )
        )
        back, mid = _flips(run, healthy)
        rows.append(
            Verdict(
                "no session changes route mid-step (healthy)",
                "0 sessions",
                f"{mid} mid-step, {back} back to stable",
                mid == 0 and back == 0,
            )
        )
        bad = sum(1 for s in run.sent if s.phase == "healthy" and s.status != 200)
        rows.append(Verdict("the healthy phase fails no request", "0", f"{bad}", bad == 0))
    if faulty is not None:
        final = faulty.final
        walked = faulty.weights()
        took = faulty.ended - faulty.started
        rows.append(
            Verdict(
                "a faulty canary is rolled back within one window",
                f"rolled back at its first step ({plan.steps[0]:g} %)",
                f"{final.status if final else '?'} after {took:.0f} s at "
                + (" → ".join(f"{w:g}" for w in walked) or "-")
                + (f" %: {final.reason}" if final and final.reason else ""),
                final is not None and final.status == "rolled_back" and walked == [plan.steps[0]],
            )
        )
        _, mid = _flips(run, faulty)
        rows.append(
            Verdict("no session changes route mid-step (faulty)", "0 sessions", f"{mid}", mid == 0)
        )
    return rows


def table(rows: Sequence[Verdict]) -> str:
    lines = ["| check | target | measured | verdict |", "|---|---|---|---|"]
    lines += [
        f"| {r.check} | {r.target} | {r.measured} | {'PASS' if r.ok else 'FAIL'} |" for r in rows
    ]
    return "\n".join(lines)


def summary(run: CanaryRun) -> str:
    lines = ["| phase | sent | 200 | other | on the canary |", "|---|---|---|---|---|"]
    for phase in run.phases:
        sent = [s for s in run.sent if s.phase == phase.name]
        ok = sum(1 for s in sent if s.status == 200)
        canary = sum(1 for s in sent if s.route == phase.target)
        lines.append(
            f"| {phase.name} → {phase.target} | {len(sent)} | {ok} | {len(sent) - ok} | {canary} |"
        )
    return "\n".join(lines)


def write_timeline(run: CanaryRun, path: Path, title: str) -> Path:
    """Canary weight, request rate and error rate per route over time (PNG)."""
    from ops.drills.timeline import finish_figure, pyplot  # noqa: PLC0415 - matplotlib is optional

    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True, dpi=80)
    for phase in run.phases:
        times = [t for t, _ in phase.samples]
        axes[0].step(times, [s.weight for _, s in phase.samples], where="post",
                     label=f"{phase.name}: weight on {phase.target}")  # fmt: skip
    axes[0].set_ylabel("canary weight %")
    end = math.ceil(max((s.t for s in run.sent), default=0)) + 1
    seconds = list(range(end))
    per_route: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for s in run.sent:
        per_route[s.route or "(route unknown)"][int(s.t)].append(s.status)
    for route, by_second in sorted(per_route.items()):
        axes[1].plot(seconds, [len(by_second.get(t, [])) for t in seconds], label=route)
        axes[2].plot(
            seconds,
            [
                sum(1 for st in by_second[t] if st != 200) / len(by_second[t])
                if by_second.get(t)
                else math.nan
                for t in seconds
            ],
            marker=".",
            linestyle="none",
            label=route,
        )
    axes[1].set_ylabel("requests/s")
    axes[2].set_ylabel("error share")
    axes[2].set_xlabel("seconds since the drill began")
    return finish_figure(fig, axes, title, path)
