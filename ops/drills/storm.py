"""``laneway drill storm``: typists abandon most of their completions; does the cancel shield
keep the stale work off the engine, and do the completions they keep stay as fast?

Windows of calm typing (one keystroke a burst: only completions that are kept) and of a
storm (bursts of 3–8 keystrokes, each abandoning the one before: ``ops.drills.typists``, the
generator of ``bench.cancel_storm``) alternate ABBA on the running stack after a warm-up, so
both meet the same broker and host. What the engine did is read back from ``laneway.usage``
(the typists' team only): engine time, the part of it spent after a request turned stale,
and each completion's outcome (``ops.drills.engine_time``, the bench's measurement).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from laneway.errors import ConfigError
from laneway.settings import CommonSettings
from ops.drills.engine_time import Completion, EngineTime, engine_time
from ops.drills.surge import Verdict, p99
from ops.drills.typists import TypingStats, typist

__all__ = ["StormPlan", "StormRun", "Window", "judge", "run_storm", "summary", "write_timeline"]

# After a window's typists stop, their last requests end and the ingress sees the last
# disconnects before the next window opens.
_SETTLE_S = 2.0
_DROPPED = ("cancelled", "superseded", "expired")


@dataclass(frozen=True)
class StormPlan:
    typists: int = 10
    window_s: float = 30.0
    rounds: int = 2  # windows of each phase (calm, storm), ABBA
    warmup_s: float = 15.0
    max_waste: float = 0.05  # stale engine time, a share of the storm windows' engine time
    # Engine time a request may still use once the news that it is stale reached its worker
    # (P99): the step under way ends first, a few decode steps at most.
    max_stale_ms: float = 100.0
    p99_ratio: float = 1.5  # kept completions' P99 in the storm, against calm typing

    def __post_init__(self) -> None:
        if self.typists < 1 or self.rounds < 1:
            raise ConfigError(
                f"--typists and --rounds must be at least 1, not {self.typists} and {self.rounds}"
            )
        if not self.window_s >= 1 or self.warmup_s < 0:
            raise ConfigError(
                f"--window-s must be at least 1 (not {self.window_s:g}) and --warmup-s at "
                f"least 0 (not {self.warmup_s:g})"
            )


@dataclass
class Window:
    """One measured window: its phase, its wall clock span and what the typists saw."""

    phase: str  # "calm" or "storm"
    start: float
    end: float
    stats: TypingStats

    def holds(self, ts: float) -> bool:
        return self.start <= ts <= self.end


@dataclass
class StormRun:
    plan: StormPlan
    began: float  # wall clock
    windows: list[Window] = field(default_factory=list)
    engine: EngineTime = field(default_factory=EngineTime)

    def phase(self, name: str) -> list[Window]:
        return [w for w in self.windows if w.phase == name]

    def completions(self, name: str) -> list[Completion]:
        """The typists' completions that ended in the windows of a phase."""
        windows = self.phase(name)
        return [c for c in self.engine.completions if any(w.holds(c.ts) for w in windows)]


async def run_storm(
    plan: StormPlan,
    *,
    address: tuple[str, int],
    key: str,
    team: str,
    settings: CommonSettings,
    say: Callable[[str], None] = print,
) -> StormRun:
    """Warm up, then the ABBA windows; then the usage events of the whole run."""
    run = StormRun(plan, time.time())

    async def typing(storm: bool, seconds: float, stats: TypingStats) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            *(
                typist(address, key, n, deadline=deadline, storm=storm, stats=stats)
                for n in range(plan.typists)
            )
        )
        await asyncio.sleep(_SETTLE_S)

    if plan.warmup_s > 0:
        say(f"  warm-up: {plan.warmup_s:g} s of storm (not measured)")
        await typing(True, plan.warmup_s, TypingStats())
    for round_ in range(plan.rounds):
        phases = ("calm", "storm") if round_ % 2 == 0 else ("storm", "calm")
        for phase in phases:
            window = Window(phase, time.time(), math.nan, TypingStats())
            await typing(phase == "storm", plan.window_s, window.stats)
            window.end = time.time()
            run.windows.append(window)
            stats = window.stats
            say(
                f"  {phase:<5} window {len(run.windows)}: {stats.sent} keystrokes, "
                f"{len(stats.kept)} kept, P99 {_ms(p99(list(stats.kept.values())) / 1000)}"
            )
    abandoned = set().union(*(w.stats.abandoned for w in run.windows))
    first = run.windows[0].start
    run.engine = await engine_time(
        settings, int(first * 1000), int(time.time() * 1000), abandoned, team=team
    )
    return run


@dataclass(frozen=True)
class _Phase:
    """What one phase's windows add up to."""

    keystrokes: int
    kept: list[float]  # latencies, ms
    window_p99s: list[float]
    errors: int
    engine_ms: float
    stale_ms: float
    dropped: int  # stale before the engine: never started
    aborted: int  # started, then stale: aborted while running
    ended: int  # turned stale in its last step: it ended before the abort could
    stale_each: list[float]  # engine ms after the news, of each that turned stale running

    @property
    def waste(self) -> float:
        return self.stale_ms / self.engine_ms if self.engine_ms else 0.0


def _phase(run: StormRun, name: str) -> _Phase:
    windows = run.phase(name)
    done = run.completions(name)
    return _Phase(
        keystrokes=sum(w.stats.sent for w in windows),
        kept=[ms for w in windows for ms in w.stats.kept.values()],
        window_p99s=[p99(list(w.stats.kept.values())) for w in windows],
        errors=sum(w.stats.errors for w in windows),
        engine_ms=sum(c.engine_ms for c in done),
        stale_ms=sum(c.stale_engine_ms for c in done),
        dropped=sum(1 for c in done if c.status in _DROPPED and c.engine_ms == 0),
        aborted=sum(1 for c in done if c.engine_ms > 0 and c.status != "ok"),
        ended=sum(1 for c in done if c.status == "ok" and c.stale_engine_ms > 0),
        stale_each=[c.stale_engine_ms for c in done if c.stale_engine_ms > 0],
    )


def judge(run: StormRun) -> list[Verdict]:
    """The drill's verdicts (pure: also what the unit tests check)."""
    plan = run.plan
    calm, storm = _phase(run, "calm"), _phase(run, "storm")
    rows = [
        Verdict(
            "GPU-time waste: engine time on stale work (storm)",
            f"≤ {plan.max_waste:.0%} of engine time",
            f"{storm.waste:.1%} ({storm.stale_ms / 1000:.1f} of {storm.engine_ms / 1000:.1f} "
            "engine-s)",
            storm.engine_ms > 0 and storm.waste <= plan.max_waste,
        ),
        Verdict(
            "stale keystrokes stopped (storm)",
            f"dropped before the engine, or stopped within {plan.max_stale_ms:g} ms of engine "
            "time after the news (P99)",
            f"{storm.dropped} dropped before the engine; {storm.aborted} aborted while running "
            f"and {storm.ended} ended in the step the news came in, "
            f"P99 {p99(storm.stale_each):.0f} ms after the news",
            storm.dropped + storm.aborted > 0
            and (not storm.stale_each or p99(storm.stale_each) <= plan.max_stale_ms),
        ),
    ]
    ratio = p99(storm.kept) / p99(calm.kept) if calm.kept and storm.kept else math.nan
    rows.append(
        Verdict(
            "kept completions' P99, storm against calm",
            f"≤ {plan.p99_ratio:g}×",
            f"{ratio:.2f}× ({_ms(p99(storm.kept) / 1000)} vs {_ms(p99(calm.kept) / 1000)}; "
            f"windows: storm {_span(storm.window_p99s)}, calm {_span(calm.window_p99s)})",
            math.isfinite(ratio) and ratio <= plan.p99_ratio,
        )
    )
    kept = len(calm.kept) + len(storm.kept)
    errors = calm.errors + storm.errors
    rows.append(
        Verdict("kept completions fail none", "0", f"{errors} of {kept + errors}", errors == 0)
    )
    return rows


def summary(run: StormRun) -> str:
    """A row per phase: keystrokes, kept, latency, engine time and what became of stale work."""
    lines = [
        "| phase | windows | keystrokes | kept | kept P50 ms | kept P99 ms | engine-s "
        "| stale engine % | dropped before the engine | aborted while running |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("calm", "storm"):
        p = _phase(run, name)
        p50 = sorted(p.kept)[len(p.kept) // 2] if p.kept else math.nan
        lines.append(
            f"| {name} | {len(run.phase(name))} | {p.keystrokes} | {len(p.kept)} | {p50:.0f} "
            f"| {p99(p.kept):.0f} | {p.engine_ms / 1000:.1f} | {100 * p.waste:.1f} "
            f"| {p.dropped} | {p.aborted} |"
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if math.isfinite(seconds) else "-"


def _span(values: Sequence[float]) -> str:
    known = [v for v in values if math.isfinite(v)]
    return f"{min(known):.0f}–{max(known):.0f} ms" if known else "-"


def write_timeline(run: StormRun, path: Path, title: str) -> Path:
    """Completions per second by outcome, kept latency, engine time useful and stale (PNG)."""
    from ops.drills.timeline import finish_figure, pyplot  # noqa: PLC0415 - matplotlib is optional

    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True, dpi=80)
    began = run.began
    end = math.ceil(max((w.end for w in run.windows), default=began) - began) + 1
    seconds = list(range(end))
    outcomes: dict[str, defaultdict[int, int]] = defaultdict(lambda: defaultdict(int))
    useful: defaultdict[int, float] = defaultdict(float)
    stale: defaultdict[int, float] = defaultdict(float)
    for c in run.engine.completions:
        s = int(c.ts - began)
        kind = (
            "ok"
            if c.status == "ok"
            else "dropped before the engine"
            if c.engine_ms == 0
            else "aborted while running"
        )
        outcomes[kind][s] += 1
        useful[s] += (c.engine_ms - c.stale_engine_ms) / 1000
        stale[s] += c.stale_engine_ms / 1000
    for kind, by_second in sorted(outcomes.items()):
        axes[0].plot(seconds, [by_second.get(t, 0) for t in seconds], label=kind)
    axes[0].set_ylabel("completions/s")
    for w in run.windows:
        points = [
            (w.stats.timing[rid]["sent_at"] - began, ms)
            for rid, ms in w.stats.kept.items()
            if "sent_at" in w.stats.timing.get(rid, {})
        ]
        axes[1].plot([t for t, _ in points], [ms for _, ms in points], ".", markersize=2,
                     color="tab:red" if w.phase == "storm" else "tab:blue")  # fmt: skip
        axes[1].hlines(p99(list(w.stats.kept.values())), w.start - began, w.end - began,
                       color="black", linewidth=1)  # fmt: skip
    axes[1].plot([], [], "k-", label="window P99")
    axes[1].set_ylabel("kept completion ms")
    axes[2].stackplot(seconds, [useful.get(t, 0.0) for t in seconds],
                      [stale.get(t, 0.0) for t in seconds],
                      labels=["engine-s: useful", "engine-s: stale"])  # fmt: skip
    axes[2].set_ylabel("engine-s per s")
    axes[2].set_xlabel("seconds since the drill began (storm windows shaded)")
    for ax in axes:
        for w in run.phase("storm"):
            ax.axvspan(w.start - began, w.end - began, color="orange", alpha=0.12)
    return finish_figure(fig, axes, title, path)
