"""The memory drill: engine memory held at ≥ 90 % while mixed traffic runs.

What must show (issue 27): batch and lo-band work is shed and later finished (0 lost), and
hi-band completion P99 stays within 1.2× of before. Three phases of the same traffic (hi-band
completions, lo-band chats with long contexts, and a batch job submitted at the start): a
baseline, a hold (every simulated engine's KV memory held at ``hold_share`` through
``RedisKeys.sim_kv_hold``), and an after phase; then the drill waits until everything is
answered and the job is done. This module judges a run (pure); ``ops.drills.memory_drive``
drives one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laneway.constants import POOLS
from laneway.errors import ConfigError
from ops.drills.load import Outcome
from ops.drills.surge import WINDOW_S, Verdict, p99

__all__ = ["MemoryPlan", "MemoryRun", "MemorySample", "judge", "summary", "write_timeline"]


@dataclass(frozen=True)
class MemoryPlan:
    """Rates, phase lengths and sizes of one drill."""

    hi_rps: float = 5.0  # hi-band completions per second
    lo_rps: float = 1.0  # lo-band chats per second
    baseline_s: float = 30.0
    hold_s: float = 20.0  # with the cool-down, shorter than a chat's 30 s start deadline
    after_s: float = 20.0
    hold_share: float = 0.93  # of every simulated engine's KV memory
    batch_lines: int = 400
    warmup_s: float = 5.0  # the first seconds of the baseline are not judged
    settle_s: float = 5.0  # the hold reaches the engines within a heartbeat or two
    p99_ratio: float = 1.2
    shed_at: float = 0.9  # the workers' LANEWAY_MEMORY_SHED_AT
    max_tokens: int = 16  # of a hi completion
    lo_max_tokens: int = 256  # long answers: some run when the hold begins
    lo_context_chars: int = 8000  # a lo chat's context (about 2,000 tokens)
    batch_max_tokens: int = 128
    finish_within_s: float = 300.0  # after the traffic stops, for the job and the answers

    def __post_init__(self) -> None:
        if not (self.hi_rps > 0 and self.lo_rps > 0):
            raise ConfigError(
                f"--hi-rps and --lo-rps must be above 0, not {self.hi_rps}, {self.lo_rps}"
            )
        if not self.baseline_s > self.warmup_s + WINDOW_S:
            raise ConfigError(
                f"--baseline-s {self.baseline_s:g} leaves no baseline to measure after "
                f"{self.warmup_s:g} s of warm-up: give it more than {self.warmup_s + WINDOW_S:g}"
            )
        if not self.hold_s > self.settle_s + WINDOW_S:
            raise ConfigError(
                f"--hold-s {self.hold_s:g} leaves nothing to judge after the {self.settle_s:g} s "
                f"the hold takes to reach the engines: give it more than "
                f"{self.settle_s + WINDOW_S:g}"
            )
        if not self.shed_at < self.hold_share <= 1:
            raise ConfigError(
                f"--hold must be above the shed mark ({self.shed_at:g}) and at most 1, "
                f"not {self.hold_share:g}"
            )
        if self.batch_lines < 1 or self.after_s < 0:
            raise ConfigError("--batch-lines must be at least 1 and --after-s at least 0")

    @classmethod
    def short(cls, **overrides: Any) -> MemoryPlan:
        """A small drill (about a minute): fewer lines, shorter phases."""
        values: dict[str, Any] = {
            "hi_rps": 3.0,
            "lo_rps": 0.5,
            "baseline_s": 12.0,
            "hold_s": 12.0,
            "after_s": 4.0,
            "batch_lines": 100,
            "warmup_s": 3.0,
            "settle_s": 5.0,
            "batch_max_tokens": 64,
        }
        return cls(**{**values, **overrides})

    @property
    def hold_start(self) -> float:
        return self.baseline_s

    @property
    def hold_end(self) -> float:
        return self.baseline_s + self.hold_s

    @property
    def judged_from(self) -> float:
        """From here to the hold's end the engines must be pressed and shed work waiting."""
        return self.hold_start + self.settle_s


@dataclass
class MemorySample:
    """The workers' heartbeats at one moment (``t``: seconds since the drill began), by pool;
    None: no live worker of the pool."""

    t: float
    kv: dict[str, float | None] = field(default_factory=dict)  # the highest of its workers
    pressed: dict[str, bool] = field(default_factory=dict)
    shed: dict[str, int] = field(default_factory=dict)  # since the workers started
    waiting: dict[str, int] = field(default_factory=dict)  # in the dispatch queues
    batch_done: int | None = None  # lines of the drill's job done


@dataclass
class MemoryRun:
    """What one drill saw: its requests, samples, and the usage events of all its work."""

    plan: MemoryPlan
    hi: list[Outcome] = field(default_factory=list)
    lo: list[Outcome] = field(default_factory=list)
    samples: list[MemorySample] = field(default_factory=list)
    usage: list[dict[str, Any]] = field(default_factory=list)  # events of its requests and job
    batch_id: str = ""
    batch_total: int = 0
    batch_completed: int = 0
    batch_failed: int = 0
    batch_output_ids: list[str] = field(default_factory=list)  # custom_id of each output line
    began_wall: float = 0.0  # time.time() when the drill began (usage events' clock)

    def events_of(self, ids: set[str]) -> list[dict[str, Any]]:
        return [e for e in self.usage if e.get("id") in ids]

    def batch_events(self) -> list[dict[str, Any]]:
        return [e for e in self.usage if self.batch_id and e.get("job_id") == self.batch_id]


def _latencies(outcomes: Sequence[Outcome], start: float, end: float) -> list[float]:
    return [
        o.latency_s if o.status == 200 else math.inf for o in outcomes if start <= o.sent_at < end
    ]


def hi_p99s(run: MemoryRun) -> tuple[float, float]:
    """(baseline, hold) P99 of hi completions sent after the warm-up and before the hold, and
    while the hold was judged."""
    plan = run.plan
    before = p99(_latencies(run.hi, plan.warmup_s, plan.hold_start))
    during = p99(_latencies(run.hi, plan.judged_from, plan.hold_end))
    return before, during


def _finished_while_held(run: MemoryRun, events: Sequence[dict[str, Any]]) -> int:
    """Events of work that ended while the hold was judged (it should all have waited)."""
    plan = run.plan
    return sum(
        1
        for e in events
        if e.get("status") == "ok"
        and plan.judged_from <= float(e.get("ts", 0.0)) - run.began_wall < plan.hold_end
    )


def _waited(run: MemoryRun, event: dict[str, Any]) -> bool:
    """Whether the request of ``event`` was sent during the hold and ended after it."""
    plan = run.plan
    sent = float(event.get("ts", 0.0)) - float(event.get("total_ms", 0.0)) / 1000
    ended = float(event.get("ts", 0.0))
    return plan.hold_start <= sent - run.began_wall < plan.hold_end <= ended - run.began_wall


def _one_ok_each(events: Sequence[dict[str, Any]], ids: set[str]) -> tuple[int, int, int]:
    """(ids with exactly one event, and it ok; ids with none; events beyond one per id)."""
    count = Counter(e["id"] for e in events)
    ok = {e["id"] for e in events if e.get("status") == "ok"}
    return (
        sum(1 for i in ids if count[i] == 1 and i in ok),
        sum(1 for i in ids if count[i] == 0),
        sum(max(0, n - 1) for n in count.values()),
    )


def _held_row(run: MemoryRun) -> Verdict:
    plan = run.plan
    judged = [s for s in run.samples if plan.judged_from <= s.t < plan.hold_end]
    parts, ok = [], bool(judged)
    for pool in POOLS:
        values = [s.kv.get(pool) for s in judged]
        known = [v for v in values if v is not None]
        pressed = sum(1 for s in judged if s.pressed.get(pool))
        if not known or len(known) < len(values):
            parts.append(f"{pool}: no heartbeat")
            ok = False
            continue
        parts.append(f"{pool} ≥ {min(known):.0%}, pressed {pressed}/{len(judged)}")
        ok = ok and min(known) >= plan.shed_at and pressed == len(judged)
    return Verdict(
        f"memory held at ≥ {plan.shed_at:.0%}",
        f"every pool's engine, +{plan.settle_s:g} s to the hold's end (heartbeats)",
        "; ".join(parts) if judged else "no samples",
        ok,
    )


def judge(run: MemoryRun) -> list[Verdict]:
    """The drill's verdicts (pure: also what the unit tests check)."""
    plan = run.plan
    rows = [_held_row(run)]

    batch = run.batch_events()
    lines = {e["id"] for e in batch}
    shed_lines = {e["id"] for e in batch if e.get("preempted")}
    early = _finished_while_held(run, batch)
    rows.append(
        Verdict(
            "batch shed under pressure",
            "lines aborted and queued again; none finished while held",
            f"{len(shed_lines)} lines shed; {early} finished while held",
            bool(shed_lines) and early == 0,
        )
    )
    whole, missing, extra = _one_ok_each(batch, lines)
    distinct = len(set(run.batch_output_ids))
    dupes = len(run.batch_output_ids) - distinct
    rows.append(
        Verdict(
            "batch finished later, 0 lost",
            "every line one result and one usage event, ok",
            f"{run.batch_completed}/{run.batch_total} completed, {run.batch_failed} failed; "
            f"{distinct} results ({dupes} twice); {whole} lines with one ok usage event",
            run.batch_total > 0
            and run.batch_completed == run.batch_total
            and run.batch_failed == 0
            and distinct == run.batch_total
            and dupes == 0
            and whole == run.batch_total
            and missing == 0
            and extra == 0,
        )
    )

    lo_ids = {o.request_id for o in run.lo if o.request_id}
    lo_events = run.events_of(lo_ids)
    shed_lo = {e["id"] for e in lo_events if e.get("preempted")}
    held_lo = {e["id"] for e in lo_events if e["id"] not in shed_lo and _waited(run, e)}
    early = _finished_while_held(run, lo_events)
    rows.append(
        Verdict(
            "lo band shed under pressure",
            "running lo chats aborted and queued again, new ones held back; none finished "
            "while held",
            f"{len(shed_lo)} aborted, {len(held_lo)} held back; {early} finished while held",
            bool(shed_lo | held_lo) and early == 0,
        )
    )
    answered = sum(1 for o in run.lo if o.status == 200)
    whole, missing, extra = _one_ok_each(lo_events, lo_ids)
    rows.append(
        Verdict(
            "lo band finished later, 0 lost",
            "every lo chat answered 200, one ok usage event each",
            f"{answered}/{len(run.lo)} answered 200; {whole} with one ok usage event",
            bool(run.lo) and answered == len(run.lo) == len(lo_ids) == whole and extra == 0,
        )
    )

    hi_ids = {o.request_id for o in run.hi if o.request_id}
    hi_shed = sum(1 for e in run.events_of(hi_ids) if e.get("preempted"))
    rows.append(
        Verdict("hi band never shed", "0 hi completions aborted", f"{hi_shed}", hi_shed == 0)
    )
    before, during = hi_p99s(run)
    ratio = during / before if before > 0 else math.nan
    spread = (
        _spread(run, plan.warmup_s, plan.hold_start),
        _spread(run, plan.judged_from, plan.hold_end),
    )
    rows.append(
        Verdict(
            f"hi completion P99 within {plan.p99_ratio:g}× of before",
            f"P99 while held ≤ {plan.p99_ratio:g}× the baseline's",
            f"before {_ms(before)} ({spread[0]}), while held {_ms(during)} ({spread[1]}): "
            f"{ratio:.2f}×",
            math.isfinite(ratio) and ratio <= plan.p99_ratio,
        )
    )
    return rows


def _spread(run: MemoryRun, start: float, end: float) -> str:
    """The range of hi P99s over the windows of [start, end): the noise of the measure."""
    values = []
    while start + WINDOW_S <= end + 1e-9:
        values.append(p99(_latencies(run.hi, start, start + WINDOW_S)))
        start += WINDOW_S
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return "no windows"
    return f"per {WINDOW_S:g} s {_ms(min(known))}–{_ms(max(known))}"


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "n/a"
    return "∞ (unanswered)" if math.isinf(seconds) else f"{seconds * 1000:.0f} ms"


def summary(run: MemoryRun) -> str:
    """Requests sent, answered 200 and not, per phase and band."""
    plan = run.plan
    phases = [
        ("baseline", 0.0, plan.hold_start),
        ("held", plan.hold_start, plan.hold_end),
        ("after", plan.hold_end, plan.hold_end + plan.after_s),
    ]
    lines = [
        "| phase | hi sent | hi 200 | hi P99 | lo sent | lo 200 | lo P99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, begin, end in phases:
        row = [name]
        for outcomes in (run.hi, run.lo):
            sent = [o for o in outcomes if begin <= o.sent_at < end]
            row += [
                str(len(sent)),
                str(sum(o.status == 200 for o in sent)),
                _ms(p99(_latencies(outcomes, max(begin, plan.warmup_s), end))),
            ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(
        f"\nbatch job {run.batch_id}: {run.batch_total} lines, {run.batch_completed} completed, "
        f"{run.batch_failed} failed"
    )
    for band, outcomes in (("hi", run.hi), ("lo", run.lo)):
        failed = Counter(o.status for o in outcomes if o.status != 200)
        if failed:
            statuses = ", ".join(f"{n}× {status or 'no answer'}" for status, n in failed.items())
            lines.append(f"{band} not answered 200: {statuses}")
    for event in run.usage:
        if event.get("status") != "ok":
            lines.append(
                f"usage event {event.get('id')}: {event.get('status')}: {event.get('error')}"
            )
    return "\n".join(lines)


def write_timeline(run: MemoryRun, path: Path, title: str) -> Path:
    """Draw ``run`` into ``path`` (PNG): KV usage, requests/s, hi P99, shed and waiting work."""
    from ops.drills.timeline import finish_figure, or_nan, pyplot  # noqa: PLC0415 - matplotlib is optional

    plt = pyplot()
    plan, samples = run.plan, run.samples
    end = max([math.ceil(s.t) for s in samples] + [math.ceil(plan.hold_end + plan.after_s)])
    fig, axes = plt.subplots(4, 1, figsize=(8, 8.5), sharex=True, dpi=80)
    times = [s.t for s in samples]
    for pool in POOLS:
        axes[0].plot(times, [_pct(s.kv.get(pool)) for s in samples], label=f"{pool} KV cache")
    axes[0].axhline(plan.shed_at * 100, color="grey", linestyle="--", label="shed mark")
    axes[0].set_ylabel("% used")
    seconds = list(range(end))
    for band, outcomes in (("hi completions", run.hi), ("lo chats", run.lo)):
        answered = Counter(int(o.sent_at) for o in outcomes if o.status == 200)
        axes[1].plot(seconds, [answered[s] for s in seconds], label=f"{band} answered 200")
    axes[1].set_ylabel("requests/s (by send)")
    windows = []
    start = plan.warmup_s
    while start + WINDOW_S <= plan.hold_end + plan.after_s:
        windows.append((start + WINDOW_S, p99(_latencies(run.hi, start, start + WINDOW_S))))
        start += WINDOW_S
    axes[2].step(
        [t for t, _ in windows],
        [v * 1000 if math.isfinite(v) else math.nan for _, v in windows],
        where="pre",
        label=f"hi completion P99 per {WINDOW_S:g} s (sent in)",
    )
    before, _ = hi_p99s(run)
    axes[2].axhline(before * plan.p99_ratio * 1000, color="grey", linestyle="--",
                    label=f"{plan.p99_ratio:g}× baseline")  # fmt: skip
    axes[2].set_ylabel("ms")
    shed0 = samples[0].shed if samples else {}
    for pool in ("batch", "chat"):
        axes[3].plot(times, [s.shed.get(pool, 0) - shed0.get(pool, 0) for s in samples],
                     label=f"{pool}: shed (cumulative)")  # fmt: skip
        axes[3].plot(times, [s.waiting.get(pool, 0) for s in samples], linestyle=":",
                     label=f"{pool}: waiting in the worker")  # fmt: skip
    axes[3].set_ylabel("requests")
    done = axes[3].twinx()  # hundreds of lines beside a handful shed
    done.plot(times, [or_nan(s.batch_done) for s in samples], color="purple",
              label="batch lines done (right)")  # fmt: skip
    done.set_ylabel("lines done")
    done.legend(loc="lower right", fontsize=7)
    axes[3].set_xlabel("seconds since the drill began")
    for ax in axes:
        ax.axvspan(plan.hold_start, plan.hold_end, color="red", alpha=0.08)
    return finish_figure(fig, axes, title, path)


def _pct(value: float | None) -> float:
    return math.nan if value is None else value * 100
