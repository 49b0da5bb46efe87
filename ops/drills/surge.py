"""The surge drill: completion traffic at ``factor``× its baseline for a minute.

What must show (issue 27): the completion pool's signal asks for two more replicas within
30 s of the surge's start, they join the pool's consumer group, completion P99 is back
within 1.5× of the baseline's within 60 s of the start, and chat and batch are untouched.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from laneway.errors import ConfigError
from ops.drills.load import OpenLoopLoad, Outcome
from ops.drills.observe import Sample, StackObserver

__all__ = [
    "SurgePlan",
    "SurgeRun",
    "Verdict",
    "baseline_p99",
    "judge",
    "p99",
    "run_surge",
    "window_p99s",
]

# P99 is judged over windows this long: one second of a few dozen requests has no P99.
WINDOW_S = 5.0


@dataclass(frozen=True)
class SurgePlan:
    """Rates and phase lengths of one drill."""

    baseline_rps: float = 3.0
    factor: float = 5.0
    baseline_s: float = 30.0
    surge_s: float = 60.0
    after_s: float = 75.0
    warmup_s: float = 10.0  # the first seconds of the baseline are not judged
    signal_within_s: float = 30.0
    p99_within_s: float = 60.0
    p99_ratio: float = 1.5
    extra_replicas: int = 2
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.baseline_rps > 0:
            raise ConfigError(f"--baseline-rps must be above 0, not {self.baseline_rps}")
        if not self.factor > 1:
            raise ConfigError(f"--factor must be above 1 (a surge), not {self.factor}")
        if not self.baseline_s > self.warmup_s + WINDOW_S:
            raise ConfigError(
                f"--baseline-s {self.baseline_s:g} leaves no baseline to measure after "
                f"{self.warmup_s:g} s of warm-up: give it more than {self.warmup_s + WINDOW_S:g}"
            )
        if not self.surge_s >= WINDOW_S or self.after_s < 0:
            raise ConfigError(f"--surge-s must be at least {WINDOW_S:g}, --after-s at least 0")

    @property
    def surge_start(self) -> float:
        return self.baseline_s

    @property
    def surge_end(self) -> float:
        return self.baseline_s + self.surge_s


@dataclass
class SurgeRun:
    """What one drill saw: every completion's outcome and a sample of the stack per second."""

    plan: SurgePlan
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    """One row of the verdict table."""

    check: str
    target: str
    measured: str
    ok: bool


def p99(latencies: Sequence[float]) -> float:
    """The 99th percentile (nearest rank); NaN for no values."""
    if not latencies:
        return math.nan
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _latencies(outcomes: Sequence[Outcome], start: float, end: float) -> list[float]:
    """Latencies of the requests sent in [start, end); one not answered with 200 counts as
    infinitely slow (a 504 for an expired completion is no fast answer)."""
    return [
        o.latency_s if o.status == 200 else math.inf for o in outcomes if start <= o.sent_at < end
    ]


def baseline_p99(run: SurgeRun) -> float:
    """P99 of the completions sent before the surge, after the warm-up."""
    return p99(_latencies(run.outcomes, run.plan.warmup_s, run.plan.surge_start))


def window_p99s(run: SurgeRun) -> list[tuple[float, float]]:
    """(window start, P99) of consecutive windows from the end of the warm-up on."""
    plan, found = run.plan, []
    start = plan.warmup_s
    while start + WINDOW_S <= plan.surge_end + plan.after_s:
        found.append((start, p99(_latencies(run.outcomes, start, start + WINDOW_S))))
        start += WINDOW_S
    return found


def _first(
    samples: Sequence[Sample], since: float, pool: str, wanted: int, what: str
) -> float | None:
    for sample in samples:
        if sample.t < since:
            continue
        value = _value(sample, pool, what)
        if value is not None and value >= wanted:
            return sample.t - since
    return None


def _value(sample: Sample, pool: str, what: str) -> int | None:
    if what == "members":
        return sample.members.get(pool)
    signal = sample.signal.get(pool)
    if signal is None:
        return None
    return signal.desired if what == "desired" else signal.replicas


def _before(samples: Sequence[Sample], t: float, pool: str, what: str) -> int | None:
    values = [_value(s, pool, what) for s in samples if s.t < t]
    known = [v for v in values if v is not None]
    return known[-1] if known else None


def judge(run: SurgeRun) -> list[Verdict]:
    """The drill's verdicts (pure: also what the unit tests check)."""
    plan, samples = run.plan, run.samples
    start = plan.surge_start
    rows = []
    desired0 = _before(samples, start, "completion", "desired") or 1
    asked = _first(samples, start, "completion", desired0 + plan.extra_replicas, "desired")
    rows.append(
        Verdict(
            f"signal asks +{plan.extra_replicas} completion replicas",
            f"≤ {plan.signal_within_s:g} s after the surge starts",
            f"{desired0} → {desired0 + plan.extra_replicas} at +{asked:.1f} s"
            if asked is not None
            else f"never (from {desired0})",
            asked is not None and asked <= plan.signal_within_s,
        )
    )
    members0 = _before(samples, start, "completion", "members") or 1
    joined = _first(samples, start, "completion", members0 + plan.extra_replicas, "members")
    rows.append(
        Verdict(
            "they join the consumer group",
            f"{members0 + plan.extra_replicas} members during the surge",
            f"{members0} → {members0 + plan.extra_replicas} at +{joined:.1f} s"
            if joined is not None
            else f"never (from {members0})",
            joined is not None and joined <= plan.surge_s,
        )
    )
    baseline = baseline_p99(run)
    limit = baseline * plan.p99_ratio
    surge_windows = [(t, v) for t, v in window_p99s(run) if start <= t < plan.surge_end]
    back = None  # requests sent from this long after the start on are within the limit
    for i, (t, _) in enumerate(surge_windows):
        if all(v <= limit for _, v in surge_windows[i:]):
            back = t - start
            break
    worst = max((v for _, v in surge_windows), default=math.nan)
    rows.append(
        Verdict(
            f"completion P99 back within {plan.p99_ratio:g}× baseline",
            f"≤ {plan.p99_within_s:g} s after the start, and staying",
            f"baseline {_ms(baseline)}, worst {_ms(worst)}; "
            + (
                f"≤ {_ms(limit)} for those sent from +{back:.0f} s"
                if back is not None
                else "not back"
            ),
            back is not None and back + WINDOW_S <= plan.p99_within_s,
        )
    )
    for pool in ("chat", "batch"):
        seen = {
            (_value(s, pool, "desired"), _value(s, pool, "replicas"), s.members.get(pool))
            for s in samples
        }
        rows.append(
            Verdict(
                f"{pool} untouched",
                "desired, live workers and members unchanged",
                ", ".join(f"{d}/{r}/{m}" for d, r, m in sorted(seen, key=str)),
                len(seen) == 1,
            )
        )
    return rows


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "n/a"
    return "∞ (unanswered)" if math.isinf(seconds) else f"{seconds * 1000:.0f} ms"


def table(rows: Sequence[Verdict]) -> str:
    """The verdict table as Markdown."""
    lines = ["| check | target | measured | verdict |", "|---|---|---|---|"]
    lines += [
        f"| {r.check} | {r.target} | {r.measured} | {'PASS' if r.ok else 'FAIL'} |" for r in rows
    ]
    return "\n".join(lines)


def phase_summary(run: SurgeRun) -> str:
    """Requests sent, answered 200 and not, per phase."""
    plan = run.plan
    phases = [
        ("baseline", 0.0, plan.surge_start, plan.baseline_rps),
        ("surge", plan.surge_start, plan.surge_end, plan.baseline_rps * plan.factor),
        ("after", plan.surge_end, plan.surge_end + plan.after_s, plan.baseline_rps),
    ]
    lines = ["| phase | rate | sent | 200 | other | P99 |", "|---|---|---|---|---|---|"]
    for name, begin, end, rate in phases:
        sent = [o for o in run.outcomes if begin <= o.sent_at < end]
        ok = sum(o.status == 200 for o in sent)
        lines.append(
            f"| {name} | {rate:g}/s | {len(sent)} | {ok} | {len(sent) - ok} | "
            f"{_ms(p99(_latencies(run.outcomes, max(begin, plan.warmup_s), end)))} |"
        )
    return "\n".join(lines)


def _completion(plan: SurgePlan, n: int) -> dict[str, object]:
    # A prompt of its own each: no supersession, no cache hit; the affinity key (a hash of
    # the prompt's start) spreads them over the partitions.
    return {
        "model": "laneway-code",
        "prompt": f"# request {n}\ndef handler_{n}(request):\n    ",
        "max_tokens": plan.max_tokens,
    }


async def run_surge(
    plan: SurgePlan, *, base_url: str, key: str, observer: StackObserver
) -> SurgeRun:
    """Drive the plan against a running stack; sample it each second meanwhile."""
    run = SurgeRun(plan)
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=10.0, limits=limits
    ) as http:
        body = functools.partial(_completion, plan)
        load = OpenLoopLoad(http, "/v1/completions", body, started=started)
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                run.samples.append(await observer.sample(time.monotonic() - started))
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started) % 1.0))

        watching = asyncio.create_task(watch())
        try:
            await load.run(plan.baseline_rps, plan.baseline_s)
            await load.run(plan.baseline_rps * plan.factor, plan.surge_s)
            await load.run(plan.baseline_rps, plan.after_s)
            await load.drain(within_s=15.0)
        finally:
            done.set()
            await watching
    run.outcomes = sorted(load.outcomes, key=lambda o: o.sent_at)
    return run
